"""Data: documents, tokenizers, packing, splits, deterministic resumable order, sharding."""

import importlib.util
import inspect
import json
import logging
import os
import textwrap

import chex
import jax
import numpy as np
import pytest
import sentencepiece

import gemma_jax as gj
from gemma_jax.text import chat
from gemma_jax.training import data, metrics
from gemma_jax.text import tokenizers

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓", "import os\nprint(os.sep)\n",
         "a" * 70, "class A:\n    pass\n"]


def write_corpus(directory, texts=TEXTS):
  for i, text in enumerate(texts):
    (directory / f"doc{i}.txt").write_text(text, encoding="utf-8")
  return str(directory / "*.txt")


def reference_batch(tokens, segment_ids):
  """make_batch written as plain loops over each row."""
  positions, targets, weights = (np.zeros(tokens.shape, dt) for dt in (int, int, float))
  for r in range(tokens.shape[0]):
    for i in range(tokens.shape[1]):
      same_as_previous = i > 0 and segment_ids[r, i] == segment_ids[r, i - 1]
      positions[r, i] = positions[r, i - 1] + 1 if same_as_previous else 0
      if i + 1 < tokens.shape[1] and segment_ids[r, i] > 0 and \
          segment_ids[r, i + 1] == segment_ids[r, i]:
        targets[r, i], weights[r, i] = tokens[r, i + 1], 1.0
  return positions, targets, weights


# Tokenizers.

def test_byte_tokenizer_round_trips_unicode():
  tok = tokenizers.ByteTokenizer()
  for text in TEXTS:
    ids = tok.encode([text])[0]
    assert ids.dtype == np.int32 and ids.min() >= 3 and ids.max() < tok.vocab_size
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, *tok.encode(["ok"])[0], tok.eos_id, tok.pad_id]) == "ok"


def train_sentencepiece(directory, **special_ids):
  """A 200-piece SentencePiece model of textwrap's source; its path."""
  corpus = directory / "corpus.txt"
  corpus.write_text(inspect.getsource(textwrap), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(directory / "sp"), vocab_size=200, minloglevel=2,
      **special_ids)
  return str(directory / "sp.model")


def test_sentencepiece_model_by_path(tmp_path):
  path = train_sentencepiece(tmp_path, pad_id=0, eos_id=1, bos_id=2, unk_id=3)  # Gemma's ids
  tok = tokenizers.get_tokenizer(path, model_vocab_size=256)
  assert isinstance(tok, tokenizers.SentencePieceTokenizer)
  assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (200, 0, 1, 2)
  ids = tok.encode(["def f(x):"])[0]
  assert ids.dtype == np.int32 and tok.decode(ids) == "def f(x):"
  with pytest.raises(gj.ConfigError, match="vocabulary of 200 ids does not fit") as error:
    tokenizers.get_tokenizer(path, model_vocab_size=199)
  assert error.value.field == "data.tokenizer"


@pytest.mark.parametrize("special_ids,missing", [
    (dict(pad_id=0, eos_id=1, bos_id=-1, unk_id=2), r"no BOS piece \(bos_id=-1\)"),
    (dict(pad_id=0, eos_id=-1, bos_id=1, unk_id=2), r"no EOS piece \(eos_id=-1\)"),
])
def test_sentencepiece_model_without_bos_or_eos_is_a_config_error(tmp_path, special_ids,
                                                                  missing):
  """Packing writes [bos] doc [eos]: an id of -1 would be trained on."""
  path = train_sentencepiece(tmp_path, **special_ids)
  with pytest.raises(gj.ConfigError, match=missing) as error:
    tokenizers.get_tokenizer(path, model_vocab_size=256)
  assert error.value.field == "data.tokenizer" and path in str(error.value)


