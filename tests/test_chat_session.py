"""Chat over one KV cache: `Decoding.extend`, `ChatSession` and experiments/chat.py against
a full recomputation of the whole conversation with the model's apply."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax.text import chat
from gemma_jax.inference import decoding, make_decoding, sampler, sampling
from gemma_jax.inference import chat_session
from gemma_jax.inference.chat_session import ChatSession
from gemma_jax.text import tokenizers
from test_decoding import random_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small(preset, **model):
  config = gj.get_config(preset)
  config.model.update(dict(dict(num_layers=3, attention_pattern=("local", "local", "global"),
                                sliding_window=8), **model))
  return config


@pytest.mark.slow
@pytest.mark.parametrize("preset, model", [
    ("gemma3-tiny", {}),
    ("gemma3-tiny", dict(scan_layers=False)),
    ("gemma4-tiny", {}),
    ("gemma4-moe-tiny", {}),
])
def test_extend_equals_a_full_recomputation(preset, model):
  config = small(preset, **model)
  params = random_params(config)
  tokens = np.random.RandomState(1).randint(0, config.model.vocab_size, (2, 30))
  dec = make_decoding(config)
  # A prompt of 5, then chunks of 13 (longer than the window of 8), 1 and 11.
  logits, cache = dec.prefill(params, jnp.asarray(tokens[:, :5]), cache_length=32,
                              cache_dtype="float32")
  full = np.asarray(gj.transform(config).apply(params, jnp.asarray(tokens)))
  np.testing.assert_allclose(logits, full[:, 4], atol=2e-5)
  end = 5
  for size in (13, 1, 11):
    logits, cache = dec.extend(params, jnp.asarray(tokens[:, end:end + size]), cache)
    end += size
    np.testing.assert_allclose(logits, full[:, end - 1], atol=2e-5)
    np.testing.assert_array_equal(cache.next_position, [end, end])


@pytest.mark.slow
@pytest.mark.parametrize("preset, cache_dtype, atol, passes_of", [
    ("gemma3-tiny", "float32", 2e-5, 512),
    ("gemma4-tiny", "float32", 2e-5, 512),
    ("gemma3-tiny", "float32", 2e-5, 5),
    # A chunk attends over its own keys unrounded (as a prefill does), token by token
    # each key is rounded first: measured 0.05 on logits up to 35.
    ("gemma3-tiny", "int8", 0.1, 512),
])
def test_extend_past_the_caches_capacity_equals_decoding_token_by_token(
    preset, cache_dtype, atol, passes_of, monkeypatch):
  """A cache of 12 positions (global rings of 12 slots, local ones of 8, the window) in
  four layers (local, global, local, global): extensions by 13, 1, 9 and 6 tokens after
  a prompt of 5 wrap every ring, the first one in a pass longer than the rings (or, in
  passes of 5 tokens, scanned whole passes and a rest). Each extension's logits and the
  cache after it equal those of feeding the same tokens one decode step at a time (each
  query then sees the last 12 positions at most)."""
  monkeypatch.setattr(decoding, "EXTEND_CHUNK", passes_of)
  config = small(preset, num_layers=4, attention_pattern=("local", "global"))
  params = random_params(config)
  tokens = np.random.RandomState(3).randint(0, config.model.vocab_size, (2, 34))
  dec = make_decoding(config)
  prefill = lambda: dec.prefill(params, jnp.asarray(tokens[:, :5]), cache_length=12,
                                cache_dtype=cache_dtype)[1]
  chunked, stepped, end = prefill(), prefill(), 5
  for size in (13, 1, 9, 6):
    logits, chunked = dec.extend(params, jnp.asarray(tokens[:, end:end + size]), chunked)
    for i in range(end, end + size):
      want, stepped = dec.decode_step(params, jnp.asarray(tokens[:, i]), stepped)
    end += size
    np.testing.assert_allclose(logits, want, atol=atol)
    np.testing.assert_array_equal(chunked.next_position, stepped.next_position)
    for kind in chunked.positions:   # the same positions in the same slots
      np.testing.assert_array_equal(chunked.positions[kind], stepped.positions[kind])
    if cache_dtype == "float32":
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=atol),
                   chunked.layers, stepped.layers)


@pytest.mark.slow
@pytest.mark.parametrize("preset, passes_of", [
    ("gemma3-tiny", 512),
    ("gemma3-tiny", 5),
    ("gemma4-moe-tiny", 512),
    ("gpt3-52k", 512),
])
def test_padded_rows_extend_as_each_row_decoded_alone(preset, passes_of, monkeypatch):
  """Two rows right-padded to one width with `lengths`, extended together four times
  (13 and 4, 1 and 9, 6 and 6, 2 and 11 tokens; rings of 12 and 8 slots, so both wrap,
  one row in a pass longer than a ring): each row's logits and cache equal its own
  tokens decoded one step at a time from its own prefill, so padding is neither stored
  nor seen. gpt3-52k's learned table has 36 positions: row 1 ends at 35, row 0's
  padding would reach 39."""
  monkeypatch.setattr(decoding, "EXTEND_CHUNK", passes_of)
  if preset == "gpt3-52k":
    config = gj.get_config(preset)
    config.model.trainable_position_size = config.data.seq_len = 36
    config.model.num_layers = 2   # the second layer's keys come from the first's outputs
    params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  else:
    config = small(preset, num_layers=4, attention_pattern=("local", "global"))
    params = random_params(config)
  sizes = [(13, 4), (1, 9), (6, 6), (2, 11)]
  tokens = np.random.RandomState(5).randint(1, config.model.vocab_size, (2, 40))
  dec = make_decoding(config)
  _, cache = dec.prefill(params, jnp.asarray(tokens[:, :5]), cache_length=12,
                         cache_dtype="float32")
  alone = [dec.prefill(params, jnp.asarray(tokens[b:b + 1, :5]), cache_length=12,
                       cache_dtype="float32")[1] for b in range(2)]
  ends = [5, 5]
  for pair in sizes:
    padded = np.zeros((2, 16), np.int32)   # id 0: a real token id, as a pad would be
    for b, size in enumerate(pair):
      padded[b, :size] = tokens[b, ends[b]:ends[b] + size]
    logits, cache = dec.extend(params, jnp.asarray(padded), cache, jnp.asarray(pair))
    for b, size in enumerate(pair):
      for i in range(ends[b], ends[b] + size):
        want, alone[b] = dec.decode_step(params, jnp.asarray(tokens[b, i:i + 1]), alone[b])
      ends[b] += size
      np.testing.assert_allclose(logits[b], want[0], atol=2e-5)
      assert int(cache.next_position[b]) == ends[b]
      for kind in cache.positions:
        np.testing.assert_array_equal(cache.positions[kind][b], alone[b].positions[kind][0])
      jax.tree.map(lambda a, c, row=b: np.testing.assert_allclose(a[row], c[0], atol=2e-5),
                   cache.layers, alone[b].layers)


def test_extend_refuses_a_bad_chunk():
  config = small("gemma3-tiny")
  params = random_params(config)
  dec = make_decoding(config)
  _, cache = dec.prefill(params, jnp.ones((1, 4), jnp.int32), cache_length=16)
  with pytest.raises(ValueError, match=r"tokens must have shape \[batch=1, C >= 1\]"):
    dec.extend(params, jnp.ones((2, 3), jnp.int32), cache)
  with pytest.raises(ValueError, match=r"tokens\[0, 1\] = 9999 is outside the vocabulary"):
    dec.extend(params, jnp.asarray([[3, 9999]]), cache)
  with pytest.raises(ValueError, match=r"lengths\[0\] = 3 is outside \[1, 2\]"):
    dec.extend(params, jnp.asarray([[3, 4]]), cache, jnp.asarray([3]))
  with pytest.raises(ValueError, match=r"lengths must have shape \[batch\] = \(1,\)"):
    dec.extend(params, jnp.asarray([[3, 4]]), cache, jnp.asarray([1, 2]))


def chatty_params(config, seed=1):
  """Random parameters whose greedy replies vary: small embeddings (with tied ones, large
  ones make every step repeat its input token) and the end-of-turn row scaled up, so some
  replies stop at it and others run to max_new_tokens."""
  params = random_params(config, seed)
  embedding = params["embed"]["embedding"] / 15
  params["embed"]["embedding"] = embedding.at[tokenizers.ByteTokenizer().end_of_turn_id].multiply(4)
  return params


def greedy_conversation(config, params, tokenizer, system, questions, max_new_tokens):
  """The reference: (the conversation's ids, each reply's text, the tokens sampled for
  each reply, its stop id included) by greedy argmax over a
  full forward of the whole conversation at every token. Its ids come from the chat
  module alone: the first turn rendered whole; later turns after the reply's end-of-turn
  marker (the one sampled, else one added) and "\n"."""
  apply = jax.jit(gj.transform(config).apply)
  ids, replies, sampled = [], [], []
  for question in questions:
    if not ids:
      messages = [{"role": "system", "content": system}] if system else []
      ids += chat.render(messages + [{"role": "user", "content": question}], tokenizer,
                         add_generation_prompt=True).ids.tolist()
    else:
      closing = [] if ids[-1] == tokenizer.end_of_turn_id else [tokenizer.end_of_turn_id]
      ids += closing + [tokenizer.encode(["\n"])[0][0]] + chat.turn_ids(
          tokenizer, "user", question).tolist() + chat.generation_prompt_ids(tokenizer).tolist()
    reply, before = [], len(ids)
    for _ in range(max_new_tokens):
      ids.append(int(np.argmax(apply(params, jnp.asarray([ids]))[0, -1])))
      if ids[-1] in tokenizer.stop_ids:
        break
      reply.append(ids[-1])
    replies.append(tokenizer.decode(reply))
    sampled.append(len(ids) - before)
  return ids, replies, sampled


@pytest.mark.slow
def test_session_keeps_one_cache_and_equals_a_full_recomputation():
  config = small("gemma3-tiny", vocab_size=261)
  params = chatty_params(config)
  tokenizer = tokenizers.ByteTokenizer()
  questions = ["Hi there!", "What is 2 plus 3?", "Spell cat."]
  _, replies, sampled = greedy_conversation(config, params, tokenizer, "Be brief.", questions, 8)
  # Both ways a reply ends are exercised, and the replies are text.
  assert min(sampled) < 8 and max(sampled) == 8 and all(replies), (replies, sampled)
  session = ChatSession(config, params, tokenizer, max_length=256, system="Be brief.")
  apply = jax.jit(gj.transform(config).apply)
  previous_unfed = False
  for turn, question in enumerate(questions):
    fed_before, ids_before = len(session.fed_chunks), len(session.ids)
    reply = "".join(session.send(question, max_new_tokens=8))
    ids, _, _ = greedy_conversation(config, params, tokenizer, "Be brief.", questions[:turn + 1],
                                    8)
    assert session.ids == ids and reply == replies[turn]
    assert session.reply_cut == (ids[-1] not in tokenizer.stop_ids)   # no stop id: cut
    # The max_new_tokens-th token is never fed within its reply; an earlier stop id is
    # (that step was dispatched before the token was read). The logits after the last
    # token computed equal the full forward over the conversation so far.
    unfed = sampled[turn] == 8
    computed = sum(session.fed_chunks)
    assert computed == len(session.ids) - unfed
    full = apply(params, jnp.asarray([session.ids[:computed]]))[0, -1]
    np.testing.assert_allclose(session.logits, full, atol=3e-5)
    # This turn computed only its own tokens: its new ids (after the previous reply's
    # last token, if that was left unfed), then one cached step per token sampled.
    new_ids = len(session.ids) - ids_before - sampled[turn]
    assert session.fed_chunks[fed_before:] == (
        [new_ids + previous_unfed] + [1] * (sampled[turn] - unfed))
    previous_unfed = unfed


def test_session_feeds_each_turn_at_a_bucket_width(monkeypatch):
  """Each turn goes in as one call right-padded to `sampler.bucket` of its length (the
  reply then one decode step a token): two later turns of 29 and 28 tokens share one
  program (width 32), where they went in as pieces of 16, 8, 4 and 1 tokens."""
  config = small("gemma3-tiny", vocab_size=261)
  session = ChatSession(config, chatty_params(config), tokenizers.ByteTokenizer(),
                        max_length=256)
  calls = []

  def spy(method, lengths_at):
    original = getattr(session.decoding, method)

    def call(*args, **kwargs):
      calls.append((method, args[1].shape[1], int(args[lengths_at][0])))
      return original(*args, **kwargs)
    return call

  monkeypatch.setattr(session.decoding, "prefill", spy("prefill", 2))
  monkeypatch.setattr(session.decoding, "extend", spy("extend", 3))
  for question in ("Hi!", "Two plus 3?", "Spell cat."):
    calls.clear()
    before = len(session.fed_chunks)
    "".join(session.send(question, max_new_tokens=3))
    (method, width, length), = calls   # the turn; the reply is fed a token a step
    assert length == session.fed_chunks[before] and width == sampler.bucket(length)
    assert session.fed_chunks[before + 1:] == [1] * (len(session.fed_chunks) - before - 1)
    if question != "Hi!":
      assert (method, width) == ("extend", 32)


def test_each_reply_step_is_dispatched_before_its_token_is_read(monkeypatch):
  """The step that feeds a sampled token is called while that token is still a device
  array not yet in `ids`, so its dispatch overlaps the step before it; the tokens fed are
  the reply's, in order, and a reply cut at max_new_tokens feeds all but its last."""
  config = small("gemma3-tiny", vocab_size=261)
  tokenizer = tokenizers.ByteTokenizer()
  session = ChatSession(config, chatty_params(config), tokenizer, max_length=256)
  real, seen = chat_session._feed_and_choose, []

  def spy(decoding, params, token, cache, rng, options):
    seen.append((len(session.ids), token))
    return real(decoding, params, token, cache, rng, options)

  monkeypatch.setattr(chat_session, "_feed_and_choose", spy)
  pieces = session.send("Hi there!", max_new_tokens=6)
  before = len(session.ids)
  "".join(pieces)
  assert session.reply_cut and len(session.ids) == before + 6
  assert [known for known, _ in seen] == [before + k for k in range(5)]
  assert [int(token[0]) for _, token in seen] == session.ids[before:before + 5]


