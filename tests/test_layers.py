"""Shared layers against float64 numpy re-computations, jitted and not."""

import contextlib
import functools
import io
import math
import re
from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import gemma_jax as gj
from gemma_jax import config as config_lib
from gemma_jax.layers import attention as attention_lib
from gemma_jax.layers import mlp
from gemma_jax.layers import norms
from gemma_jax.layers import rms_norm_gradient
from gemma_jax.layers.mlp import GatedMlp
from gemma_jax.layers.norms import RMSNorm
from gemma_jax.layers.rope import apply_rope


def np_rms_norm(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + scale)


def np_rope(x, positions, base, scale=1.0, fraction=1.0):
  """Rotation of pairs (i, i + H/2) by positions * base^(-2i/H) / scale, for i < f*H/2."""
  x = np.asarray(x, np.float64)
  h = x.shape[-1]
  out = x.copy()
  for i in range(int(fraction * h // 2)):
    theta = positions[..., None] * base ** (-2.0 * i / h) / scale      # [B, T, 1]
    a, b = x[..., i], x[..., i + h // 2]
    out[..., i] = a * np.cos(theta[..., 0])[..., None] - b * np.sin(theta[..., 0])[..., None]
    out[..., i + h // 2] = b * np.cos(theta[..., 0])[..., None] + a * np.sin(theta[..., 0])[..., None]
  return out


def np_gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np_mask(t, segments, window=None, spans=None):
  b = segments.shape[0]
  mask = np.zeros((b, t, t), bool)
  for r in range(b):
    for q in range(t):
      for k in range(t):
        ok = k <= q and (window is None or q - k < window)
        if spans is not None and spans[r, q] > 0 and spans[r, q] == spans[r, k]:
          ok = True
        mask[r, q, k] = ok and segments[r, q] == segments[r, k]
  return mask


def np_attention(q, k, v, mask, softcap=None):
  """q [B,T,N,H] (scaled), k, v [B,S,K,H] in float64 with explicit head grouping."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  n, kv = q.shape[2], k.shape[2]
  out = np.zeros_like(q)
  for head in range(n):
    g = head // (n // kv)
    logits = np.einsum("bth,bsh->bts", q[:, :, head], k[:, :, g])
    if softcap is not None:
      logits = softcap * np.tanh(logits / softcap)
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[:, :, head] = np.einsum("bts,bsh->bth", p, v[:, :, g])
  return out


class RMSNormTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_float64(self):
    x = jax.random.normal(jax.random.key(0), (2, 5, 16)) * 3
    norm = RMSNorm(eps=1e-6)
    params = nn.meta.unbox(norm.init(jax.random.key(1), x))
    chex.assert_trees_all_equal(params["params"]["scale"], jnp.zeros(16))
    scale = jax.random.normal(jax.random.key(2), (16,))
    y = self.variant(norm.apply)({"params": {"scale": scale}}, x)
    chex.assert_shape(y, (2, 5, 16))
    np.testing.assert_allclose(y, np_rms_norm(x, np.asarray(scale), 1e-6), rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradients_match_float64_for_one_row(self):
    # A batch of one row is the shape whose scale gradient is reduced over a [T, D] view.
    x = jax.random.normal(jax.random.key(0), (1, 7, 16)) * 3
    scale = jax.random.normal(jax.random.key(2), (16,))
    cotangent = jax.random.normal(jax.random.key(3), (1, 7, 16))
    loss = lambda scale, x: jnp.sum(
        RMSNorm(eps=1e-6).apply({"params": {"scale": scale}}, x) * cotangent)
    d_scale, d_x = self.variant(jax.grad(loss, argnums=(0, 1)))(scale, x)
    x64, c64, s64 = (np.asarray(a, np.float64) for a in (x, cotangent, scale))
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(d_scale, np.sum(x64 / rms * c64, axis=(0, 1)), rtol=1e-5,
                               atol=1e-5)
    g = c64 * (1 + s64)   # d loss / d (x / rms)
    expected_dx = g / rms - x64 * np.sum(g * x64, -1, keepdims=True) / (16 * rms ** 3)
    np.testing.assert_allclose(d_x, expected_dx, rtol=1e-4, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_without_scale_has_no_params_and_keeps_dtype(self):
    x = jax.random.normal(jax.random.key(0), (3, 8)).astype(jnp.bfloat16)
    norm = RMSNorm(with_scale=False)
    params = norm.init(jax.random.key(1), x)
    self.assertEqual(jax.tree_util.tree_leaves(params), [])
    y = self.variant(norm.apply)(params, x)
    self.assertEqual(y.dtype, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np_rms_norm(np.asarray(x, np.float32), 0.0, 1e-6), rtol=2e-2)


def _norm_widths(m) -> set:
  """The widths a model's RMSNorms normalise: the model, its heads, per-layer inputs."""
  return {m.d_model, m.head_dim or m.d_model // m.num_heads, m.get("global_head_dim") or 0,
          m.get("per_layer_input_dim") or 0} - {0}


class RMSNormGradientKernelTest(chex.TestCase, parameterized.TestCase):
  """The Pallas backward (`rms_norm_gradient`, a GPU's path), run in Pallas's interpreter."""

  @parameterized.parameters((37, 72, 4, 3), (64, 256, 0, 512), (19, 1152, 2, 4),
                            (0, 128, 0, 512))
  def test_backward_matches_float64(self, rows, width, block_rows, programs):
    # Rows that fill neither a block nor a program's share, widths off a power of two.
    rng = np.random.default_rng(rows)
    x, dy = rng.normal(size=(2, rows, width)) * 3
    w = rng.normal(size=width)
    dx, dw = rms_norm_gradient.backward(
        jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
        jnp.asarray(dy, jnp.float32), 1e-6, block_rows=block_rows, programs=programs)
    chex.assert_shape(dx, (rows, width))
    chex.assert_shape(dw, (width,))
    r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    g = dy * w
    np.testing.assert_allclose(dx, r * (g - x * r * np.mean(g * x * r, -1, keepdims=True)),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, np.sum(dy * x * r, axis=0), rtol=1e-4, atol=1e-4)

  def test_kernel_lowers_to_triton_for_every_gemma_width(self):
    """The kernel as a GPU runs it (not interpreted), lowered for CUDA here, where
    there is no GPU: every norm width of the presets (model, head and per-layer-input
    dims) gives a Triton call, so a width the leases never ran fails here first."""
    widths = sorted({w for name in gj.PRESETS for w in _norm_widths(gj.get_config(name).model)
                     if w % 16 == 0})
    self.assertTrue({1152, 2816, 512, 5376} <= set(widths), widths)
    for width in widths:
      x = jax.ShapeDtypeStruct((4096, width), jnp.bfloat16)
      with mock.patch.object(jax, "default_backend", return_value="gpu"):
        lowered = jax.jit(lambda x, w, dy: rms_norm_gradient.backward(x, w, dy, 1e-6)).trace(
            x, jax.ShapeDtypeStruct((width,), jnp.float32), x).lower(
                lowering_platforms=("cuda",))
      self.assertIn("__gpu$xla.gpu.triton", lowered.as_text(), width)

  def test_kernel_only_on_one_cuda_device_and_widths_of_sixteen(self):
    backend = lambda version: mock.patch.object(
        jax.extend.backend, "get_backend", return_value=mock.Mock(platform_version=version))
    self.assertFalse(norms.uses_gradient_kernel(1152))      # this CPU
    one_device = mock.patch.object(jax, "device_count", return_value=1)
    with backend("cuda 12080"):
      self.assertFalse(norms.uses_gradient_kernel(1152))    # the tests' several devices
      with one_device:
        self.assertTrue(norms.uses_gradient_kernel(1152))
        self.assertFalse(norms.uses_gradient_kernel(1000))
        with mock.patch.object(norms, "GRADIENT_KERNEL", False):
          self.assertFalse(norms.uses_gradient_kernel(1152))
    with backend("rocm 60300"), one_device:
      self.assertFalse(norms.uses_gradient_kernel(1152))

  @parameterized.parameters((True, True), (True, False), (False, True))
  def test_module_gradients_match_float64(self, with_scale, plus_one):
    x = jax.random.normal(jax.random.key(0), (2, 5, 24)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(3), (2, 5, 24))
    norm = RMSNorm(eps=1e-6, with_scale=with_scale, plus_one=plus_one)
    params = {"params": {"scale": jax.random.normal(jax.random.key(2), (24,))}
              } if with_scale else {}
    loss = lambda params, x: jnp.sum(norm.apply(params, x).astype(jnp.float32) * cotangent)
    with mock.patch.object(norms, "uses_gradient_kernel", return_value=True):
      grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
      self.assertIn("pallas_call", str(jax.make_jaxpr(grad)(params, x)))
      d_params, d_x = grad(params, x)
    self.assertEqual(d_x.dtype, jnp.bfloat16)
    # The norm's output is bfloat16, so is the cotangent it receives.
    x64, c64 = (np.asarray(a, np.float64) for a in (x, cotangent.astype(jnp.bfloat16)))
    s64 = np.asarray(params["params"]["scale"], np.float64) if with_scale else 0.0
    rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6)
    g = c64 * ((1 + s64) if plus_one else s64)
    expected_dx = g / rms - x64 * np.sum(g * x64, -1, keepdims=True) / (24 * rms ** 3)
    np.testing.assert_allclose(np.asarray(d_x, np.float64), expected_dx, rtol=2e-2,
                               atol=2e-2 * np.abs(expected_dx).max())
    if with_scale:
      np.testing.assert_allclose(d_params["params"]["scale"],
                                 np.sum(x64 / rms * c64, axis=(0, 1)), rtol=1e-4, atol=1e-4)


class RopeTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((10_000.0, 1.0, 1.0), (1e6, 8.0, 1.0), (1e6, 1.0, 0.25),
                            (10_000.0, 2.0, 0.5))
  def test_matches_float64(self, base, scale, fraction):
    x = jax.random.normal(jax.random.key(0), (2, 7, 3, 16))
    positions = jnp.array([np.arange(7), np.arange(7) * 13 + 5])
    y = self.variant(lambda x, p: apply_rope(x, p, base=base, scale=scale, fraction=fraction))(
        x, positions)
    chex.assert_shape(y, x.shape)
    np.testing.assert_allclose(y, np_rope(x, np.asarray(positions), base, scale, fraction),
                               rtol=1e-4, atol=1e-4)

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_token_matches_float64(self):
    x = jax.random.normal(jax.random.key(0), (3, 1, 4, 16))
    positions = jnp.array([[0], [7], [1000]])
    y = self.variant(lambda x, p: apply_rope(x, p, base=10_000.0))(x, positions)
    np.testing.assert_allclose(y, np_rope(x, np.asarray(positions), 10_000.0),
                               rtol=1e-4, atol=1e-4)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradient_is_the_inverse_rotation(self):
    """RoPE is an orthogonal map R(p) of x, so d/dx sum(w * R(p) x) = R(p)^T w = R(-p) w."""
    x = jax.random.normal(jax.random.key(0), (2, 9, 3, 16))
    w = jax.random.normal(jax.random.key(1), x.shape)
    positions = jnp.array([np.arange(9), np.arange(9) * 7 + 3])
    grad = self.variant(jax.grad(
        lambda x: jnp.sum(w * apply_rope(x, positions, base=100.0, fraction=0.5))))(x)
    np.testing.assert_allclose(grad, np_rope(w, -np.asarray(positions), 100.0, fraction=0.5),
                               rtol=1e-4, atol=1e-4)

  def test_cpu_computes_each_sine_once_not_per_head(self):
    """XLA's CPU backend would fuse the sines and cosines into the rotation and compute
    them again for each of the N heads; no kernel that computes them may be per head."""
    b, t, n, h = 2, 16, 8, 64
    cpu = jax.devices("cpu")[0]   # the CPU's program, whatever the default backend
    text = jax.jit(lambda x, p: apply_rope(x, p, base=10_000.0)).lower(
        jax.device_put(jnp.zeros((b, t, n, h)), cpu),
        jax.device_put(jnp.zeros((b, t), jnp.int32), cpu)).compile().as_text()
    computations = text.split("\n\n")
    with_sines = [c for c in computations if "cosine(" in c or " sine(" in c]
    self.assertNotEmpty(with_sines)
    for computation in with_sines:
      root = re.search(r"ROOT %\S+ = \w+\[([\d,]*)\]", computation).group(1)
      self.assertLessEqual(math.prod(int(d) for d in root.split(",")), b * t * h,
                           computation[:300])

  def test_relative_positions_only(self):
    """q.k after RoPE depends on the position difference alone."""
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    dot = lambda pq, pk: jnp.sum(apply_rope(q, jnp.array([[pq]]), base=100.0) *
                                 apply_rope(k, jnp.array([[pk]]), base=100.0))
    np.testing.assert_allclose(dot(3, 1), dot(10, 8), rtol=1e-5)


class MaskTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_causal_window_segments_spans(self):
    t = 9
    segments = np.array([[1] * 5 + [2] * 4, [1] * 9])
    spans = np.array([[0] * 9, [0, 0, 3, 3, 3, 0, 0, 0, 0]])
    index = np.broadcast_to(np.arange(t), (2, t))
    fn = self.variant(lambda s, w, sp: attention_lib.attention_mask(
        index, index, s, s, window=w, q_spans=sp, kv_spans=sp), static_argnums=1)
    for window in (None, 3):
      got = fn(segments, window, spans)
      chex.assert_shape(got, (2, t, t))
      np.testing.assert_array_equal(got, np_mask(t, segments, window, spans))

  def test_span_is_bidirectional_and_text_before_does_not_see_it(self):
    index = np.arange(6)[None]
    spans = np.array([[0, 7, 7, 7, 0, 0]])
    mask = np.asarray(attention_lib.attention_mask(index, index, np.ones((1, 6)),
                                                   np.ones((1, 6)), q_spans=spans,
                                                   kv_spans=spans))[0]
    self.assertTrue(mask[1, 3] and mask[3, 1])          # image tokens see each other
    self.assertTrue(mask[5, 2])                         # text after the image sees it
    self.assertFalse(mask[0, 1])                        # text before it does not


class AttentionTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((4, 4, None), (4, 2, None), (4, 1, 5.0))   # MHA, GQA, MQA
  def test_dot_product_attention_matches_float64(self, n, kv, cap):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 6, n, 8))
    k = jax.random.normal(keys[1], (2, 6, kv, 8))
    v = jax.random.normal(keys[2], (2, 6, kv, 8))
    segments = np.array([[1, 1, 1, 2, 2, 2], [1] * 6])
    index = np.broadcast_to(np.arange(6), (2, 6))
    mask = attention_lib.attention_mask(index, index, segments, segments, window=2)
    out = self.variant(lambda *a: attention_lib.dot_product_attention(*a, cap))(q, k, v, mask)
    chex.assert_shape(out, (2, 6, n, 8))
    np.testing.assert_allclose(out, np_attention(q, k, v, np.asarray(mask), cap),
                               rtol=1e-5, atol=1e-5)

  @parameterized.parameters(1.0, 1e16)
  def test_masked_keys_stay_out_at_any_logit_magnitude(self, scale):
    """Masked keys get no weight at any logit magnitude, against float64, down to logits
    of ~ -1e32 (where adding float32's lowest would overflow to -inf, and a query that
    sees no key would get NaN); that query (a padded one) gets a finite output, at
    ordinary magnitudes the values' mean, as a select of float32's lowest gave."""
    keys = jax.random.split(jax.random.key(3), 3)
    t = 6
    q = -jnp.abs(jax.random.normal(keys[0], (1, t, 2, 4))) * scale   # every q.k < 0
    k = jnp.abs(jax.random.normal(keys[1], (1, t, 1, 4))) * scale
    v = jax.random.normal(keys[2], (1, t, 1, 4))
    mask = np.tril(np.ones((t, t), bool))[None]
    mask[0, 2] = False                                # query 2 sees no key
    for attend in (jax.jit(attention_lib.dot_product_attention),
                   attention_lib.dot_product_attention):
      out = np.asarray(attend(q, k, v, jnp.asarray(mask)))
      self.assertTrue(np.isfinite(out).all())
      rows = [i for i in range(t) if i != 2]
      np.testing.assert_allclose(out[0, rows], np_attention(q, k, v, mask)[0, rows],
                                 rtol=1e-5, atol=1e-5)
      if scale == 1.0:
        np.testing.assert_allclose(out[0, 2], np.broadcast_to(np.mean(v[0], 0), (2, 4)),
                                   rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((4, 4, None, None), (4, 2, None, None), (4, 1, 5.0, None),
                            (4, 2, None, "local"), (2, 1, 3.0, "local"),
                            (4, 2, None, "causal"), (2, 1, 3.0, "causal"))
  def test_gradients_match_torch_float64(self, n, kv, cap, blocks):
    """The written-out backward pass (`grouped_attention`) against PyTorch's autograd in
    float64 of the dense masked attention: dense, in window blocks (padded tail), and in
    causal blocks (a short last block)."""
    import torch   # pylint: disable=import-outside-toplevel
    t, window = (13, 4) if blocks != "causal" else (520, None)
    keys = jax.random.split(jax.random.key(n + kv), 4)
    q = jax.random.normal(keys[0], (2, t, n, 8))
    k, v = (jax.random.normal(key, (2, t, kv, 8)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (2, t, n, 8))
    segments = np.ones((2, t), np.int32)
    segments[0, 5:] = 2
    index = np.broadcast_to(np.arange(t), (2, t))
    mask = np_mask(t, segments, window=window)
    dense = attention_lib.attention_mask(index, index, segments, segments, window=window)
    if blocks == "local":
      attend = lambda q, k, v: attention_lib.local_block_attention(
          q, k, v, attention_lib.local_blocks(jnp.asarray(segments), window), cap)
    elif blocks == "causal":
      attend = lambda q, k, v: attention_lib.causal_block_attention(
          q, k, v, attention_lib.CausalBlocks(dense), cap)
    else:
      attend = lambda q, k, v: attention_lib.dot_product_attention(q, k, v, dense, cap)
    grads = self.variant(jax.grad(lambda *a: jnp.sum(attend(*a) * weights), argnums=(0, 1, 2)))(
        q, k, v)

    qt, kt, vt = (torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True)
                  for a in (q, k, v))
    logits = torch.einsum("btnh,bsnh->bnts", qt, kt.repeat_interleave(n // kv, dim=2))
    if cap is not None:
      logits = cap * torch.tanh(logits / cap)
    logits = logits.masked_fill(~torch.from_numpy(mask)[:, None], -torch.inf)
    out = torch.einsum("bnts,bsnh->btnh", torch.softmax(logits, -1),
                       vt.repeat_interleave(n // kv, dim=2))
    torch.sum(out * torch.tensor(np.asarray(weights), dtype=torch.float64)).backward()
    for got, want in zip(grads, (qt.grad, kt.grad, vt.grad)):
      chex.assert_shape(got, want.shape)
      np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((23, 5, None, None), (20, 5, 3.0, None), (11, 4, None, None),
                            (40, 8, None, None), (40, 8, None, 8), (37, 8, 3.0, 2))
  def test_local_blocks_match_float64_window_mask(self, t, window, cap, block):
    """Blocked sliding-window attention (T x (W + Q) logits, Q queries per block: the
    default W / 2, or W for an odd window; W, W / 4 given) equals the dense windowed mask,
    with T a multiple of the block or not, packed segments and a padded tail."""
    keys = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[1:])
    segments = np.ones((2, t), np.int32)
    segments[0, t // 3:] = 2
    segments[1, t - 3:] = 0                       # padding is a segment of its own
    blocks = attention_lib.local_blocks(jnp.asarray(segments), window, block)
    q_block = block or (window // 2 if window % 2 == 0 else window)
    chex.assert_shape(blocks.mask, (2, -(-t // q_block), q_block, window + q_block))
    out = self.variant(lambda *a: attention_lib.local_block_attention(*a, cap))(q, k, v, blocks)
    chex.assert_shape(out, (2, t, 4, 8))
    expected = np_attention(q, k, v, np_mask(t, segments, window=window), cap)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

  def test_local_blocks_refuse_a_block_not_dividing_the_window(self):
    with self.assertRaisesRegex(ValueError, "3 queries do not divide the window 8"):
      attention_lib.local_blocks(jnp.ones((1, 40), jnp.int32), 8, 3)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((23, None, "jax"), (23, 5, "jax"), (40, 8, "jax"),
                            (23, 5, "einsum"), (40, None, "einsum"))
  def test_causal_structure_matches_float64_mask(self, t, window, kernel):
    """Either kernel given only a causal mask's structure (no mask array) equals the
    float64 causal (windowed) mask, and given the packed rows' mask as well, that mask:
    its band (window - 1 keys back) is the window of `attention_mask`."""
    keys = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[1:])
    attend = self.variant(lambda q, k, v, m: attention_lib.dot_product_attention(
        q, k, v, m, kernel=kernel, causal=True, window=window))
    ones = np.ones((2, t), np.int32)
    np.testing.assert_allclose(attend(q, k, v, None),
                               np_attention(q, k, v, np_mask(t, ones, window=window)),
                               rtol=1e-5, atol=1e-5)
    segments = ones.copy()
    segments[0, t // 3:] = 2
    segments[1, t - 3:] = 0
    mask = np_mask(t, segments, window=window)
    np.testing.assert_allclose(attend(q, k, v, jnp.asarray(mask)),
                               np_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)

  @parameterized.parameters((23, None, True), (23, 5, True), (24, 5, True), (23, 5, False),
                            (23, None, False))
  def test_jax_kernel_hands_causal_attention_over_even_lengths_only(self, t, window, packed):
    """cuDNN's fused kernel takes a mask (as a bias, which a window becomes) in training
    only at even lengths: the causal "jax" kernel appends a position at odd T, which
    changes neither the outputs nor the gradients (the einsum kernel's under the mask
    array). Rows of one document (not `packed`) hand it no mask array, only the
    structure."""
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (2, t, 4, 8))
    segments = np.ones((2, t), np.int32)
    if packed:
      segments[0, t // 3:] = 2
    mask = jnp.asarray(np_mask(t, segments, window=window))
    lengths = []
    fused = jax.nn.dot_product_attention

    def recorded(q, k, v, *args, mask=None, **kwargs):
      lengths.append((q.shape[1], k.shape[1], mask is not None, kwargs["is_causal"]))
      return fused(q, k, v, *args, mask=mask, **kwargs)

    def loss(kernel, q, k, v):
      given = mask if packed or kernel == "einsum" else None
      out = attention_lib.dot_product_attention(q, k, v, given, kernel=kernel, causal=True,
                                                window=window)
      return jnp.sum(out * weights)

    with mock.patch.object(jax.nn, "dot_product_attention", recorded):
      value, grads = jax.value_and_grad(functools.partial(loss, "jax"), (0, 1, 2))(q, k, v)
    assert lengths == [(t + t % 2, t + t % 2, packed, True)], lengths
    expected_value, expected_grads = jax.value_and_grad(
        functools.partial(loss, "einsum"), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal_shapes(grads, (q, k, v))

  def test_jax_kernel_leaves_heads_wider_than_cudnn_takes_to_xla(self):
    """On a GPU the "jax" kernel hands bfloat16 attention to cuDNN only for head dims it
    takes (at most 256 on Hopper): Gemma 4's 512-wide global heads, which JAX's cuDNN
    entry point refuses, go to XLA's implementation, with the same values."""
    implementations = []
    fused = jax.nn.dot_product_attention

    def recorded(q, k, v, *args, implementation=None, **kwargs):
      implementations.append((q.shape[-1], implementation))
      if implementation == "cudnn":    # this CPU has no cuDNN: the choice is what counts
        return jnp.zeros_like(q)
      return fused(q, k, v, *args, implementation=implementation, **kwargs)

    for width in (64, 512):
      keys = jax.random.split(jax.random.key(width), 3)
      q = jax.random.normal(keys[0], (1, 16, 2, width), jnp.bfloat16)
      k, v = (jax.random.normal(key, (1, 16, 1, width), jnp.bfloat16) for key in keys[1:])
      with mock.patch.object(jax, "default_backend", return_value="gpu"), \
          mock.patch.object(attention_lib, "cudnn_head_dim_limit", return_value=256), \
          mock.patch.object(jax.nn, "dot_product_attention", recorded):
        out = attention_lib.dot_product_attention(q, k, v, None, kernel="jax", causal=True,
                                                  window=8)
    self.assertEqual(implementations, [(64, "cudnn"), (512, None)])
    expected = attention_lib.dot_product_attention(q, k, v, None, kernel="einsum",
                                                   causal=True, window=8)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=2e-2, atol=2e-2)

  @parameterized.parameters(("9.0", 256), ("10.0", 256), ("8.0", 128), (None, 128))
  def test_cudnn_head_dim_limit_follows_the_compute_capability(self, capability, limit):
    device = mock.Mock(spec=["compute_capability"] if capability else [])
    if capability:
      device.compute_capability = capability
    with mock.patch.object(jax, "devices", return_value=[device]):
      self.assertEqual(attention_lib.cudnn_head_dim_limit(), limit)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((512, None), (600, 3.0), (777, None))
  def test_causal_blocks_match_float64_mask(self, t, cap):
    """Causal blocks (each block of queries over its key prefix) equal the dense causal
    mask, with T a multiple of the block or not, packed segments and padding."""
    size = attention_lib.causal_block_size(t)
    self.assertLess(size, t)
    keys = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 8))
    k, v = (jax.random.normal(key, (2, t, 2, 8)) for key in keys[1:])
    segments = np.ones((2, t), np.int32)
    segments[0, size + 7:] = 2                    # a document starting inside a block
    segments[1, t - 3:] = 0                       # padding is a segment of its own
    index = np.broadcast_to(np.arange(t), (2, t))
    blocks = attention_lib.CausalBlocks(
        attention_lib.attention_mask(index, index, segments, segments))
    out = self.variant(lambda *a: attention_lib.causal_block_attention(*a, cap))(
        q, k, v, blocks)
    chex.assert_shape(out, (2, t, 4, 8))
    expected = np_attention(q, k, v, np_mask(t, segments), cap)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_module_matches_float64(self):
    b, t, d, n, kv, h = 2, 5, 12, 4, 2, 8
    module = attention_lib.Attention(num_heads=n, num_kv_heads=kv, head_dim=h,
                                     query_scale=0.3, rope_base=100.0, rope_scale=2.0)
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    params = nn.meta.unbox(module.init(jax.random.key(1), x, positions, mask)["params"])
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(
        jax.random.key(2), a.shape), params)                   # non-trivial norm scales
    out = self.variant(lambda p, x: module.apply({"params": p}, x, positions, mask))(params, x)
    chex.assert_shape(out, (b, t, d))

    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x64 = np.asarray(x, np.float64)
    q = np.einsum("btd,dnh->btnh", x64, p["q"]["kernel"])
    k = np.einsum("btd,dnh->btnh", x64, p["k"]["kernel"])
    v = np.einsum("btd,dnh->btnh", x64, p["v"]["kernel"])
    q = np_rms_norm(q, p["q_norm"]["scale"], 1e-6)
    k = np_rms_norm(k, p["k_norm"]["scale"], 1e-6)
    pos = np.asarray(positions, np.float64)
    q, k = np_rope(q, pos, 100.0, 2.0) * 0.3, np_rope(k, pos, 100.0, 2.0)
    ctx = np_attention(q, k, v, np.asarray(mask))
    expected = np.einsum("btnh,nhd->btd", ctx, p["out"]["kernel"])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


class MlpTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_gated_gelu_matches_float64(self):
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    mlp = GatedMlp(mlp_dim=16)
    params = nn.meta.unbox(mlp.init(jax.random.key(1), x)["params"])
    out = self.variant(mlp.apply)({"params": params}, x)
    chex.assert_shape(out, (2, 3, 8))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x64 = np.asarray(x, np.float64)
    hidden = np_gelu_tanh(x64 @ p["gate"]["kernel"]) * (x64 @ p["up"]["kernel"])
    np.testing.assert_allclose(out, hidden @ p["down"]["kernel"], rtol=1e-5, atol=1e-6)

  def test_gated_gradient_matches_float64(self):
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    weights = jax.random.normal(jax.random.key(2), (2, 3, 8))   # d loss / d out
    mlp = GatedMlp(mlp_dim=16)
    params = nn.meta.unbox(mlp.init(jax.random.key(1), x)["params"])
    loss = lambda params, x: jnp.sum(mlp.apply({"params": params}, x) * weights)
    grads, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x64, r = (np.asarray(a, np.float64).reshape(6, 8) for a in (x, weights))
    gate, up = x64 @ p["gate"]["kernel"], x64 @ p["up"]["kernel"]
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (gate + 0.044715 * gate ** 3))
    gelu_grad = 0.5 * (1 + t) + 0.5 * gate * (1 - t ** 2) * c * (1 + 3 * 0.044715 * gate ** 2)
    d_hidden = r @ p["down"]["kernel"].T
    d_gate, d_up = d_hidden * up * gelu_grad, d_hidden * np_gelu_tanh(gate)
    tol = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["down"]["kernel"], (np_gelu_tanh(gate) * up).T @ r, **tol)
    np.testing.assert_allclose(grads["gate"]["kernel"], x64.T @ d_gate, **tol)
    np.testing.assert_allclose(grads["up"]["kernel"], x64.T @ d_up, **tol)
    np.testing.assert_allclose(
        dx.reshape(6, 8), d_gate @ p["gate"]["kernel"].T + d_up @ p["up"]["kernel"].T, **tol)

  def test_gradient_keeps_no_activation_intermediates(self):
    """Of the [B, T, F] values the gradient keeps, only gate and up: the activation is
    recomputed from gate (each kept intermediate is a [B, T, F] write and read)."""
    x = jnp.ones((2, 3, 8))
    mlp = GatedMlp(mlp_dim=16)
    params = nn.meta.unbox(mlp.init(jax.random.key(1), x)["params"])
    loss = lambda params, x: jnp.sum(mlp.apply({"params": params}, x))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      jax.ad_checkpoint.print_saved_residuals(loss, params, x)
    kept = printed.getvalue().splitlines()
    self.assertLen([line for line in kept if line.startswith("f32[2,3,16] ")], 2, kept)


def test_every_activation_the_schema_names_is_computed_as_its_definition():
  """config.ACTIVATIONS (the names a config may give) and layers.mlp's functions are one
  list, each against its float64 definition."""
  x = np.linspace(-6.0, 6.0, 1001)
  gelu_tanh = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
  expected = {"gelu_tanh": gelu_tanh, "gelu": 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2))),
              "silu": x / (1 + np.exp(-x)), "relu": np.maximum(x, 0.0)}
  assert set(config_lib.ACTIVATIONS) == set(mlp.ACTIVATIONS) == set(expected)
  for name, want in expected.items():
    got = np.asarray(mlp.ACTIVATIONS[name](jnp.asarray(x, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-6, err_msg=name)
