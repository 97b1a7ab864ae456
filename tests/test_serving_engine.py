"""The serving engine against references it does not share code with: the full forward
pass (greedy continuations and log-probabilities) and contiguous-cache decoding, whatever
else is in flight: mixed arrivals, chunked prefill, shared prefixes, preemption, int8
pages, recycled slots, cancellations; one compile per program throughout."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gemma_jax as gj
from gemma_jax import sharding
from gemma_jax.inference import decoding
from gemma_jax.models import towers
from gemma_jax.serving.engine import Engine
from gemma_jax.serving.requests import QueueFull, Request, SamplingOptions
from gemma_jax.text import tokenizers
import test_gemma4
import test_hf
from test_decoding import random_params, tiny
from test_gemma4_small import SHAPES as GEMMA4_SHAPES

GREEDY = SamplingOptions(temperature=0.0)


def model_of(family):
  if family == "gemma4_shared":   # per-layer inputs and shared key/value layers
    config = tiny("gemma4_dense")
    config.model.update(per_layer_input_dim=4, num_kv_shared_layers=2, double_wide_mlp=True)
  else:
    config = tiny(family)
  return config, random_params(config, seed=1)


def reference(config, params, prompt, steps):
  """The greedy continuation of `prompt` by the full forward pass, and each step's
  log-probabilities [steps, V] (float64)."""
  apply = jax.jit(gj.transform(config).apply)
  seq, logprobs = list(prompt), []
  for _ in range(steps):
    logits = np.asarray(apply(params, jnp.asarray([seq]))[0, -1], np.float64)
    logprobs.append(logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max())
    seq.append(int(np.argmax(logits)))
  return seq[len(prompt):], np.stack(logprobs)


def prompts(seed, lengths, vocab=97):
  rng = np.random.RandomState(seed)
  return [tuple(int(t) for t in rng.randint(1, vocab, size=n)) for n in lengths]


def tokens_of(outputs):
  return [o.token for o in outputs]


def check_against_reference(config, params, requests, outputs, atol=2e-4):
  for request, got in zip(requests, outputs):
    want, logprobs = reference(config, params, request.prompt, len(got))
    assert tokens_of(got) == want, request.prompt
    if request.logprobs:
      for step, o in enumerate(got):
        top = np.argsort(-logprobs[step])[:request.logprobs]
        np.testing.assert_allclose([p for _, p in o.top], logprobs[step][top], atol=atol)
        np.testing.assert_allclose(o.logprob, logprobs[step][o.token], atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma4_shared", "gemma4_moe", "gpt3"])
@pytest.mark.parametrize("prefill_chunk", [3, 32])
def test_greedy_tokens_and_logprobs_equal_the_full_forward(family, prefill_chunk):
  """Prompts of mixed lengths (past the window of 4, across pages of 4) decoded
  together in 3 slots, chunked prefill on (3) and off (32 > every prompt)."""
  config, params = model_of(family)
  engine = Engine(config, params, num_slots=3, page_size=4, prefill_chunk=prefill_chunk,
                  max_length=40)
  requests = [Request(prompt=p, max_tokens=6, sampling=GREEDY, logprobs=3)
              for p in prompts(0, (1, 5, 13, 9, 2, 17))]
  check_against_reference(config, params, requests, engine.generate(requests))
  assert engine.programs.prefill._cache_size() == 1
  assert engine.programs.decode._cache_size() == 1


@pytest.mark.slow
def test_requests_arriving_while_others_decode_and_recycled_slots():
  """20 requests through 2 slots, half arriving mid-way; each compiled program once."""
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=2, page_size=4, prefill_chunk=4, max_length=32)
  requests = [Request(prompt=p, max_tokens=3 + i % 4, sampling=GREEDY)
              for i, p in enumerate(prompts(1, [1 + (7 * i) % 15 for i in range(20)]))]
  outputs = [[] for _ in requests]
  for i in range(10):
    engine.submit(requests[i], outputs[i].append)
  for _ in range(5):
    engine.step()
  for i in range(10, 20):
    engine.submit(requests[i], outputs[i].append)
  while engine.busy:
    engine.step()
  check_against_reference(config, params, requests, outputs)
  assert [o[-1].finish for o in outputs] == ["length"] * 20
  assert engine.programs.prefill._cache_size() == 1
  assert engine.programs.decode._cache_size() == 1
  assert engine.metrics()["running"] == 0


@pytest.mark.slow
def test_shared_prefixes_reuse_pages_and_decode_the_same():
  """A conversation's later turns and a common system prompt: the later requests find
  the earlier ones' full pages (local layers' too) and prefill only the rest."""
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=2, page_size=4, prefill_chunk=4, max_length=48,
                  local_cache_pages=8)
  system = prompts(2, [18])[0]
  first = [Request(prompt=system + (5, 6), max_tokens=4, sampling=GREEDY)]
  outputs = engine.generate(first)
  later = [Request(prompt=system + tail, max_tokens=4, sampling=GREEDY)
           for tail in ((7,), (8, 9, 10), (5, 6) + tuple(tokens_of(outputs[0])) + (11,))]
  outputs += engine.generate(later)
  check_against_reference(config, params, first + later, outputs)
  # 16 of the 18 system tokens sit in full pages; the third reuses the first's reply too.
  assert engine.metrics()["prefix_tokens_reused"] >= 16 + 16 + 20


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma4_shared"])
def test_preemption_under_a_small_pool_recomputes_and_loses_nothing(family):
  config, params = model_of(family)
  engine = Engine(config, params, num_slots=3, page_size=4, prefill_chunk=4, max_length=32,
                  num_pages=8)
  requests = [Request(prompt=p, max_tokens=8, sampling=GREEDY, logprobs=2)
              for p in prompts(3, (9, 12, 7, 14))]
  outputs = engine.generate(requests)
  assert engine.metrics()["preemptions"] > 0
  check_against_reference(config, params, requests, outputs)


@pytest.mark.slow
def test_int8_pages_decode_as_the_int8_contiguous_cache():
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=2, page_size=4, prefill_chunk=4, max_length=32,
                  cache_dtype="int8")
  prompt_rows = prompts(4, (6, 11))
  outputs = engine.generate([Request(prompt=p, max_tokens=6, sampling=GREEDY)
                             for p in prompt_rows])
  dec = decoding.make_decoding(config)
  for prompt, got in zip(prompt_rows, outputs):
    logits, cache = dec.prefill(params, jnp.asarray([prompt]), cache_length=32,
                                cache_dtype="int8")
    want = []
    for _ in range(6):
      want.append(int(jnp.argmax(logits[0])))
      logits, cache = dec.decode_step(params, jnp.asarray(want[-1:]), cache)
    assert tokens_of(got) == want


@pytest.mark.slow
def test_a_seed_draws_the_same_tokens_whatever_else_runs():
  config, params = model_of("gemma3")
  sampled = Request(prompt=prompts(5, (7,))[0], max_tokens=8, seed=123,
                    sampling=SamplingOptions(temperature=1.5, top_k=20, top_p=0.95))
  alone = Engine(config, params, num_slots=1, page_size=4, max_length=32).generate([sampled])
  others = [Request(prompt=p, max_tokens=5, seed=i,
                    sampling=SamplingOptions(temperature=1.0, min_p=0.05))
            for i, p in enumerate(prompts(6, (3, 10, 4)))]
  crowd = Engine(config, params, num_slots=3, page_size=4,
                 max_length=32).generate(others[:2] + [sampled] + others[2:])
  assert tokens_of(crowd[2]) == tokens_of(alone[0])
  assert len(set(tokens_of(alone[0]))) > 1   # a draw, not a constant


@pytest.mark.slow
def test_cancelled_and_stopped_requests_free_their_slots_and_pages():
  config, params = model_of("gemma3")
  config.model.vocab_size = 300          # room for the byte tokenizer's ids
  params = random_params(config, seed=1)
  tokenizer = tokenizers.get_tokenizer("byte", config.model.vocab_size)
  engine = Engine(config, params, tokenizer=tokenizer, num_slots=2, page_size=4,
                  max_length=32, max_queue=2)
  prompt = (tokenizer.bos_id,) + tuple(int(t) for t in tokenizer.encode(["hello"])[0])
  greedy = engine.generate([Request(prompt=prompt, max_tokens=8, sampling=GREEDY)])[0]
  text = "".join(o.text for o in greedy)
  outputs = [[], [], []]
  ids = [engine.submit(Request(prompt=prompt, max_tokens=8, sampling=GREEDY),
                       outputs[i].append) for i in range(2)]
  with pytest.raises(QueueFull):
    engine.submit(Request(prompt=prompt, max_tokens=8), outputs[2].append)
  engine.step()
  engine.cancel(ids[0])
  while engine.busy:
    engine.step()
  assert outputs[0][-1].finish == "cancelled" and outputs[1][-1].finish == "length"
  assert tokens_of(outputs[1]) == tokens_of(greedy)
  # A stop id ends at its token; a stop string cuts the text before it.
  stop_id = greedy[3].token
  by_id = engine.generate([Request(prompt=prompt, max_tokens=8, sampling=GREEDY,
                                   stop_ids=(stop_id,))])[0]
  assert tokens_of(by_id)[-1] == stop_id and by_id[-1].finish == "stop"
  assert len(by_id) == tokens_of(greedy).index(stop_id) + 1
  if len(text) > 3:
    stop = text[2:4]
    by_text = engine.generate([Request(prompt=prompt, max_tokens=8, sampling=GREEDY,
                                       stop_strings=(stop,))])[0]
    assert "".join(o.text for o in by_text) == text[:text.index(stop)]
    assert by_text[-1].finish == "stop"
  metrics = engine.metrics()
  assert metrics["running"] == 0 and metrics["queued"] == 0


def test_bad_requests_are_refused_before_queueing():
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=1, page_size=4, max_length=16)
  for request, field in (
      (Request(prompt=(), max_tokens=1), "prompt"),
      (Request(prompt=(1, 200), max_tokens=1), "prompt"),
      (Request(prompt=(1, 2), max_tokens=0), "max_tokens"),
      (Request(prompt=(1,) * 10, max_tokens=7), "max_tokens"),
      (Request(prompt=(1,), max_tokens=1, sampling=SamplingOptions(temperature=-1)),
       "temperature"),
      (Request(prompt=(1,), max_tokens=1, sampling=SamplingOptions(top_k=65)), "top_k"),
      (Request(prompt=(1,), max_tokens=1, stop_strings=("x",)), "stop_strings"),
      (Request(prompt=(1,), max_tokens=1, logprobs=21), "logprobs")):
    with pytest.raises(ValueError, match=field):
      engine.submit(request, lambda output: None)
  assert not engine.busy
  with pytest.raises(ValueError, match="num_pages"):
    Engine(config, params, page_size=4, num_pages=3, max_length=16)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma4_shared"])
def test_eight_devices_decode_the_tokens_of_one(family):
  """Weights and the pools' key/value heads sharded (data 2 x fsdp 2 x tensor 2), greedy
  and sampled requests: the tokens of the unsharded engine."""
  config, _ = model_of(family)
  config.mesh.update(data=2, fsdp=2, tensor=2)
  config.model.vocab_size = 98          # the tensor axis splits the vocabulary
  if config.model.global_num_kv_heads:  # and the key/value heads
    config.model.global_num_kv_heads = 2
  params = random_params(config, seed=1)
  requests = [Request(prompt=p, max_tokens=6, sampling=GREEDY)
              for p in prompts(7, (5, 11, 2))]
  requests.append(Request(prompt=prompts(8, (6,))[0], max_tokens=6, seed=3,
                          sampling=SamplingOptions(temperature=1.0, top_k=10)))
  options = dict(num_slots=4, page_size=4, prefill_chunk=4, max_length=32)
  one = Engine(config, params, **options).generate(requests)
  engine = Engine(config, params, mesh=sharding.make_mesh(config.mesh), **options)
  pools = jax.tree.leaves(engine._pools)
  assert all(len(a.sharding.device_set) == 8 for a in pools)
  assert [tokens_of(o) for o in engine.generate(requests)] == [tokens_of(o) for o in one]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma4_shared_kv"])
def test_greedy_equals_transformers_generate(family, tmp_path):
  """Published-layout checkpoints (Gemma 3; Gemma 4 with per-layer inputs, shared
  key/value layers of both types, double-wide MLPs, window 4) loaded by hf.load: rows
  of 9, 3 and 6 prompt tokens, the third arriving while the others decode, and 14 new
  tokens each, past the window; chunked prefill of 4 on pages of 4."""
  if family == "gemma3":
    source = test_hf
    model = source.random_model(3, num_hidden_layers=4, sliding_window=4)
  else:
    source = test_gemma4
    model = source.random_model(5, **GEMMA4_SHAPES["ple_shared_double_wide_k_eq_v_12_layers"])
  model.save_pretrained(str(tmp_path))
  config, params = gj.hf.load(str(tmp_path))
  rows = prompts(9, (9, 3, 6), vocab=source.VOCAB)
  engine = Engine(config, params, num_slots=3, page_size=4, prefill_chunk=4, max_length=32)
  outputs = [[] for _ in rows]
  for b in (0, 1):
    engine.submit(Request(prompt=rows[b], max_tokens=14, sampling=GREEDY), outputs[b].append)
  for _ in range(4):
    engine.step()
  engine.submit(Request(prompt=rows[2], max_tokens=14, sampling=GREEDY), outputs[2].append)
  while engine.busy:
    engine.step()
  for row, got in zip(rows, outputs):
    with torch.no_grad():
      theirs = model.generate(torch.as_tensor([row]), do_sample=False, max_new_tokens=14,
                              eos_token_id=None, pad_token_id=0)
    assert tokens_of(got) == theirs[0, len(row):].tolist()


@pytest.mark.slow
def test_two_prefill_rows_under_preemption_leak_no_page():
  """Two prompts prefill per step; one's room can preempt the other, which must then
  take no pages until it is admitted again. Afterwards only the prefix cache holds
  pages (every page can be allocated)."""
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=3, page_size=4, prefill_chunk=4, prefill_rows=2,
                  max_length=32, num_pages=9)
  requests = [Request(prompt=p, max_tokens=6, sampling=GREEDY)
              for p in prompts(10, (24, 24, 20, 24, 7, 15))]
  outputs = engine.generate(requests)
  assert engine.metrics()["preemptions"] > 0
  check_against_reference(config, params, requests, outputs)
  assert all(pool.available == pool.num_pages for pool in engine.pages.pools.values())


@pytest.mark.slow
@pytest.mark.parametrize("preset,prefill_chunk", [
    ("gemma3-tiny-vision", 5), ("gemma3-tiny-vision", 48), ("gemma4-tiny-vision", 17)])
def test_prompts_with_images_decode_as_the_full_forward(preset, prefill_chunk):
  """Images in two of three requests (one with two images, markers given; one placed
  after BOS), prefilled whole or in chunks that never cut a bidirectional span (Gemma
  3's spans of 4 in chunks of 5); the same images again reuse cached pages, other
  images do not."""
  config = gj.get_config(preset)
  config.model.update(num_layers=3, sliding_window=8)
  params = random_params(config, seed=2)
  v = config.model.vision
  rng = np.random.RandomState(0)
  picture = lambda: rng.randint(0, 256, (40, 56, 3)).astype(np.uint8)
  first, second, third = picture(), picture(), picture()
  marker = v.boi_token_id if config.model.block_type == "gemma3" else v.image_token_id
  requests = [Request(prompt=(2, 17, marker, 23, 29, marker, 31), max_tokens=5,
                      sampling=GREEDY, images=(first, second), logprobs=3),
              Request(prompt=prompts(11, (9,))[0], max_tokens=5, sampling=GREEDY, logprobs=3),
              Request(prompt=(2, 41, 43), max_tokens=5, sampling=GREEDY, images=(third,),
                      logprobs=3)]
  engine = Engine(config, params, num_slots=2, page_size=4, prefill_chunk=prefill_chunk,
                  max_length=96, local_cache_pages=8)
  outputs = engine.generate(requests)
  apply = jax.jit(gj.transform(config).apply)
  for request, got in zip(requests, outputs):
    if request.images:
      rows, pixels = towers.prompts_with_images([np.asarray(request.prompt)],
                                                [list(request.images)], config.model)
      seq = rows[0].tolist()
    else:
      seq, pixels = list(request.prompt), None
    want = []
    for step in range(5):
      logits = np.asarray(apply(params, jnp.asarray([seq + want]), images=pixels)[0, -1],
                          np.float64)
      want.append(int(np.argmax(logits)))
      logprobs = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
      top = np.argsort(-logprobs)[:3]   # the alternatives: the chosen one's is often 0.0
      np.testing.assert_allclose([p for _, p in got[step].top], logprobs[top], atol=1e-3)
    assert tokens_of(got) == want, request.prompt
  reused = engine.metrics()["prefix_tokens_reused"]
  again = engine.generate([requests[2]])
  assert tokens_of(again[0]) == tokens_of(outputs[2])
  assert engine.metrics()["prefix_tokens_reused"] > reused
  other = dataclasses.replace(requests[2], images=(first,))
  before = engine.metrics()["prefix_tokens_reused"]
  engine.generate([other])
  assert engine.metrics()["prefix_tokens_reused"] == before


def test_a_failing_step_ends_every_request_with_an_error_and_refuses_more():
  """A step that raises on the engine's thread: waiting and running requests end with
  finish "error" (no client waits forever), and a later submit is one RuntimeError."""
  config, params = model_of("gemma3")
  engine = Engine(config, params, num_slots=1, page_size=4, max_length=16)
  outputs = [[], []]

  def broken():
    raise FloatingPointError("a broken step")

  engine.step = broken
  for i in range(2):
    engine.submit(Request(prompt=(1, 2), max_tokens=2, sampling=GREEDY), outputs[i].append)
  engine.start()
  engine._thread.join(timeout=30)
  assert [o[-1].finish for o in outputs] == ["error", "error"]
  with pytest.raises(RuntimeError, match="FloatingPointError: a broken step"):
    engine.submit(Request(prompt=(1, 2), max_tokens=2), lambda output: None)
