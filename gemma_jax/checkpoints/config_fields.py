"""A transformers config.json, read value by value: each value a reader takes is checked
for its kind (type and range, or a known name) as it is read, so a wrong one is one
error naming its field, never a TypeError where the model is built.

    text = Section(config_json["text_config"], "text_config.")
    heads = text.read("num_attention_heads", POSITIVE_INT)
    # FieldError: text_config.num_attention_heads: expected a positive int, got '8'

The readers of each family (`gemma_config`, `gpt2`, `gemma3_tower`, `gemma4_tower`)
say what they take; their callers turn a FieldError into an error naming the file.
"""

import reprlib
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

from gemma_jax.config.validation import is_finite, is_integer


class FieldError(ValueError):
  """A config value missing, or not of the kind its reader takes; the message names
  the field ("text_config.head_dim: ...")."""


class Kind(NamedTuple):
  """What a value must be: a test, and the words an error says it in."""
  accepts: Callable[[Any], bool]
  expected: str


def integer(minimum: int, maximum: Optional[int] = None) -> Kind:
  """An int in [minimum, maximum]; with no maximum, below 2**31: sizes, counts and token
  ids are int32 where the model computes with them."""
  if maximum is not None:
    return Kind(lambda v: is_integer(v) and minimum <= v <= maximum,
                f"an int in [{minimum}, {maximum}]")
  return Kind(lambda v: is_integer(v) and minimum <= v < 2**31,
              f"{'a positive int' if minimum == 1 else f'an int >= {minimum}'} below 2**31")


def one_of(names: Iterable[str]) -> Kind:
  """One of these strings."""
  names = sorted(names)
  return Kind(lambda v: isinstance(v, str) and v in names, f"one of {names}")


def optional(kind: Kind) -> Kind:
  """`kind`, or null."""
  return Kind(lambda v: v is None or kind.accepts(v), f"{kind.expected} or null")


POSITIVE_INT = integer(1)
COUNT = integer(0)
# A model's layer count: more than any transformers checkpoint holds is refused as the
# config is read, before a list of layer types is built for billions of layers (the count
# is checked against the checkpoint's tensors later, once they are listed).
LAYER_COUNT = integer(1, 10_000)
POSITIVE = Kind(lambda v: is_finite(v) and v > 0, "a finite positive number")
FRACTION = Kind(lambda v: is_finite(v) and 0 < v <= 1, "a number in (0, 1]")
FLAG = Kind(lambda v: isinstance(v, bool), "true or false")
STRING = Kind(lambda v: isinstance(v, str), "a string")
STRINGS = Kind(lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
               "a list of strings")
OBJECT = Kind(lambda v: isinstance(v, dict), "an object")

_REQUIRED = object()
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 200   # (a file's path fits; a megabyte does not)


def shown(value) -> str:
  """A repr of a config value for a message, long strings, lists and deep nesting
  abbreviated."""
  return _SHORT.repr(value)


class Section:
  """One object of a config.json, `where` its path ("" for the top, "text_config." for
  one inside), read by kind, with `defaults` (transformers' values for keys the file
  leaves out)."""

  def __init__(self, values: Mapping, where: str = "", defaults: Mapping = None):
    self.values, self.where, self.defaults = values, where, defaults or {}

  def __contains__(self, key: str) -> bool:
    return key in self.values

  def keys(self):
    return self.values.keys()

  def read(self, key: str, kind: Kind, default: Any = _REQUIRED) -> Any:
    """The value at `key`, else `default`, else transformers' default; FieldError naming
    the field when there is none, or it is not of `kind` (`default` is not checked)."""
    if key in self.values:
      value = self.values[key]
    elif default is not _REQUIRED:
      return default
    elif key in self.defaults:
      value = self.defaults[key]
    else:
      raise FieldError(f"{self.where}{key} is missing and has no default")
    if not kind.accepts(value):
      raise FieldError(f"{self.where}{key}: expected {kind.expected}, got {shown(value)}")
    return value

  def section(self, key: str) -> "Section":
    """The object at `key` as a Section (empty where the key is absent or null)."""
    return Section(self.read(key, optional(OBJECT), None) or {}, f"{self.where}{key}.")

  def error(self, key: str, message: str) -> FieldError:
    """A FieldError naming the field `key` of this section."""
    return FieldError(f"{self.where}{key}: {message}")
