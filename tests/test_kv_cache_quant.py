"""int8 KV caches (gemma_jax.layers.kv_cache): the per-token, per-head rule against float64
numpy, decoding against a full forward with the same rounding, greedy decoding of a
trained model against float caches, planned bytes, and bad cache dtypes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax import decoder, planning
from gemma_jax.inference import chat_session, decoding, sampler
from gemma_jax.layers import attention
from gemma_jax.layers import kv_cache
from gemma_jax.training import data, optimizer, steps
from gemma_jax.text import tokenizers
from test_decoding import WINDOW, decode_along, random_params, tiny


def np_quantize(x):
  """float64 reference: scale max|x| / 127 over H per token and head, values round(x /
  scale) (half to even) in [-127, 127]; zero rows give zeros."""
  x = np.asarray(x, np.float64)
  scale = np.abs(x).max(axis=-1) / 127
  safe = np.where(scale > 0, scale, 1)[..., None]
  return np.clip(np.round(x / safe), -127, 127).astype(np.int64), scale


def test_quantize_equals_numpy_per_token_and_head():
  rng = np.random.RandomState(0)
  x = rng.normal(0, 1, (2, 5, 3, 16)) * rng.lognormal(0, 2, (2, 5, 3, 1))
  x[0, 1, 2] = 0.0                                        # a zero row
  x[1, 3, 0] = np.linspace(-4, 4, 16)                      # its extremes map to -127, 127
  x = x.astype(np.float32)
  values, scale = kv_cache.quantize(jnp.asarray(x))
  assert values.dtype == jnp.int8 and scale.dtype == jnp.float32
  chex.assert_shape(scale, (2, 5, 3))
  want, want_scale = np_quantize(x)
  np.testing.assert_allclose(scale, want_scale, rtol=1e-7, atol=0)
  # float32 x / scale may round a value within an ulp of a half the other way.
  ratio = x / np.where(want_scale > 0, want_scale, 1)[..., None]
  tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-4
  assert tie.mean() < 1e-3
  np.testing.assert_array_equal(np.asarray(values)[~tie], want[~tie])
  assert np.abs(np.asarray(values, np.int64) - want).max() <= 1
  np.testing.assert_array_equal(values[0, 1, 2], 0)
  assert scale[0, 1, 2] == 0 and values[1, 3, 0, 0] == -127 and values[1, 3, 0, -1] == 127

  restored = kv_cache.dequantize(values, scale, jnp.float32)
  assert restored.dtype == jnp.float32 and np.isfinite(restored).all()
  np.testing.assert_allclose(np.asarray(restored)[~tie], (want * want_scale[..., None])[~tie],
                             rtol=1e-6, atol=0)
  # Each element within half a step of its token and head's scale.
  assert (np.abs(np.asarray(restored, np.float64) - x) <= want_scale[..., None] / 2 * 1.0001).all()
  assert kv_cache.dequantize(values, scale, jnp.bfloat16).dtype == jnp.bfloat16


def test_store_quantizes_each_entry_beside_its_scales():
  rng = np.random.RandomState(1)
  layers = {"layers_0": {"attn": {name: jnp.asarray(rng.normal(0, 1, (2, 4, 1, 8)), jnp.float32)
                                  for name in ("k", "v")}}}
  stored = kv_cache.store(layers, "int8")["layers_0"]["attn"]
  assert sorted(stored) == ["k", "k_scale", "v", "v_scale"]
  for name in ("k", "v"):
    want, want_scale = np_quantize(layers["layers_0"]["attn"][name])
    np.testing.assert_array_equal(stored[name], want)
    np.testing.assert_allclose(stored[f"{name}_scale"], want_scale, rtol=1e-7)
  cast = kv_cache.store(layers, "bfloat16")["layers_0"]["attn"]
  assert sorted(cast) == ["k", "v"] and cast["k"].dtype == jnp.bfloat16


@pytest.fixture(scope="module")
def model():
  config = tiny("gemma3")   # 5 layers (local, global), window 4
  return config, random_params(config)


@pytest.mark.slow
def test_int8_decoding_equals_a_full_forward_with_rounded_keys_and_values(model, monkeypatch):
  """One-token prompts, then 15 decode steps (window 4: the local rings wrap three
  times): every key and value goes through a decode step's write, so each step's logits
  equal the full forward's with every attention's keys and values rounded per token and
  head (the rule written again here in jnp float32)."""
  config, params = model

  def rounded(x):
    step = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    return jnp.where(step > 0, jnp.round(x / jnp.where(step > 0, step, 1)) * step, 0)

  plain = attention.dot_product_attention
  width = 16
  seq = np.random.RandomState(2).randint(0, 97, (2, width)).astype(np.int32)
  with monkeypatch.context() as patch:
    patch.setattr(attention, "dot_product_attention",
                  lambda q, k, v, *args, **kwargs: plain(q, rounded(k), rounded(v), *args,
                                                          **kwargs))
    full = np.asarray(gj.transform(config).apply(params, jnp.asarray(seq)))
  dec = decoding.make_decoding(config)
  prefilled = dec.prefill(params, jnp.asarray(seq[:, :1]), cache_length=width, cache_dtype="int8")
  lengths = np.ones(2, int)
  got, want, cache = decode_along(dec, params, prefilled, seq, lengths, full, width - 1)
  # Measured 3.6e-6 (logits up to 7.2); a float32 difference in a key may move one rounding.
  chex.assert_trees_all_close(got, want, atol=1e-4, rtol=0)
  for i, kind in enumerate(decoder.layer_types(config.model)):
    entry = cache.layers[f"layers_{i}"]["attn"]
    slots = WINDOW if kind == "local" else width
    assert entry["k"].dtype == entry["v"].dtype == jnp.int8
    chex.assert_shape([entry["k_scale"], entry["v_scale"]], (2, slots, 2))
    assert entry["k_scale"].dtype == jnp.float32


@pytest.mark.slow
def test_int8_cache_logits_stay_close_to_the_float_cache(model):
  """Rows of 9, 3 and 6 prompt tokens (the prefill's keys rounded once after it) and 7
  steps: logits within 0.15 of the float cache's (measured 0.070, logits up to 10)."""
  config, params = model
  lengths = np.array([9, 3, 6])
  seq = np.random.RandomState(0).randint(0, 97, (3, 16)).astype(np.int32)
  prompts = jnp.asarray(np.where(np.arange(9)[None] < lengths[:, None], seq[:, :9], 0))
  dec = decoding.make_decoding(config)
  logits = {}
  for dtype in ("float32", "int8"):
    step, cache = dec.prefill(params, prompts, jnp.asarray(lengths), cache_length=16,
                              cache_dtype=dtype)
    logits[dtype] = [step]
    for i in range(7):
      step, cache = dec.decode_step(params, jnp.asarray(seq[np.arange(3), lengths + i]), cache)
      logits[dtype].append(step)
  diff = np.abs(np.stack(logits["int8"]) - np.stack(logits["float32"])).max()
  assert 1e-3 < diff < 0.15, diff


# Greedy decoding of a trained model.

N_NEW, PROMPT = 128, 32


@pytest.fixture(scope="module")
def trained():
  """A 2-layer d64 byte model (window 16, so the local rings wrap) trained 200 steps on
  40 standard-library files (loss 5.5 -> ~1.9); 8 held-out rows of other files, each
  PROMPT + N_NEW bytes."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(vocab_size=262, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      mlp_dim=128, num_layers=2, attention_pattern=("local", "global"),
                      sliding_window=16)
  config.optimizer.update(learning_rate=1e-2, warmup_steps=10)
  tokenizer = tokenizers.ByteTokenizer()
  files = data.stdlib_files()
  read = lambda f: open(f, encoding="utf-8", errors="replace").read()
  documents = tokenizer.encode([read(f) for f in files[:40]])
  rows = data.pack(*data.concatenate(documents, tokenizer.bos_id, tokenizer.eos_id), 64,
                   tokenizer.pad_id)
  model = gj.transform(config)
  count = 200
  schedule = optimizer.learning_rate_schedule(config.optimizer, count)
  tx = optimizer.make_optimizer(config.optimizer, schedule)
  state = jax.jit(lambda: steps.init_state(model, tx, 0, 64))()
  train_step = jax.jit(steps.make_train_step(steps.model_forward(model), tx, schedule),
                       donate_argnums=0)
  order = np.random.RandomState(0).randint(0, len(rows.tokens), (count, 16))
  for index in order:
    state, metrics = train_step(state, data.make_batch(rows.tokens[index],
                                                       rows.segment_ids[index]))
  assert float(metrics["loss"]) < 2.5
  texts = [t[600:] for t in map(read, files[40::97]) if len(t) > 1000 and t[600:800].isascii()]
  held_out = np.asarray([[tokenizer.bos_id, *ids[:PROMPT + N_NEW - 1]]
                         for ids in tokenizer.encode(texts[:8])], np.int32)
  return config, state.params, held_out


@pytest.mark.slow
def test_int8_cache_keeps_greedy_decoding_of_a_trained_model(trained):
  """The issue's bar, 8 held-out prompts x 128 new tokens.

  Per decision (each step's context the held-out text, in float and int8 caches): the
  argmax agrees on >= 95% of the 1024 steps (measured 99.6%: 4 differ, each with a float
  top-2 margin under 0.053) and logits move by < 0.15 (measured 0.083). Free-running
  greedy decoding (`sampler.generate`): each row equals float's up to its first near tie
  (a float top-2 margin under 0.1), after which either token may win and the rows part.
  and >= 95% of the 1024 tokens equal float's (the issue's bar). Measured: all 8 rows
  equal throughout (a bfloat16 cache: 92.8%, one row parting at its 26th token)."""
  config, params, held_out = trained
  dec = decoding.make_decoding(config)
  params = dec.unrolled(params)
  prompts, lengths = jnp.asarray(held_out[:, :PROMPT]), jnp.full((8,), PROMPT)
  greedy = {dtype: np.asarray(sampler.generate(
      dec, params, prompts, lengths, jax.random.key(0), jnp.zeros((0,), jnp.int32),
      max_new_tokens=N_NEW, cache_length=PROMPT + N_NEW, cache_dtype=dtype))
            for dtype in ("float32", "int8")}

  def step_logits(dtype, continuation):
    """[8, N_NEW, V]: logits before each of the N_NEW tokens of `continuation`."""
    logits, cache = dec.prefill(params, prompts, lengths, cache_length=PROMPT + N_NEW,
                                cache_dtype=dtype)
    out = [logits]
    for i in range(N_NEW - 1):
      logits, cache = dec.decode_step(params, jnp.asarray(continuation[:, i]), cache)
      out.append(logits)
    return np.stack(out, axis=1)

  on_text = {dtype: step_logits(dtype, held_out[:, PROMPT:]) for dtype in ("float32", "int8")}
  assert np.abs(on_text["int8"] - on_text["float32"]).max() < 0.15
  agreement = np.mean(on_text["int8"].argmax(-1) == on_text["float32"].argmax(-1))
  assert agreement >= 0.95, agreement

  on_greedy = step_logits("float32", greedy["float32"])
  np.testing.assert_array_equal(on_greedy.argmax(-1), greedy["float32"])
  top2 = np.sort(on_greedy, axis=-1)[..., -2:]
  near_tie = top2[..., 1] - top2[..., 0] < 0.1
  free_running = np.mean(greedy["int8"] == greedy["float32"])
  assert free_running >= 0.95, free_running
  for row in range(8):
    same = greedy["int8"][row] == greedy["float32"][row]
    first_tie = np.argmax(near_tie[row]) if near_tie[row].any() else N_NEW
    assert same[:first_tie].all(), (row, np.argmin(same), first_tie)


# Planning and bad input.

@pytest.mark.slow
def test_int8_cache_bytes_of_gemma3_1b_at_32k():
  """26 layers (4 global, 22 local of window 512), one key/value head of 256: per position
  and layer, keys and values of 256 int8 bytes plus a float32 scale, against 512 bytes
  in bfloat16; int32 slot positions."""
  config = gj.get_config("gemma3-1b")
  length, window = 32768, 512
  positions = 4 * length + 22 * window
  positions_bytes = 4 * (length + window + 1)       # the slots' positions, the next position
  got = {dtype: planning.cache_bytes(config, batch_size=2, cache_length=length,
                                     cache_dtype=dtype)["cache"]
         for dtype in ("bfloat16", "int8")}
  assert got["int8"] == 2 * (positions * 2 * (256 * 1 + 4) + positions_bytes)
  assert got["bfloat16"] == 2 * (positions * 2 * 256 * 2 + positions_bytes)
  assert 0.50 < got["int8"] / got["bfloat16"] < 0.51


@pytest.mark.parametrize("dtype", ["int4", "int32", "float64", "foo"])
def test_an_unknown_cache_dtype_is_one_value_error_before_tracing(model, dtype):
  """Named before anything is traced: params=None would fail inside jit otherwise."""
  config, _ = model
  message = rf"unknown cache dtype '{dtype}'; known: float32, bfloat16, float16, int8"
  with pytest.raises(ValueError, match=message):
    decoding.make_decoding(config).prefill(None, jnp.ones((1, 3), jnp.int32), cache_length=8,
                                           cache_dtype=dtype)
  with pytest.raises(ValueError, match=message):
    sampler.Sampler(config, None, tokenizers.ByteTokenizer(), cache_dtype=dtype)
  with pytest.raises(ValueError, match=message):
    chat_session.ChatSession(config, None, tokenizers.ByteTokenizer(), cache_dtype=dtype)
  assert kv_cache.check_dtype(jnp.int8) == "int8"
