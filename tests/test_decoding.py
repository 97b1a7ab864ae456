"""KV-cached decoding against the full forward pass: rings, mixed prompt lengths, errors,
and the planned cache bytes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax import decoder, planning
from gemma_jax.inference import decoding
from gemma_jax.layers import moe

WINDOW = 4
# Five layers of a (local, global) pattern: two scanned blocks and one unscanned layer,
# local in Gemma 3 and global in Gemma 4 (its last layer is).
GEMMA = dict(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
             num_layers=5, sliding_window=WINDOW, attention_pattern=("local", "global"))
FAMILIES = {
    "gemma3": ("gemma3-tiny", GEMMA),
    # Global layers with their own key/value heads and head dim, keys as values, value
    # norm, partial RoPE; experts (auto: the loop on prompts, gather on single tokens).
    "gemma4_moe": ("gemma4-moe-tiny", dict(GEMMA, global_head_dim=16, global_num_kv_heads=1,
                                           mlp_dim=32, expert_mlp_dim=16, num_experts=8,
                                           moe_dispatch="auto")),
    "gemma4_dense": ("gemma4-tiny", dict(GEMMA, global_head_dim=16, global_num_kv_heads=1)),
    # Global layers only, learned positions, fused biased projections, no RoPE.
    "gpt3": ("gpt3-52k", dict(vocab_size=97, num_layers=2)),
    # Attention and MLP side by side from one norm.
    "parallel": ("parallel-tiny", dict(GEMMA, attention_pattern=("global",))),
}


def tiny(family):
  preset, overrides = FAMILIES[family]
  config = gj.get_config(preset)
  config.model.update(overrides)
  return config


def random_params(config, seed=0):
  """Every parameter drawn from N(0, 0.3^2), norm scales included (no init to compile)."""
  shapes = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), shapes)


def decode_along(dec, params, prefilled, seq, lengths, full, steps):
  """Decodes `steps` tokens of `seq` [B, W] after prompts of `lengths` [B] from the
  prefill's (logits, cache): (logits of each step, the full forward's [B, W, V] logits
  at the same positions, the cache after)."""
  logits, cache = prefilled
  rows = np.arange(len(lengths))
  got, want = [logits], [full[rows, lengths - 1]]
  for i in range(steps):
    logits, cache = dec.decode_step(params, jnp.asarray(seq[rows, lengths + i]), cache)
    got.append(logits)
    want.append(full[rows, lengths + i])
  return got, want, cache


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
  config = tiny(request.param)
  return config, random_params(config)


@pytest.mark.slow
def test_prefill_then_decode_equals_the_full_forward(model):
  """Rows of 9, 3 and 6 prompt tokens then 7 steps each (window 4): every logit equals the
  full forward's at that position, whatever the other rows' lengths."""
  config, params = model
  lengths, steps = np.array([9, 3, 6]), 7
  width = lengths.max() + steps
  seq = np.random.RandomState(0).randint(0, 97, (3, width)).astype(np.int32)
  real = np.arange(width)[None] < (lengths[:, None] + steps)
  full = np.asarray(gj.transform(config).apply(params, jnp.asarray(seq * real),
                                               segment_ids=jnp.asarray(real, jnp.int32)))
  prompts = np.where(np.arange(9)[None] < lengths[:, None], seq[:, :9], 0)
  dec = decoding.make_decoding(config)
  prefilled = dec.prefill(params, jnp.asarray(prompts), jnp.asarray(lengths), cache_length=width)
  got, want, cache = decode_along(dec, params, prefilled, seq, lengths, full, steps)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  # The parameters unrolled once (as Sampler and ChatSession hold them) decode the same.
  unrolled = dec.unrolled(params)
  assert not {"blocks"} & set(unrolled) and len(jax.tree.leaves(unrolled)) >= len(
      jax.tree.leaves(params))
  if config.model.num_experts and jax.default_backend() == "cpu":   # one array per expert
    experts = unrolled["layers_0"]["moe"]["experts"]
    assert all(len(experts[n]) == config.model.num_experts for n in moe.EXPERT_WEIGHTS)
  again, _, _ = decode_along(dec, unrolled, dec.prefill(unrolled, jnp.asarray(prompts),
                                                        jnp.asarray(lengths), cache_length=width),
                             seq, lengths, full, steps)
  chex.assert_trees_all_close(again, got, atol=1e-6, rtol=0)

  # Local rings hold the window, global layers the whole context; one cache per layer.
  slots = {"local": WINDOW, "global": width}
  layers = decoder.unstack_layers(cache.layers, config.model)
  for i, kind in enumerate(decoder.layer_types(config.model)):
    for name in ("k", "v"):
      assert layers[f"layers_{i}"]["attn"][name].shape[:2] == (3, slots[kind]), (i, name)
  last = lengths + steps - 1
  np.testing.assert_array_equal(cache.next_position, last + 1)
  for kind, positions in cache.positions.items():   # each row's latest, -1 for empty slots
    latest = np.maximum(last[:, None] - np.arange(slots[kind]), -1)
    np.testing.assert_array_equal(np.sort(positions, axis=1), np.sort(latest, axis=1))


@pytest.mark.slow
def test_long_prompts_prefill_in_blocks_like_the_dense_masks(model):
  """Prompts of 530 and 300 tokens, over 2 x the window and the longer over two causal
  blocks: the prefill attends in blocks (no value in its program is T x T, neither a
  dense mask nor its logits), and its logits and those of 3 decode steps after it equal
  the full forward's with the dense masks given explicitly."""
  config, params = model
  lengths, steps = np.array([530, 300]), 3
  width = lengths.max() + steps
  seq = np.random.RandomState(2).randint(0, 97, (2, width)).astype(np.int32)
  real = np.arange(width)[None] < (lengths[:, None] + steps)
  segments = jnp.asarray(real, jnp.int32)
  full = np.asarray(decoder.Decoder(config.model).apply(
      {"params": params}, jnp.asarray(seq * real), jnp.broadcast_to(jnp.arange(width), real.shape),
      segments, masks=decoder.layer_masks(config.model, segments)))
  prompts = jnp.asarray(np.where(np.arange(530)[None] < lengths[:, None], seq[:, :530], 0))
  dec = decoding.make_decoding(config)
  prefill = lambda p, t, n: dec.prefill(p, t, n, cache_length=width)
  t = 529    # the prefill attends over all but the last prompt token
  assert f"{t}x{t}xf32" not in jax.jit(prefill).lower(params, prompts, lengths).as_text()
  prefilled = prefill(params, prompts, jnp.asarray(lengths))
  got, want, _ = decode_along(dec, params, prefilled, seq, lengths, full, steps)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