def test_tokenizer_errors_name_the_field(tmp_path):
  with pytest.raises(gj.ConfigError, match="no file at") as error:
    tokenizers.get_tokenizer(str(tmp_path / "missing.model"), model_vocab_size=512)
  assert error.value.field == "data.tokenizer"
  with pytest.raises(gj.ConfigError, match="is a directory without") as error:
    tokenizers.get_tokenizer(str(tmp_path), model_vocab_size=512)
  assert error.value.field == "data.tokenizer"
  with pytest.raises(gj.ConfigError, match="261 ids does not fit model.vocab_size=200"):
    tokenizers.get_tokenizer("byte", model_vocab_size=200)


def test_a_file_sentencepiece_cannot_load_is_a_config_error(tmp_path):
  """sentencepiece raises RuntimeError, which train.py would print as a traceback."""
  (tmp_path / "text.model").write_text("not a model\n")
  (tmp_path / "empty.model").write_bytes(b"")
  for name in ("text.model", "empty.model"):
    with pytest.raises(gj.ConfigError, match="is not a SentencePiece model file") as error:
      tokenizers.get_tokenizer(str(tmp_path / name), model_vocab_size=512)
    assert error.value.field == "data.tokenizer" and name in str(error.value)


# Documents.

def test_default_corpus_is_the_standard_library_source():
  files = data.stdlib_files()
  assert len(files) > 100 and all(f.endswith(".py") for f in files)
  assert not any("site-packages" in f for f in files)
  assert any(f.endswith("/json/__init__.py") for f in files)


def test_text_and_jsonl_documents_by_glob(tmp_path):
  write_corpus(tmp_path, TEXTS[:2])
  (tmp_path / "more.jsonl").write_text(
      json.dumps({"text": "third"}) + "\n\n" + json.dumps({"body": "x", "text": "fourth"}) + "\n")
  docs = data.read_documents(f"{tmp_path}/*.txt, {tmp_path}/*.jsonl")
  assert sorted(docs) == sorted(TEXTS[:2] + ["third", "fourth"])


def test_a_byte_order_mark_opens_a_jsonl_file(tmp_path):
  (tmp_path / "a.jsonl").write_bytes('{"text": "x"}\n{"text": "y"}\n'.encode("utf-8-sig"))
  assert data.read_documents(str(tmp_path / "a.jsonl")) == ["x", "y"]


@pytest.mark.parametrize("files,path,field,message", [
    ({}, "nowhere/*.txt", "data.path", "no file matches"),
    ({"a.txt": "", "b.txt": "  \n"}, "*.txt", "data.path", "hold no text"),
    ({"a.jsonl": '{"body": "x"}\n'}, "*.jsonl", "data.text_field", "a.jsonl:1"),
    ({"a.jsonl": '{"text": "x"}\n{"text": "cut'}, "*.jsonl", "data.path",
     r"a.jsonl:2 is not JSON \(Unterminated string starting at column 10\)"),
    ({"a.jsonl": '{"text": "x"}\n{"text": "y"\n'}, "*.jsonl", "data.path",
     r"a.jsonl:2 is not JSON \(Expecting ',' delimiter at the end of the line\)"),
    ({"a.jsonl": '{"text": "x"}\n{"text": "half a pair: \\ud83d"}\n'}, "*.jsonl", "data.path",
     r"a.jsonl:2 holds a lone UTF-16 surrogate '\\ud83d', which is not text"),
    ({"a.jsonl": '{"text": "x"}\n{"text": 3}\n'}, "*.jsonl", "data.text_field",
     r"a.jsonl:2 is not a JSON object with a 'text' string"),
    ({"a.jsonl": '{"text": "x"}\n\n{"text": null}\n'}, "*.jsonl", "data.text_field",
     "a.jsonl:3 is not"),
    ({"a.jsonl": b'{"text": "x"}\n{"text": "caf\xe9"}\n'}, "*.jsonl", "data.path",
     r"a.jsonl:2 is not UTF-8 \(.* byte 0xe9 in position 13"),
])
def test_missing_or_empty_data_names_the_field(tmp_path, files, path, field, message):
  for name, text in files.items():
    if isinstance(text, bytes):
      (tmp_path / name).write_bytes(text)
    else:
      (tmp_path / name).write_text(text)
  with pytest.raises(data.DataError, match=message) as error:
    data.read_documents(str(tmp_path / path))
  assert error.value.field == field
  assert str(error.value).startswith(f"config.{field}: ")