def test_a_reply_interrupted_while_reading_a_token_keeps_ids_and_cache_in_step(monkeypatch):
  """A KeyboardInterrupt (a notebook's stop) in the read of a token whose step was already
  dispatched: the cache holds that token, so the next turn puts it in `ids` first."""
  config = small("gemma3-tiny", vocab_size=261)
  params = chatty_params(config)
  session = ChatSession(config, params, tokenizers.ByteTokenizer(), max_length=256)
  reads = []

  def asarray(value, *args, **kwargs):
    if isinstance(value, jax.Array):
      reads.append(value)
      if len(reads) == 3:
        raise KeyboardInterrupt
    return np.asarray(value, *args, **kwargs)

  monkeypatch.setattr(chat_session, "np", types.SimpleNamespace(asarray=asarray, **{
      name: getattr(np, name) for name in ("full", "int32", "concatenate", "ndarray")}))
  with pytest.raises(KeyboardInterrupt):   # at the reply's third token
    "".join(session.send("Hi there!", max_new_tokens=8))
  monkeypatch.undo()
  first_turn, interrupted = list(session.ids), int(reads[2][0])
  assert sum(session.fed_chunks) == len(first_turn) + 1   # the cache holds one id more
  "".join(session.send("Spell cat.", max_new_tokens=8))
  assert session.ids[len(first_turn)] == interrupted
  computed = sum(session.fed_chunks)
  assert computed in (len(session.ids), len(session.ids) - 1)
  full = gj.transform(config).apply(params, jnp.asarray([session.ids[:computed]]))[0, -1]
  np.testing.assert_allclose(session.logits, full, atol=3e-5)


