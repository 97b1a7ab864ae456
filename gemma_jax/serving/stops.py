"""A request's text as it grows, cut at its first stop string.

Text that might still turn into a stop string ("\\n\\nUs" before "\\n\\nUser:") is held
back until a later token settles it, so no client ever sees part of a stop string.
"""

from typing import Sequence, Tuple

from gemma_jax.text.text_stream import TextStream


class StopText:
  """The text of tokens `add`ed through `tokenizer`, up to the first of `stops`."""

  def __init__(self, tokenizer, stops: Sequence[str]):
    self._stream = TextStream(tokenizer)
    self._stops = tuple(stops)
    self._held = ""

  def add(self, token: int) -> Tuple[str, bool]:
    """(the text `token` releases, whether a stop string ended the text)."""
    self._held += self._stream.add(token)
    return self._release()

  def flush(self) -> Tuple[str, bool]:
    """The text has ended: (the text still held, up to a stop string it completes;
    whether it did)."""
    self._held += self._stream.flush()
    text, stopped = self._release()
    if not stopped:
      text, self._held = text + self._held, ""
    return text, stopped

  def _release(self) -> Tuple[str, bool]:
    found = [i for i in (self._held.find(stop) for stop in self._stops) if i >= 0]
    if found:
      text, self._held = self._held[:min(found)], ""
      return text, True
    keep = max((n for stop in self._stops for n in range(1, len(stop))
                if self._held.endswith(stop[:n])), default=0)
    cut = len(self._held) - keep
    text, self._held = self._held[:cut], self._held[cut:]
    return text, False
