"""The text of a growing token sequence, piece by piece, at a cost a token that does not
grow with the sequence.

    stream = TextStream(tokenizer)
    for token in tokens:
      print(stream.add(token), end="")
    print(stream.flush())

Decoding every token so far at each new one costs O(n) a token, O(n^2) a reply. Here a
piece is what decoding `ids[prefix:]` adds to decoding `ids[prefix:read]`: `read` ends
the tokens already shown and `prefix` starts those shown by the piece before, kept as
context so that a tokenizer that treats a sequence's first token apart (SentencePiece
drops its leading space) decodes the new tokens as it does inside the whole sequence. A
piece ending in U+FFFD (a UTF-8 character whose bytes are still to come) is held back
until a later token completes it, or `flush`. The pieces joined are the whole
sequence's text.
"""

from typing import List

_REPLACEMENT = "\ufffd"


class TextStream:
  """Pieces of text of the tokens `add`ed so far (`ids`), through `tokenizer.decode`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: List[int] = []
    self._prefix = self._read = 0

  def add(self, token: int) -> str:
    """The text `token` completes ("" while a character is incomplete)."""
    self.ids.append(int(token))
    return self._piece(final=False)

  def flush(self) -> str:
    """The text held back (an incomplete character's replacement), "" if none."""
    return self._piece(final=True)

  def _piece(self, final: bool) -> str:
    shown = self.tokenizer.decode(self.ids[self._prefix:self._read])
    text = self.tokenizer.decode(self.ids[self._prefix:])
    if len(text) <= len(shown) or (text.endswith(_REPLACEMENT) and not final):
      return ""
    self._prefix, self._read = self._read, len(self.ids)
    return text[len(shown):]
