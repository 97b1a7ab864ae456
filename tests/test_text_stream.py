"""`TextStream`: a growing token sequence's text in pieces, against decoding it whole."""

import inspect
import textwrap

import numpy as np
import pytest
import sentencepiece

from gemma_jax.text.text_stream import TextStream
from gemma_jax.text import tokenizers
from test_tokenizers import TEXTS, train_bpe_json, train_sentencepiece


class CountingTokenizer:
  """A tokenizer whose `decode` records how many ids it was given."""

  def __init__(self, tokenizer):
    self.tokenizer, self.lengths = tokenizer, []

  def decode(self, ids):
    self.lengths.append(len(ids))
    return self.tokenizer.decode(ids)


def streamed(tokenizer, ids):
  stream = TextStream(tokenizer)
  pieces = [stream.add(i) for i in ids]
  return pieces, stream.flush()


def llama_like_sentencepiece(directory):
  """A SentencePiece model that prefixes a space and drops it again at the start of the
  text it decodes, so a sequence's first token decodes apart from the same token inside."""
  corpus = directory / "corpus.txt"
  corpus.write_text(inspect.getsource(textwrap) + "\n".join(TEXTS), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(directory / "llama"), vocab_size=500,
      minloglevel=2, byte_fallback=True, add_dummy_prefix=True)
  return str(directory / "llama.model")


TOKENIZERS = {
    "byte": lambda path: tokenizers.ByteTokenizer(),
    "json": lambda path: tokenizers.get_tokenizer(train_bpe_json(path), 400),
    "gemma-like sentencepiece": lambda path: tokenizers.get_tokenizer(
        train_sentencepiece(path), 512),
    "llama-like sentencepiece": lambda path: tokenizers.get_tokenizer(
        llama_like_sentencepiece(path), 512),
}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_pieces_join_to_the_whole_text(tmp_path, name):
  """Encoded texts (multi-byte characters, spaces, byte fallback) and random ids (bytes
  that form no character, special ids) alike."""
  tokenizer = TOKENIZERS[name](tmp_path)
  rng = np.random.default_rng(0)
  sequences = [list(tokenizer.encode([text])[0]) for text in TEXTS + [" ".join(TEXTS)]]
  sequences += [rng.integers(0, tokenizer.vocab_size, n).tolist() for n in (1, 7, 300)]
  for ids in sequences:
    whole = tokenizer.decode(ids)
    pieces, rest = streamed(tokenizer, ids)
    assert "".join(pieces) + rest == whole, (name, ids)
    # Only the last piece may end inside a character.
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_a_character_is_held_back_until_its_bytes_are_in():
  tokenizer = tokenizers.ByteTokenizer()
  ids = tokenizer.encode(["a€b"])[0].tolist()   # a, three bytes of the euro sign, b
  assert streamed(tokenizer, ids) == (["a", "", "", "€", "b"], "")
  assert streamed(tokenizer, ids[:3]) == (["a", "", ""], "\ufffd")


def test_a_piece_decodes_a_bounded_span_however_long_the_sequence():
  """Decoding the whole sequence at every token cost O(n) a token."""
  counting = CountingTokenizer(tokenizers.ByteTokenizer())
  ids = counting.tokenizer.encode(["Streaming text, é and 日本語 too. " * 100])[0]
  pieces, _ = streamed(counting, ids)
  assert len(ids) > 3000 and "".join(pieces) == counting.tokenizer.decode(ids)
  assert max(counting.lengths) <= 6   # the piece before and a character: 3 bytes each at most