def test_cache_dtype_and_one_token_prompts(model):
  config, params = model
  dec = decoding.make_decoding(config)
  prefill = lambda p, t: dec.prefill(p, t, cache_length=5, cache_dtype="bfloat16")
  logits, cache = jax.eval_shape(prefill, params, jax.ShapeDtypeStruct((2, 1), jnp.int32))
  chex.assert_shape(logits, (2, 97))
  assert {leaf.dtype for leaf in jax.tree.leaves(cache.layers)} == {jnp.dtype("bfloat16")}
  for kind, positions in cache.positions.items():
    chex.assert_shape(positions, (2, {"local": WINDOW, "global": 5}[kind]))


@pytest.mark.parametrize("call, message", [
    (lambda dec, p: dec.prefill(p, jnp.zeros((1, 9), jnp.int32), cache_length=8),
     "prompt of 9 tokens is longer than cache_length=8"),
    (lambda dec, p: dec.prefill(p, jnp.asarray([[1, 97]]), cache_length=8),
     r"prompt tokens\[0, 1\] = 97 is outside the vocabulary \[0, 97\)"),
    (lambda dec, p: dec.prefill(p, jnp.ones((2, 3), jnp.int32), jnp.asarray([3, 0]),
                                cache_length=8),
     r"lengths\[1\] = 0 is outside \[1, 3\]"),
    (lambda dec, p: dec.prefill(p, jnp.ones((2, 3), jnp.int32), jnp.asarray([3]),
                                cache_length=8),
     r"lengths must have shape \[batch\]"),
])
def test_bad_inputs_name_what_is_wrong(model, call, message):
  config, params = model
  with pytest.raises(ValueError, match=message):
    call(decoding.make_decoding(config), params)


def test_decode_step_checks_its_tokens(model):
  config, params = model
  dec = decoding.make_decoding(config)
  cache = decoding.Cache({}, {}, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"tokens must have shape \[batch\] = \(2,\)"):
    dec.decode_step(params, jnp.zeros((2, 1), jnp.int32), cache)
  with pytest.raises(ValueError, match=r"tokens\[1, 0\] = -1 is outside the vocabulary"):
    dec.decode_step(params, jnp.asarray([0, -1]), cache)


def test_decode_step_stops_at_the_end_of_the_learned_positions():
  """GPT-3 with a table of 8 positions: a 5-token prompt decodes positions 5..7 like the
  full forward; the step at position 8 raises naming the table's size."""
  config = tiny("gpt3")
  config.model.trainable_position_size = config.data.seq_len = 8
  params = random_params(config)
  seq = np.random.RandomState(0).randint(0, 97, (2, 8)).astype(np.int32)
  full = np.asarray(gj.transform(config).apply(params, jnp.asarray(seq)))
  dec = decoding.make_decoding(config)
  lengths = np.array([5, 5])
  prefilled = dec.prefill(params, jnp.asarray(seq[:, :5]), cache_length=8)
  got, want, cache = decode_along(dec, params, prefilled, seq, lengths, full, 3)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match=r"cache.next_position span \[8, 8\], outside the "
                     r"learned position table \[0, config.model.trainable_position_size=8\)"):
    dec.decode_step(params, jnp.zeros((2,), jnp.int32), cache)


