"""Tokenizers: special ids, and save() files that transformers loads to the same ids."""

import inspect
import json
import textwrap

import numpy as np
import pytest
import sentencepiece
import tokenizers as hf_tokenizers
import transformers

import gemma_jax as gj
from gemma_jax.text import chat
from gemma_jax.text import tokenizers

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 👋🏽 日本語", "tabs\tand  spaces \r\n",
         "\x00\x7f\xff"]
MARKERS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]


def train_sentencepiece(directory, markers=True):
  """A Gemma-like SentencePiece model (BPE, byte fallback, no dummy prefix)."""
  corpus = directory / "corpus.txt"
  corpus.write_text(inspect.getsource(textwrap) + "\n".join(TEXTS), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(directory / "sp"), vocab_size=500, minloglevel=2,
      model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>",
      eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", byte_fallback=True,
      user_defined_symbols=MARKERS[3:] if markers else [], add_dummy_prefix=False,
      remove_extra_whitespaces=False, normalization_rule_name="identity")
  return str(directory / "sp.model")


def train_bpe_json(directory):
  """A byte-level BPE tokenizer.json with Gemma's special tokens first."""
  tokenizer = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
  tokenizer.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = hf_tokenizers.decoders.ByteLevel()
  trainer = hf_tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=MARKERS,
      initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator([inspect.getsource(textwrap), *TEXTS], trainer)
  path = str(directory / "tokenizer.json")
  tokenizer.save(path)
  return path


def test_byte_tokenizer_ids():
  tok = tokenizers.ByteTokenizer()
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (261, 0, 1, 2)
  assert (tok.start_of_turn_id, tok.end_of_turn_id, tok.stop_ids) == (259, 260, (2, 260))
  for text in TEXTS:
    expected = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 3
    np.testing.assert_array_equal(tok.encode([text])[0], expected)
  assert tok.decode([1, 259, *tok.encode(["ok"])[0], 260, 2, 0, 300]) == "ok"


def test_saved_byte_tokenizer_encodes_and_decodes_like_ours_in_transformers(tmp_path):
  tok = tokenizers.ByteTokenizer()
  tok.save(str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  loaded = tokenizers.get_tokenizer(str(tmp_path), model_vocab_size=512)
  for text in TEXTS:
    ids = tok.encode([text])[0].tolist()
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids
    assert theirs(text)["input_ids"] == [1, *ids]
    assert loaded.encode([text])[0].tolist() == ids
    assert theirs.decode(ids) == loaded.decode(ids) == text
  assert theirs("<start_of_turn>x<end_of_turn>", add_special_tokens=False)["input_ids"] == \
      [259, 3 + ord("x"), 260]
  assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 0)
  assert theirs.decode([1, 259, 3 + ord("a"), 260, 2], skip_special_tokens=True) == "a"
  assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.pad_id,
          loaded.start_of_turn_id, loaded.end_of_turn_id) == (261, 1, 2, 0, 259, 260)


def test_sentencepiece_model_special_ids_and_saved_copy(tmp_path):
  path = train_sentencepiece(tmp_path)
  tok = tokenizers.get_tokenizer(path, model_vocab_size=512)
  processor = sentencepiece.SentencePieceProcessor(model_file=path)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert tok.start_of_turn_id == processor.piece_to_id("<start_of_turn>") == 4
  assert tok.end_of_turn_id == processor.piece_to_id("<end_of_turn>") == 5
  assert tok.stop_ids == (1, 5) and tok.chat_style == "gemma3"
  assert tok.decode([2, 4, *processor.encode("hi there"), 5, 1]) == "hi there"
  tok.save(str(tmp_path / "saved"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
  for text in TEXTS:
    assert theirs(text, add_special_tokens=False)["input_ids"] == processor.encode(text)
  assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (2, 1, 0)
  again = tokenizers.get_tokenizer(str(tmp_path / "saved"), model_vocab_size=512)
  assert isinstance(again, tokenizers.SentencePieceTokenizer)
  assert again.encode(TEXTS[1:2])[0].tolist() == processor.encode(TEXTS[1])


def test_sentencepiece_model_without_turn_markers_cannot_render_chat(tmp_path):
  tok = tokenizers.get_tokenizer(train_sentencepiece(tmp_path, markers=False), 512)
  assert (tok.start_of_turn_id, tok.end_of_turn_id, tok.stop_ids) == (None, None, (1,))
  with pytest.raises(ValueError, match="has no turn markers"):
    chat.render([{"role": "user", "content": "hi"}], tok)


def test_tokenizer_json_by_file_and_directory(tmp_path):
  path = train_bpe_json(tmp_path)
  reference = hf_tokenizers.Tokenizer.from_file(path)
  for name in (path, str(tmp_path)):
    tok = tokenizers.get_tokenizer(name, model_vocab_size=400)
    assert isinstance(tok, tokenizers.JsonTokenizer) and tok.vocab_size == 400
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.start_of_turn_id, tok.end_of_turn_id) == \
        (0, 1, 2, 3, 4)
    for text in TEXTS:
      assert tok.encode([text])[0].tolist() == reference.encode(text).ids
      assert tok.decode([2, 3, *reference.encode(text).ids, 4, 1]) == text
  tok.save(str(tmp_path / "saved"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
  assert theirs(TEXTS[1], add_special_tokens=False)["input_ids"] == reference.encode(TEXTS[1]).ids
  assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (2, 1, 0)


def test_tokenizer_json_takes_special_token_names_from_its_config(tmp_path):
  path = train_bpe_json(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "<start_of_image>"}, "eos_token": "<end_of_turn>"}))
  tok = tokenizers.get_tokenizer(path, model_vocab_size=400)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (5, 4, 0)


def test_a_directory_prefers_tokenizer_json(tmp_path):
  train_bpe_json(tmp_path)
  train_sentencepiece(tmp_path)
  (tmp_path / "sp.model").rename(tmp_path / "tokenizer.model")
  assert isinstance(tokenizers.get_tokenizer(str(tmp_path), 512), tokenizers.JsonTokenizer)
  (tmp_path / "tokenizer.json").unlink()
  assert isinstance(tokenizers.get_tokenizer(str(tmp_path), 512),
                    tokenizers.SentencePieceTokenizer)


@pytest.mark.parametrize("files,message", [
    ({}, "is a directory without tokenizer.json or tokenizer.model"),
    ({"tokenizer.json": "{not json"}, "is not a tokenizers tokenizer.json"),
    ({"tokenizer.model": "not a model"}, "is not a SentencePiece model file"),
])
def test_bad_tokenizer_directories_are_config_errors(tmp_path, files, message):
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  with pytest.raises(gj.ConfigError, match=message) as error:
    tokenizers.get_tokenizer(str(tmp_path), model_vocab_size=512)
  assert error.value.field == "data.tokenizer"


def test_tokenizer_json_without_bos_is_a_config_error(tmp_path):
  path = train_bpe_json(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
  with pytest.raises(gj.ConfigError, match=r"has no BOS piece \(bos_id=None\)") as error:
    tokenizers.get_tokenizer(path, model_vocab_size=512)
  assert error.value.field == "data.tokenizer"