@pytest.mark.slow
def test_a_sampled_reply_draws_from_the_full_forwards_logits():
  """temperature, top-k and top-p: each token is `sampling.choose` of the full forward's
  logits over the conversation so far, with the seed's key split once a token; the
  reply differs from the greedy one, so the draws were not argmaxes."""
  config = small("gemma3-tiny", vocab_size=261)
  params = chatty_params(config)
  tokenizer = tokenizers.ByteTokenizer()
  options = dict(temperature=1.5, top_k=40, top_p=0.95)
  session = ChatSession(config, params, tokenizer, max_length=256)
  before = len(chat.render([{"role": "user", "content": "Hi there!"}], tokenizer,
                           add_generation_prompt=True).ids)
  "".join(session.send("Hi there!", max_new_tokens=12, seed=3, **options))
  apply = jax.jit(gj.transform(config).apply)
  ids, rng = session.ids[:before], jax.random.key(3)
  chosen = sampling.Sampling.of(vocab_size=config.model.vocab_size, **options)
  while len(ids) < len(session.ids):
    rng, key = jax.random.split(rng)
    ids.append(int(sampling.choose(apply(params, jnp.asarray([ids]))[:, -1], key, chosen)[0]))
  assert session.ids == ids
  greedy = ChatSession(config, params, tokenizer, max_length=256)
  "".join(greedy.send("Hi there!", max_new_tokens=12))
  assert greedy.ids != session.ids


