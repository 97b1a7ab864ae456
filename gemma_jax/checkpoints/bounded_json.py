"""JSON from files the library does not control (configs, safetensors headers, indexes,
data lines), parsed within bounds: a ValueError saying what is wrong, never a
RecursionError.

    value = bounded_json.loads(text)   # ValueError: not JSON, nested too deeply, ...
"""

import json
import re
from typing import Any, Union

# Arrays and objects nest at most this deep: json.loads recurses once a level, so deeper
# input would exhaust the interpreter's stack. Real configs and data nest a few levels.
MAX_DEPTH = 100
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


class NestedTooDeeply(ValueError):
  """Arrays and objects nest deeper than MAX_DEPTH."""

  def __init__(self):
    super().__init__(f"arrays and objects nest deeper than {MAX_DEPTH} levels")


def too_deep(text: str) -> bool:
  """Whether arrays and objects in JSON `text` nest deeper than MAX_DEPTH (brackets
  inside strings do not count)."""
  if text.count("[") + text.count("{") <= MAX_DEPTH:
    return False
  depth = 0
  for token in _STRING_OR_BRACKET.findall(text):
    if token in ("[", "{"):
      depth += 1
      if depth > MAX_DEPTH:
        return True
    elif token in ("]", "}"):
      depth -= 1
  return False


def loads(text: Union[str, bytes]) -> Any:
  """json.loads of `text` (bytes are UTF-8), refusing nesting deeper than MAX_DEPTH.

  Raises:
    NestedTooDeeply (a ValueError): nesting deeper than MAX_DEPTH.
    ValueError: not UTF-8 or not JSON (a json.JSONDecodeError, with its position), or a
      number too long for Python's int.
  """
  if isinstance(text, bytes):
    text = text.decode("utf-8")   # UnicodeDecodeError is a ValueError
  if too_deep(text):
    raise NestedTooDeeply()
  return json.loads(text)
