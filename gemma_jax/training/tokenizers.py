"""Text <-> token ids: a byte-level tokenizer, or a SentencePiece model by path.

Both expose `vocab_size`, the special ids `pad_id`, `bos_id`, `eos_id`, and
`encode(texts) -> list of int32 arrays` / `decode(ids) -> str`.
"""

import os
from typing import Sequence

import numpy as np
import sentencepiece

from gemma_jax.config import ConfigError


class ByteTokenizer:
  """UTF-8 bytes shifted past three special ids: 0 pad, 1 bos, 2 eos, 3 + byte."""
  pad_id, bos_id, eos_id = 0, 1, 2
  _offset = 3
  vocab_size = 256 + _offset

  def encode(self, texts: Sequence[str]) -> list:
    return [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self._offset
            for text in texts]

  def decode(self, ids: Sequence[int]) -> str:
    # Special ids, and ids past the bytes (a model's vocabulary may be larger), are skipped.
    data = bytes(int(i) - self._offset for i in ids if self._offset <= i < self.vocab_size)
    return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model file, e.g. Gemma's tokenizer.model (pad 0, eos 1, bos 2)."""

  def __init__(self, path: str):
    self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._processor.vocab_size()
    self.bos_id = self._processor.bos_id()
    self.eos_id = self._processor.eos_id()
    # Padding is masked by segment id 0, so any valid id serves when the model has none.
    self.pad_id = max(self._processor.pad_id(), 0)

  def encode(self, texts: Sequence[str]) -> list:
    ids = self._processor.encode(list(texts), num_threads=os.cpu_count() or 1)
    return [np.asarray(row, np.int32) for row in ids]

  def decode(self, ids: Sequence[int]) -> str:
    # Ids past the tokenizer's (a model's vocabulary may be larger) are skipped.
    return self._processor.decode([int(i) for i in ids if 0 <= i < self.vocab_size])


def get_tokenizer(name: str, model_vocab_size: int):
  """"byte" or a SentencePiece model path -> tokenizer whose ids fit the model.

  Raises:
    ConfigError (field data.tokenizer): no such model file, a directory, a file that
      is not a SentencePiece model, a model without a BOS or EOS id, or a vocabulary
      larger than `model_vocab_size`.
  """
  if name == "byte":
    tokenizer = ByteTokenizer()
  elif os.path.isdir(name):
    raise ConfigError("data.tokenizer", f"{name!r} is a directory (expected 'byte' or a "
                      "SentencePiece model file)")
  elif os.path.isfile(name):
    try:
      tokenizer = SentencePieceTokenizer(name)
    except (RuntimeError, OSError) as error:
      # sentencepiece raises RuntimeError for a file it cannot parse (or an empty one).
      raise ConfigError("data.tokenizer", f"{name!r} is not a SentencePiece model file "
                        f"({error})") from None
    for piece, piece_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
      if piece_id < 0:
        raise ConfigError("data.tokenizer", f"{name!r} has no {piece.upper()} piece "
                          f"({piece}_id={piece_id}); training packs [bos] doc [eos]")
  else:
    raise ConfigError("data.tokenizer",
                      f"no file at {name!r} (expected 'byte' or a SentencePiece model path)")
  if tokenizer.vocab_size > model_vocab_size:
    raise ConfigError("data.tokenizer",
                      f"vocabulary of {tokenizer.vocab_size} ids does not fit "
                      f"model.vocab_size={model_vocab_size}")
  return tokenizer