# Packing.

def test_pack_keeps_every_token_in_order_and_pads_the_last_row():
  docs = tokenizers.ByteTokenizer().encode(TEXTS)
  tokens, segment_ids = data.concatenate(docs, bos_id=1, eos_id=2)
  rows = data.pack(tokens, segment_ids, seq_len=16, pad_id=0)
  n = sum(len(d) + 2 for d in docs)
  chex.assert_shape([rows.tokens, rows.segment_ids], (-(-n // 16), 16))
  flat_tokens, flat_segments = rows.tokens.ravel(), rows.segment_ids.ravel()
  for i, doc in enumerate(docs, 1):
    np.testing.assert_array_equal(flat_tokens[flat_segments == i], [1, *doc, 2])
  np.testing.assert_array_equal(flat_segments[n:], 0)
  np.testing.assert_array_equal(flat_segments[:n], np.sort(flat_segments[:n]))


def test_batch_positions_targets_and_weights_match_a_loop_reference():
  rng = np.random.default_rng(0)
  segment_ids = np.sort(rng.integers(0, 4, (3, 20)), axis=1)[:, ::-1].copy()  # 0 = pad at end
  tokens = rng.integers(3, 259, (3, 20)).astype(np.int32)
  batch = data.make_batch(tokens, segment_ids)
  positions, targets, weights = reference_batch(tokens, segment_ids)
  np.testing.assert_array_equal(batch["positions"], positions)
  np.testing.assert_array_equal(batch["weights"], weights)
  np.testing.assert_array_equal(np.where(weights > 0, batch["targets"], 0), targets)
  assert {k: v.dtype for k, v in batch.items()} == dict(
      tokens=np.int32, segment_ids=np.int32, positions=np.int32, targets=np.int32,
      weights=np.float32)


@pytest.mark.slow
def test_packed_row_logits_equal_each_document_alone():
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(vocab_size=260, d_model=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64, num_layers=2, sliding_window=6,
                           attention_pattern=("local", "global")))
  model = gj.transform(config)
  docs = tokenizers.ByteTokenizer().encode(["x = 1\n", "def f():\n  pass", "import os"])
  tokens, segment_ids = data.concatenate(docs, bos_id=1, eos_id=2)
  rows = data.pack(tokens, segment_ids, seq_len=48, pad_id=0)
  assert len(rows) == 1
  batch = data.make_batch(rows.tokens, rows.segment_ids)
  params = model.init(jax.random.key(0), batch["tokens"])
  apply = jax.jit(model.apply)
  packed = apply(params, batch["tokens"], positions=batch["positions"],
                       segment_ids=batch["segment_ids"])[0]
  for i, doc in enumerate(docs, 1):
    alone = apply(params, np.asarray([[1, *doc, 2]], np.int32))[0]
    np.testing.assert_allclose(packed[batch["segment_ids"][0] == i], alone, atol=1e-5,
                               rtol=1e-5)


# Splits and order.

def test_splits_hold_every_token_once_and_are_seeded(tmp_path):
  config = gj.get_config("gemma3-tiny").data
  config.path, config.seq_len, config.eval_fraction = write_corpus(tmp_path), 8, 0.25
  tok = tokenizers.ByteTokenizer()
  train, held_out = data.load_splits(config, tok, seed=0)
  real = lambda rows: rows.tokens[rows.segment_ids > 0]
  total = sum(len(t.encode("utf-8")) + 2 for t in TEXTS)
  assert len(real(train)) + len(real(held_out)) == total
  assert len(real(held_out)) == round(0.25 * total)
  again, _ = data.load_splits(config, tok, seed=0)
  other, _ = data.load_splits(config, tok, seed=1)
  np.testing.assert_array_equal(train.tokens, again.tokens)
  assert not np.array_equal(real(train), real(other))


def make_rows(n_rows=10, seq_len=6):
  tokens = np.arange(n_rows * seq_len, dtype=np.int32).reshape(n_rows, seq_len)
  return data.Rows(tokens, np.ones_like(tokens))


def test_train_order_is_seeded_visits_every_row_each_epoch_and_resumes():
  rows = make_rows()
  batches = data.TrainBatches(rows, batch_size=5, seed=3, process_index=0, process_count=1)
  seen = [next(batches)["tokens"][:, 0] // 6 for _ in range(4)]   # two epochs of 10 rows
  assert sorted(np.concatenate(seen[:2])) == list(range(10))
  assert sorted(np.concatenate(seen[2:])) == list(range(10))
  assert not np.array_equal(np.concatenate(seen[:2]), np.concatenate(seen[2:]))

  resumed = data.TrainBatches(rows, batch_size=5, seed=3, process_index=0, process_count=1)
  resumed.restore(batches.state())
  fresh = data.TrainBatches(rows, batch_size=5, seed=3, process_index=0, process_count=1)
  expected = [fresh.batch(i) for i in range(4, 7)]
  for want in expected:
    chex.assert_trees_all_equal(next(resumed), want)
  other_seed = data.TrainBatches(rows, batch_size=5, seed=4, process_index=0, process_count=1)
  assert not np.array_equal(other_seed.batch(0)["tokens"], fresh.batch(0)["tokens"])


def test_a_resume_with_another_batch_size_goes_on_from_the_next_row():
  """Six rows taken in batches of 2, resumed in batches of 4: the next batch is rows 6-9
  of the same sequence (it was 12-15, rows 6-11 skipped). A position saved as batches
  (before rows) counts batches of the size resumed with."""
  rows = make_rows()
  one_by_one = data.TrainBatches(rows, batch_size=1, seed=3, process_index=0, process_count=1)
  sequence = np.concatenate([one_by_one.batch(j)["tokens"] for j in range(12)])
  first = data.TrainBatches(rows, batch_size=2, seed=3, process_index=0, process_count=1)
  for _ in range(3):
    next(first)
  resumed = data.TrainBatches(rows, batch_size=4, seed=3, process_index=0, process_count=1)
  resumed.restore(first.state())
  np.testing.assert_array_equal(next(resumed)["tokens"], sequence[6:10])
  resumed.restore({"next_batch": 2, "seed": 3, "rows": len(rows)})
  np.testing.assert_array_equal(next(resumed)["tokens"], sequence[8:12])


def test_processes_read_disjoint_slices_of_the_global_batch():
  rows = make_rows()
  whole = data.TrainBatches(rows, batch_size=4, seed=0, process_index=0, process_count=1)
  shards = [data.TrainBatches(rows, batch_size=4, seed=0, process_index=p, process_count=2)
            for p in range(2)]
  for i in range(3):
    np.testing.assert_array_equal(
        np.concatenate([s.batch(i)["tokens"] for s in shards]), whole.batch(i)["tokens"])
  with pytest.raises(gj.ConfigError, match="do not split over 3 processes") as error:
    data.TrainBatches(rows, batch_size=4, seed=0, process_index=0, process_count=3)
  assert error.value.field == "train.batch_size"


def test_eval_batches_are_the_first_rows_in_order_padded():
  rows = make_rows(n_rows=5)
  batches = data.eval_batches(rows, batch_size=2, num_batches=4, process_index=0,
                              process_count=1)
  assert len(batches) == 3
  np.testing.assert_array_equal(np.concatenate([b["tokens"] for b in batches])[:5], rows.tokens)
  np.testing.assert_array_equal(batches[-1]["weights"][1], 0)
  assert len(data.eval_batches(rows, batch_size=2, num_batches=1, process_index=0,
                               process_count=1)) == 1


# Chat data.

def conversation(i, system=False, turns=1):
  """A small valid conversation, distinct for each i."""
  messages = [{"role": "system", "content": f"sys {i}"}] if system else []
  for t in range(turns):
    messages += [{"role": "user", "content": f"q{i}.{t}"},
                 {"role": "assistant" if t % 2 else "model", "content": f"answer {i}.{t}"}]
  return {"messages": messages}


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return str(path)


def test_auto_reads_conversations_and_text_lines_chat_reads_only_conversations(tmp_path):
  path = write_jsonl(tmp_path / "a.jsonl", [conversation(0), {"text": "plain"},
                                            conversation(1, system=True)])
  assert data.read_documents(path, "text", "auto") == [
      conversation(0)["messages"], "plain", conversation(1, system=True)["messages"]]
  with pytest.raises(data.DataError, match=r"a.jsonl:2 has no 'messages' list") as error:
    data.read_documents(path, "text", "chat")
  assert error.value.field == "data.format"
  (tmp_path / "b.txt").write_text("text")
  with pytest.raises(data.DataError, match=r"b.txt is not a .jsonl file") as error:
    data.read_documents(str(tmp_path / "b.txt"), "text", "chat")
  assert error.value.field == "data.format"


@pytest.mark.parametrize("line,message", [
    ("not json", r"a.jsonl:2 is not JSON"),
    ('{"text": "x"}', r"a.jsonl:2 has no 'messages' list"),
    ('{"messages": {"role": "user"}}', r"a.jsonl:2: a conversation must be a non-empty list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"a.jsonl:2: message 0 has unknown role"),
    ('{"messages": [{"content": "x"}]}', r"a.jsonl:2: message 0 has no 'role'"),
    ('{"messages": [{"role": "user"}]}', r"a.jsonl:2: message 0 has no 'content'"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"a.jsonl:2: message 0 has int content"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}',
     r"a.jsonl:2: message 1 has role 'user' where 'model' belongs"),
])
def test_malformed_chat_lines_name_file_and_line(tmp_path, line, message):
  (tmp_path / "a.jsonl").write_text(json.dumps(conversation(0)) + "\n" + line + "\n")
  with pytest.raises(data.DataError, match=message):
    data.read_documents(str(tmp_path / "a.jsonl"), "text", "chat")


def test_batch_weights_fold_in_the_loss_mask():
  rng = np.random.default_rng(1)
  segment_ids = np.sort(rng.integers(0, 4, (3, 20)), axis=1)[:, ::-1].copy()
  tokens = rng.integers(3, 259, (3, 20)).astype(np.int32)
  loss_mask = rng.integers(0, 2, (3, 20)).astype(np.float32)
  batch = data.make_batch(tokens, segment_ids, loss_mask)
  _, _, weights = reference_batch(tokens, segment_ids)
  for r in range(3):
    for i in range(19):
      weights[r, i] *= loss_mask[r, i + 1]
  np.testing.assert_array_equal(batch["weights"], weights)


def chat_config(path, seq_len=64, eval_fraction=0.25):
  config = gj.get_config("gemma3-tiny").data
  config.path, config.seq_len, config.eval_fraction = path, seq_len, eval_fraction
  return config


def segments(rows):
  """Each row's examples: (ids, mask) per segment id, in row order."""
  out = []
  for r in range(len(rows)):
    for s in np.unique(rows.segment_ids[r][rows.segment_ids[r] > 0]):
      where = rows.segment_ids[r] == s
      out.append((rows.tokens[r][where].tolist(), rows.loss_mask[r][where].tolist()))
  return out


def test_chat_splits_hold_whole_conversations_with_their_loss_mask(tmp_path):
  records = [conversation(i, system=i % 3 == 0, turns=1 + i % 2) for i in range(12)]
  tok = tokenizers.ByteTokenizer()
  train, held_out = data.load_splits(
      chat_config(write_jsonl(tmp_path / "c.jsonl", records), seq_len=128), tok, seed=0)
  rendered = {tuple(r.ids.tolist()): r.weights.tolist() for r in
              (chat.render(rec["messages"], tok) for rec in records)}
  parts = [segments(train), segments(held_out)]
  assert len(parts[1]) == 3 and len(parts[0]) == 9     # 0.25 of 12 conversations
  found = [ids for part in parts for ids, _ in part]
  assert sorted(map(tuple, found)) == sorted(rendered)   # each one whole, once
  for part in parts:
    for ids, mask in part:
      assert mask == rendered[tuple(ids)]
  again, _ = data.load_splits(chat_config(str(tmp_path / "c.jsonl"), seq_len=128), tok, seed=0)
  np.testing.assert_array_equal(again.tokens, train.tokens)


def test_chat_batches_learn_only_the_model_turns(tmp_path):
  records = [conversation(i, turns=2) for i in range(8)]
  tok = tokenizers.ByteTokenizer()
  train, held_out = data.load_splits(chat_config(write_jsonl(tmp_path / "c.jsonl", records)),
                                     tok, seed=0)
  batches = data.TrainBatches(train, batch_size=2, seed=0, process_index=0, process_count=1)
  evals = data.eval_batches(held_out, batch_size=2, num_batches=2, process_index=0,
                            process_count=1)
  learned = collections_of_targets(list(batches.batch(i) for i in range(3)) + evals)
  answers = [m["content"] for rec in records for m in rec["messages"] if m["role"] != "user"]
  allowed = set(b + 3 for a in answers for b in a.encode()) | {tok.end_of_turn_id}
  assert learned and set(learned) <= allowed
  # Unigram entropy over the weighted targets, counted here with numpy.
  counts = np.unique(collections_of_targets(evals), return_counts=True)[1]
  p = counts / counts.sum()
  assert metrics.unigram_entropy(evals) == pytest.approx(-np.sum(p * np.log(p)))


def collections_of_targets(batches):
  return [int(t) for b in batches for t in b["targets"][b["weights"] > 0]]


def test_a_conversation_longer_than_a_row_is_cut_and_counted_once(tmp_path, caplog):
  records = [conversation(i, turns=6 if i < 2 else 1) for i in range(6)]
  with caplog.at_level(logging.WARNING):
    train, held_out = data.load_splits(
        chat_config(write_jsonl(tmp_path / "c.jsonl", records), seq_len=48),
        tokenizers.ByteTokenizer(), seed=0)
  warnings = [r.getMessage() for r in caplog.records
              if "longer than data.seq_len" in r.getMessage()]
  assert warnings == ["2 of 6 examples are longer than data.seq_len=48 and were cut to it"]
  assert train.tokens.shape[1] == held_out.tokens.shape[1] == 48


def test_chat_data_needs_a_tokenizer_with_turn_markers(tmp_path):
  class NoMarkers(tokenizers.ByteTokenizer):
    start_of_turn_id = end_of_turn_id = None
  path = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(3)])
  with pytest.raises(gj.ConfigError, match="NoMarkers has no turn markers") as error:
    data.load_splits(chat_config(path), NoMarkers(), seed=0)
  assert error.value.field == "data.tokenizer"


def test_shipped_chat_small_is_regenerated_exactly_and_fits_256_bytes(tmp_path):
  directory = os.path.join(os.path.dirname(__file__), "..", "configs", "data")
  spec = importlib.util.spec_from_file_location(
      "make_chat_small", os.path.join(directory, "make_chat_small.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(str(tmp_path / "again.jsonl"))
  shipped = os.path.join(directory, "chat_small.jsonl")
  with open(shipped, "rb") as f:
    assert f.read() == (tmp_path / "again.jsonl").read_bytes()
  assert os.path.getsize(shipped) < 150_000
  conversations = data.read_documents(shipped, "text", "chat")
  assert 600 <= len(conversations) <= 1000
  lengths = [len(chat.render(c, tokenizers.ByteTokenizer()).ids) for c in conversations]
  assert max(lengths) <= 256
  assert any(c[0]["role"] == "system" for c in conversations)
  assert any(len(c) >= 4 for c in conversations)