def test_cache_bytes_of_gemma3_27b_at_128k():
  """62 layers (10 global), 16 key/value heads of 128, bfloat16 keys and values: a window
  of 1024 on 52 local layers instead of 131072 positions; int32 slot positions."""
  config = gj.get_config("gemma3-27b")
  length, kv_bytes_per_position = 131072, 2 * 16 * 128 * 2
  got = planning.cache_bytes(config, batch_size=1, cache_length=length)
  positions_bytes = lambda slots: 4 * (slots + 1)   # the slots' positions, the next position
  assert got["cache"] == ((10 * length + 52 * 1024) * kv_bytes_per_position
                          + positions_bytes(length + 1024))
  assert got["full_length"] == 62 * length * kv_bytes_per_position + positions_bytes(2 * length)
  assert got["full_length"] / got["cache"] > 5.9


@pytest.mark.slow
def test_prompts_with_images_decode_like_the_full_forward():
  """A row with one image (and a padding image) and a row with two: prefill with the
  images, then 4 text steps, equal the full forward given the same images."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.update(dict(GEMMA, vocab_size=512))
  v = config.model.vision
  params = random_params(config)
  span = [v.boi_token_id] + [v.image_token_id] * v.tokens_per_image + [v.eoi_token_id]
  prompts = [[2, 40] + span + [41, 42], [2] + span + span + [43]]
  lengths, steps = np.array([len(p) for p in prompts]), 4
  width = lengths.max() + steps
  rng = np.random.RandomState(1)
  seq = rng.randint(3, 300, (2, width)).astype(np.int32)      # text after the prompts
  for b, prompt in enumerate(prompts):
    seq[b, :len(prompt)] = prompt
  real = np.arange(width)[None] < (lengths[:, None] + steps)
  images = jnp.asarray(rng.uniform(-1, 1, (2, 2, v.image_size, v.image_size, 3)), jnp.float32)
  full = np.asarray(gj.transform(config).apply(
      params, jnp.asarray(seq * real), segment_ids=jnp.asarray(real, jnp.int32), images=images))
  padded = np.where(np.arange(lengths.max())[None] < lengths[:, None], seq[:, :lengths.max()], 0)
  dec = decoding.make_decoding(config)
  prefilled = dec.prefill(params, jnp.asarray(padded), jnp.asarray(lengths), cache_length=width,
                          images=images)
  got, want, _ = decode_along(dec, params, prefilled, seq, lengths, full, steps)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  # The images matter: without them the prompt's placeholders embed as plain tokens.
  blank = dec.prefill(params, jnp.asarray(padded), jnp.asarray(lengths), cache_length=width,
                      images=jnp.zeros_like(images))[0]
  assert np.abs(np.asarray(blank) - want[0]).max() > 1e-3
  with pytest.raises(ValueError, match="span 0 holds 1 image_token_id ids"):
    dec.prefill(params, jnp.asarray(padded[:, :3]), jnp.asarray([3, 3]), cache_length=width,
                images=images)
  # Past the prompt, text only: a placeholder there would embed as a word.
  cache = dec.prefill(params, jnp.asarray(padded), jnp.asarray(lengths), cache_length=width,
                      images=images)[1]
  with pytest.raises(ValueError, match=rf"tokens\[1, 2\] is the image placeholder id "
                     rf"{v.image_token_id}: extend takes text only"):
    dec.extend(params, jnp.asarray([[5, 6, 7], [8, 9, v.image_token_id]]), cache)


def test_global_layers_past_cache_length_attend_to_the_last_cache_length_tokens():
  """Decoding past `cache_length` S: a global layer's ring keeps the last S keys, so with
  S equal to the window and one RoPE for both types, every layer acts as a local one. The
  reference is the full forward of the same weights with every layer local."""
  config = tiny("gemma3")
  config.model.update(scan_layers=False, rope_global_base=config.model.rope_local_base)
  all_local = tiny("gemma3")
  all_local.model.update(scan_layers=False, rope_global_base=config.model.rope_local_base,
                         attention_pattern=("local",))
  params = random_params(config)
  lengths, steps = np.array([3, 2]), 7
  seq = np.random.RandomState(1).randint(0, 97, (2, 3 + steps)).astype(np.int32)
  real = np.arange(seq.shape[1])[None] < (lengths[:, None] + steps)
  full = np.asarray(gj.transform(all_local).apply(params, jnp.asarray(seq * real),
                                                  segment_ids=jnp.asarray(real, jnp.int32)))
  dec = decoding.make_decoding(config)
  prompts = np.where(np.arange(3)[None] < lengths[:, None], seq[:, :3], 0)
  prefilled = dec.prefill(params, jnp.asarray(prompts), jnp.asarray(lengths),
                          cache_length=WINDOW)
  got, want, _ = decode_along(dec, params, prefilled, seq, lengths, full, steps)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  # The global layers' own reference (whole context) differs once they wrap.
  whole = np.asarray(gj.transform(config).apply(params, jnp.asarray(seq * real),
                                                segment_ids=jnp.asarray(real, jnp.int32)))
  assert np.abs(np.asarray(got[-1]) - whole[[0, 1], lengths + steps - 1]).max() > 1e-3