def test_session_refuses_a_conversation_past_max_length():
  config = small("gemma3-tiny")
  session = ChatSession(config, random_params(config), tokenizers.ByteTokenizer(),
                        max_length=64)
  # A first turn: a reset would not help, so it is not offered.
  with pytest.raises(ValueError, match=r"this turn needs \d+ positions \(conversation 0 \+ "
                     r"this message \d+ \+ max_new_tokens 30\), more than max_length=64: "
                     r"lower max_new_tokens or raise max_length$"):
    list(session.send("x" * 40, max_new_tokens=30))
  assert session.ids == []   # nothing was computed
  list(session.send("x" * 10, max_new_tokens=8))
  with pytest.raises(ValueError, match=r"more than max_length=64: reset the conversation, "
                     r"lower max_new_tokens or raise max_length$"):
    list(session.send("x" * 10, max_new_tokens=30))


@pytest.mark.parametrize("max_new_tokens", [0, -30])
def test_session_refuses_a_reply_of_no_tokens(max_new_tokens):
  """A negative count also shrank the positions a turn was checked for, so the cache
  could overflow silently."""
  config = small("gemma3-tiny")
  session = ChatSession(config, random_params(config), tokenizers.ByteTokenizer(),
                        max_length=64)
  with pytest.raises(ValueError, match=f"max_new_tokens must be an integer >= 1, got "
                                       f"{max_new_tokens}"):
    session.send("x" * 40, max_new_tokens=max_new_tokens)
  assert session.ids == [] and session.fed_chunks == []


def test_a_bad_max_length_is_refused_at_the_start():
  """0 fell back to the default; past the learned positions it failed at the first turn."""
  config = small("gemma3-tiny")
  params = random_params(config)
  with pytest.raises(ValueError, match="max_length must be an integer >= 1, got 0"):
    ChatSession(config, params, tokenizers.ByteTokenizer(), max_length=0)
  gpt3 = gj.get_config("gpt3-52k")
  gpt3.model.trainable_position_size = gpt3.data.seq_len = 16
  gpt3_params = gj.transform(gpt3).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"within the learned position table "
                     r"\(config.model.trainable_position_size=16\), got 17"):
    ChatSession(gpt3, gpt3_params, tokenizers.ByteTokenizer(), max_length=17)


def test_a_reply_left_early_keeps_the_conversation_and_the_cache_in_step():
  """The reader stops after the first piece of a reply (a "stop" button): the next turn
  follows the last token sampled, and the session's logits equal the full forward over
  the conversation (they were 0.04 off, the abandoned token in `ids` but never cached)."""
  config = small("gemma3-tiny", vocab_size=261)
  tokenizer = tokenizers.ByteTokenizer()
  params = chatty_params(config)
  session = ChatSession(config, params, tokenizer, max_length=256)
  pieces = session.send("Hi there!", max_new_tokens=8)
  next(pieces)
  pieces.close()
  first_turn = list(session.ids)
  assert first_turn[-1] not in tokenizer.stop_ids   # the reply was cut, not finished
  assert sum(session.fed_chunks) == len(first_turn)   # its last token read is computed
  "".join(session.send("Spell cat.", max_new_tokens=8))
  assert session.ids[len(first_turn)] == tokenizer.end_of_turn_id
  computed = session.ids[:sum(session.fed_chunks)]
  full = gj.transform(config).apply(params, jnp.asarray([computed]))[0, -1]
  np.testing.assert_allclose(session.logits, full, atol=3e-5)


@pytest.mark.slow
def test_chat_app_reads_turns_from_a_pipe(tmp_path):
  """experiments/chat.py with piped input: each line a turn, the replies greedy over one
  conversation, /reset a new one, /quit the end (the line after it is never read)."""
  config = small("gemma3-tiny", vocab_size=261)
  params = chatty_params(config)
  gj.hf.save(str(tmp_path / "hf"), config, params)
  _, replies, _ = greedy_conversation(config, params, tokenizers.ByteTokenizer(), "Be brief.",
                                      ["Hi there!", "Spell cat."], 8)
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "chat.py"), f"--hf_dir={tmp_path / 'hf'}",
       "--tokenizer=byte", "--system=Be brief.", "--temperature=0", "--max_new_tokens=8"],
      input="Hi there!\nSpell cat.\n/reset\nHi there!\n/quit\nnever read\n", capture_output=True,
      text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""), check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == (f"> Hi there!\n{replies[0]}\n> Spell cat.\n{replies[1]}\n"
                           f"> /reset\n(a new conversation)\n> Hi there!\n{replies[0]}\n"
                           "> /quit\n")


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--top_p=0"], "top_p must lie in (0, 1] (1: all tokens), got 0.0"),
    (["--max_length=128"],   # the default 256 new tokens: no message could ever fit
     "--max_new_tokens=256 leaves no room for a message in --max_length=128 positions"),
])
def test_chat_app_refuses_a_bad_option_before_chatting(tmp_path, flags, message):
  config = small("gemma3-tiny")
  gj.hf.save(str(tmp_path / "hf"), config, random_params(config))
  result = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "chat.py"), f"--hf_dir={tmp_path / 'hf'}",
       "--tokenizer=byte", *flags], input="Hi\n", capture_output=True, text=True,
      timeout=300, env=dict(os.environ, XLA_FLAGS=""), check=False)
  assert result.returncode == 1 and result.stdout == ""
  assert result.stderr.strip().splitlines() == [f"chat.py: error: {message}"]
