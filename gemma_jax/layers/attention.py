"""Multi-head attention (MHA, GQA, MQA) and the masks it is used with.

Dims: B batch, T query length, S key length, D model width, N query heads,
K key/value heads, G = N / K queries per key head, H head dim.

A sliding-window layer over a long sequence (T > 2W) takes its mask as `LocalBlocks`:
its queries go in blocks of Q = W / 2, each attending only to the W + Q keys ending with
its last query, so the work is T x 1.5W instead of T x T. Any other causal layer over a long
sequence takes its mask as `CausalBlocks`: its queries go in blocks, each attending
only to the keys up to its own last query, so the masked upper triangle is skipped
(8 blocks: 56% of the T x T work). Both suit kernels that compute every logit they are
given (ours, XLA's). cuDNN's fused kernel (the "jax" kernel on a GPU) takes a causal
layer's mask as `CausalMask` instead: the whole [B, T, T] mask with its structure
(causal, and the window), from which it skips the masked tiles itself.

Decoding replaces a layer's mask by a cache access (`gemma_jax.layers.cache_access`):
the layer then keeps its keys and values in the "cache" variable collection.
"""

import functools
from typing import NamedTuple, Optional, Tuple, Union

import chex
from flax import struct
import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from gemma_jax.layers import cache_access
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.norms import RMSNorm
from gemma_jax.layers.rope import apply_rope


def attention_mask(q_index: jax.Array, kv_index: jax.Array,
                   q_segments: jax.Array, kv_segments: jax.Array, *,
                   window: Optional[int] = None,
                   q_spans: Optional[jax.Array] = None,
                   kv_spans: Optional[jax.Array] = None) -> jax.Array:
  """Which keys each query may see: [B, T, S] bool.

  Args:
    q_index, kv_index: [B, T], [B, S] token indices in the sequence (causality).
    q_segments, kv_segments: [B, T], [B, S] document ids of packed rows; queries
      only see keys of their own document.
    window: if set, a query sees no key `window` or more positions before it.
    q_spans, kv_spans: [B, T], [B, S] span ids; tokens sharing a span id > 0 see
      each other in both directions (e.g. the soft tokens of one image).
  """
  q, k = q_index[:, :, None], kv_index[:, None, :]
  visible = k <= q
  if q_spans is not None:
    visible |= (q_spans[:, :, None] == kv_spans[:, None, :]) & (q_spans[:, :, None] > 0)
  if window is not None:   # also within a span: transformers' AND(window, OR(causal, span))
    visible &= q - k < window
  return visible & (q_segments[:, :, None] == kv_segments[:, None, :])


class LocalBlocks(NamedTuple):
  """A sliding-window layer's mask in blocks of Q queries: [B, C, Q, W + Q], C =
  ceil(T / Q), Q dividing the window W. Block c's queries see at most the W + Q keys
  that end with its own last query."""
  mask: jax.Array


def local_block_size(window: int) -> int:
  """Queries per block of a sliding-window layer: W / 2 (T x 1.5W logits) where W is
  even, else W (T x 2W)."""
  return window // 2 if window % 2 == 0 else window


def _key_spans(x: jax.Array, block: int, window: int, pad_value=0) -> jax.Array:
  """[B, T, ...] -> [B * C, W + Q, ...]: for each block of Q rows, the W rows before it
  and its own (`pad_value` before the first row and after the last)."""
  b, t = x.shape[:2]
  c, r = -(-t // block), window // block
  pad = [(0, 0), (window, c * block - t)] + [(0, 0)] * (x.ndim - 2)
  blocks = jnp.pad(x, pad, constant_values=pad_value).reshape(b, c + r, block, *x.shape[2:])
  spans = jnp.concatenate([blocks[:, i:i + c] for i in range(r + 1)], axis=2)
  return spans.reshape(b * c, window + block, *x.shape[2:])


def local_blocks(segment_ids: jax.Array, window: int,
                 block: Optional[int] = None) -> LocalBlocks:
  """The causal sliding-window mask of packed rows segment_ids [B, T], in blocks of
  `block` queries (default `local_block_size(window)`).

  Padding gets segment id -1, which no token of the row has, so nothing sees it.
  """
  block = block or local_block_size(window)
  if window % block:
    raise ValueError(f"local blocks of {block} queries do not divide the window {window}")
  b, t = segment_ids.shape
  c = -(-t // block)
  index = jnp.broadcast_to(jnp.arange(t), (b, t))
  kv_index, kv_segments = (_key_spans(a, block, window, pad_value=-1)
                           for a in (index, segment_ids))
  q_index, q_segments = kv_index[:, window:], kv_segments[:, window:]
  mask = attention_mask(q_index, kv_index, q_segments, kv_segments, window=window)
  return LocalBlocks(mask.reshape(b, c, block, window + block))


def local_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, blocks: LocalBlocks,
                          logit_softcap: Optional[float] = None,
                          kernel: str = "einsum") -> jax.Array:
  """`dot_product_attention` under a `LocalBlocks` mask: q [B, T, N, H], k, v [B, T, K,
  H] -> [B, T, N, H], computing only the T x (W + Q) logits a window can reach."""
  b, t = q.shape[:2]
  c, block, span = blocks.mask.shape[1:]
  window = span - block
  queries = jnp.pad(q, [(0, 0), (0, c * block - t), (0, 0), (0, 0)])
  out = dot_product_attention(queries.reshape(b * c, block, *q.shape[2:]),
                              _key_spans(k, block, window), _key_spans(v, block, window),
                              blocks.mask.reshape(b * c, block, span), logit_softcap, kernel)
  return out.reshape(b, c * block, *q.shape[2:])[:, :t]


@struct.dataclass
class CausalMask:
  """A causal mask [B, T, T] given with its structure, for the fused kernel: no query
  sees a later key, nor (window set) a key `window` or more positions before it. `mask`
  holds the rest (the documents of packed rows) and agrees with that structure; None
  for rows of one document each, where the structure is the whole mask (cuDNN then
  skips the masked tiles without reading a mask array)."""
  mask: Optional[jax.Array]
  window: Optional[int] = struct.field(pytree_node=False, default=None)


class CausalBlocks(NamedTuple):
  """A causal mask [B, T, T] (no query sees a later key) whose queries go in blocks of
  `causal_block_size(T)`, each attending only to the keys up to its own last query."""
  mask: jax.Array


def causal_block_size(t: int) -> int:
  """Queries per block of a causal layer over T tokens: 8 blocks, of at least 256
  (fewer, smaller blocks measured no faster on a CPU at 512 to 8192 tokens)."""
  return max(256, -(-t // 8))


def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, blocks: CausalBlocks,
                           logit_softcap: Optional[float] = None,
                           kernel: str = "einsum") -> jax.Array:
  """`dot_product_attention` under a `CausalBlocks` mask: q [B, T, N, H], k, v [B, T, K,
  H] -> [B, T, N, H]. Each block's softmax runs over its own key prefix: the keys after
  it are masked anyway, so the result is the dense one, at about half the work."""
  t = q.shape[1]
  size = causal_block_size(t)
  return jnp.concatenate([
      dot_product_attention(q[:, start:start + size], k[:, :start + size],
                            v[:, :start + size], blocks.mask[:, start:start + size,
                                                             :start + size],
                            logit_softcap, kernel)
      for start in range(0, t, size)], axis=1)


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
  """cap * tanh(x / cap), or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def cudnn_head_dim_limit() -> int:
  """The widest head cuDNN's fused attention takes in bfloat16 / float16 on the default
  device (JAX refuses wider ones): 256 from Hopper (compute capability 9.0) on, 128
  before."""
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return 256 if capability and float(capability) >= 9.0 else 128


def cudnn_fused(head_dim: int, dtype) -> bool:
  """Whether cuDNN's fused attention runs heads of `head_dim` in `dtype` on the default
  backend: a GPU, bfloat16 or float16, a multiple of 8 up to `cudnn_head_dim_limit()`."""
  return (jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim <= cudnn_head_dim_limit() and head_dim % 8 == 0)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          mask: Optional[jax.Array], logit_softcap: Optional[float] = None,
                          kernel: str = "einsum", *, causal: bool = False,
                          window: Optional[int] = None) -> jax.Array:
  """q: [B, T, N, H] (already scaled), k, v: [B, S, K, H], mask: [B, T, S] or None ->
  [B, T, N, H]. `causal` (S = T), and a `window` as in `attention_mask`, give the mask's
  structure; with no mask that structure is the whole mask, and with neither every
  query sees every key.

  kernel "einsum": logits and softmax in float32, probabilities cast back to the compute
  dtype (`grouped_attention`). "jax": `jax.nn.dot_product_attention`, no soft cap; with
  no mask or with the structure, cuDNN's fused kernel on a GPU in bfloat16 or float16
  for the head dims it takes (`cudnn_head_dim_limit`; not Gemma 4's 512-wide global
  layers), which then skips the tiles the structure masks; XLA's otherwise (cache
  accesses, wider heads). cuDNN reads a
  mask as a bias, which it takes in training only at even lengths: a causal mask over an
  odd T gains a position that no other query sees (`_attention_at_even_length`).
  """
  if kernel == "jax":
    chex.assert_equal(logit_softcap, None)
    if causal and q.shape[1] % 2:
      return _attention_at_even_length(q, k, v, mask, window)
    cudnn = (causal or mask is None) and cudnn_fused(q.shape[-1], q.dtype)
    return jax.nn.dot_product_attention(
        q, k, v, mask=None if mask is None else mask[:, None], scale=1.0, is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn" if cudnn else None)
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  if causal and mask is None:      # a `CausalMask` with its structure alone
    index = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = attention_mask(index, index, jnp.ones_like(index), jnp.ones_like(index),
                          window=window)
  # Heads lead (small copies of queries, keys and values), so that every matmul of the
  # forward and backward pass reads the [B, K, G, T, S] logits in the order they are
  # stored: contracted as [B, T, K, G, H], XLA transposed the logits and probabilities
  # instead, at three times the cost on a CPU.
  q = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  out = grouped_attention(q, k, v, None if mask is None else mask[:, None, None],
                          logit_softcap)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _attention_at_even_length(q, k, v, mask, window):
  """The "jax" kernel under a causal mask array over an odd T (= S), one position
  appended: cuDNN's fused kernel takes a mask (as a bias) in training only at even
  lengths. The appended query sees only the appended key, which no other query sees."""
  t = q.shape[1]
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)) + ((0, 0),) * (x.ndim - 2))
  if mask is not None:
    mask = jnp.pad(mask, ((0, 0), (0, 1), (0, 1))).at[:, t, t].set(True)
  return dot_product_attention(pad(q), pad(k), pad(v), mask, kernel="jax", causal=True,
                               window=window)[:, :t]


# Half float32's lowest: a logit added to it stays finite (adding finfo.min itself
# overflows to -inf from logits of about -1e31), and exp(it - row maximum) is 0.
_MASKED_LOGIT = float(jnp.finfo(jnp.float32).min) / 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Optional[jax.Array],
                      logit_softcap: Optional[float]) -> jax.Array:
  """softmax(q k^T) v per key/value head: q [B, K, G, T, H], k, v [B, K, S, H], mask
  broadcasting to [B, K, G, T, S] or None -> [B, K, G, T, H].

  Its gradient is written out so that the two that contract over the T x S logits'
  leading dims (dk, dv) take the small [H, G x T] operand transposed, never the
  logits: automatic differentiation gave XLA's CPU backend a transposed copy of the
  [B, K, G, T, S] cotangent to make.
  """
  return _attention_forward(q, k, v, mask, logit_softcap)[0]


def _attention_forward(q, k, v, mask, logit_softcap):
  logits = softcap(jnp.einsum("bkgth,bksh->bkgts", q, k, preferred_element_type=jnp.float32),
                   logit_softcap)
  if mask is not None:
    # An additive bias rather than a select: XLA's CPU backend fuses the add into the
    # logits' product, where a select was a pass of its own over the [T, S] logits. A
    # masked logit becomes exactly the bias, so fully masked rows stay uniform, as with a
    # select.
    logits = logits + jnp.where(mask, 0.0, _MASKED_LOGIT)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgts,bksh->bkgth", probs.astype(v.dtype), v)
  return out, (q, k, v, mask, probs, out)


def _attention_backward(logit_softcap, residuals, d_out):
  q, k, v, mask, probs, out = residuals
  d_probs = jnp.einsum("bkgth,bksh->bkgts", d_out, v, preferred_element_type=jnp.float32)
  d_v = jnp.einsum("bkgth,bkgts->bkhs", d_out, probs.astype(v.dtype)).swapaxes(2, 3)
  row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  d_logits = probs * (d_probs - row)      # softmax backward; zero where masked
  if logit_softcap is not None:
    capped = softcap(jnp.einsum("bkgth,bksh->bkgts", q, k,
                                preferred_element_type=jnp.float32), logit_softcap)
    d_logits = d_logits * (1 - jnp.square(capped / logit_softcap))
  d_logits = d_logits.astype(q.dtype)
  d_q = jnp.einsum("bkgts,bksh->bkgth", d_logits, k)
  d_k = jnp.einsum("bkgth,bkgts->bkhs", q, d_logits).swapaxes(2, 3)
  return d_q, d_k, d_v.astype(v.dtype), None


grouped_attention.defvjp(_attention_forward, _attention_backward)


class Attention(nn.Module):
  """Self-attention with optional per-head RMSNorm on queries, keys and values, and RoPE.

  Attributes:
    num_heads, num_kv_heads, head_dim: N, K, H.
    query_scale: multiplies the queries (query_pre_attn_scalar ** -0.5 for Gemma).
    use_rope: rotate queries and keys by position (RoPE); False: no positions here.
    rope_base, rope_scale, rope_fraction: see `rope.apply_rope`.
    use_qk_norm: RMSNorm over H on queries and keys.
    use_value_norm: RMSNorm without scale over H on values.
    k_eq_v: no value projection; the values are the key projection (before the key
      norm and RoPE).
    norm_plus_one: the query/key norms' form, see `norms.RMSNorm.plus_one`.
    logit_softcap: tanh cap on attention logits, or None.
    fused_qkv: one [D, 3, N, H] projection "qkv" for queries, keys and values (K = N).
    use_bias: biases on the query, key, value and output projections.
    kernel: "einsum" or "jax", see `dot_product_attention`.
    return_kv: also return the keys and values attended over (with a cache, the ring
      after the write), for later layers to attend over (`given_kv` of their call).
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  query_scale: float
  use_rope: bool = True
  rope_base: float = 10_000.0
  rope_scale: float = 1.0
  rope_fraction: float = 1.0
  use_qk_norm: bool = True
  use_value_norm: bool = False
  k_eq_v: bool = False
  norm_plus_one: bool = True
  logit_softcap: Optional[float] = None
  fused_qkv: bool = False
  use_bias: bool = False
  norm_eps: float = 1e-6
  kernel: str = "einsum"
  return_kv: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, positions: Optional[jax.Array],
               mask: Union[None, jax.Array, LocalBlocks, CausalBlocks, CausalMask,
                           cache_access.Prefill, cache_access.Decode, cache_access.Extend,
                           cache_access.Paged],
               given_kv: Optional[Tuple[jax.Array, jax.Array]] = None):
    """x: [B, T, D], positions: [B, T] (may be None without RoPE), mask: [B, T, S=T],
    `LocalBlocks`, `CausalBlocks`, `CausalMask`, a cache access, or None (every token
    sees every token) -> [B, T, D]; with `return_kv`, (that, (keys, values)
    [B, S, K, H]). given_kv: another layer's keys and values under the same mask, attended
    over instead of this layer's own: it then has no key or value projections and no
    cache."""
    b, t, d = x.shape
    n, kv, h = self.num_heads, self.num_kv_heads, self.head_dim
    if self.use_rope or positions is not None:
      chex.assert_shape(positions, (b, t))
    own = mask.mask if isinstance(mask, cache_access.Prefill) else mask   # over its own keys
    own = own.mask if isinstance(own, (CausalMask, CausalBlocks)) else own
    if isinstance(own, jax.Array):
      chex.assert_shape(own, (b, t, t))
    dense = lambda shape, axes, name, in_dims=1: Linear(
        shape, axes, in_dims=in_dims, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, name=name)
    if given_kv is not None:
      q = checkpoint_name(dense((n, h), ("embed", "heads", "head_dim"), "q")(x), "query_proj")
      return self._attend_and_project(self._queries(q, positions), *given_kv, mask, d)
    if self.fused_qkv:
      chex.assert_equal(kv, n)
      qkv = dense((3, n, h), ("embed", "qkv", "heads", "head_dim"), "qkv")(x)  # [B, T, 3, N, H]
      q, k, v = (checkpoint_name(qkv[:, :, i], name)
                 for i, name in enumerate(("query_proj", "key_proj", "value_proj")))
    else:
      q = checkpoint_name(dense((n, h), ("embed", "heads", "head_dim"), "q")(x), "query_proj")
      k = checkpoint_name(dense((kv, h), ("embed", "kv_heads", "head_dim"), "k")(x), "key_proj")
      v = k if self.k_eq_v else checkpoint_name(
          dense((kv, h), ("embed", "kv_heads", "head_dim"), "v")(x), "value_proj")
    if self.use_qk_norm:
      k = self._norm("k_norm")(k)
    if self.use_value_norm:
      v = self._norm("v_norm", with_scale=False)(v)
    if self.use_rope:
      k = self._rope(k, positions)
    q = self._queries(q, positions)
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))
    k, v = cache_access.keys_values(self, k, v, mask)
    out = self._attend_and_project(q, k, v, mask, d)
    return (out, (k, v)) if self.return_kv else out

  def _norm(self, name: str, with_scale: bool = True) -> RMSNorm:
    return RMSNorm(self.norm_eps, with_scale=with_scale, plus_one=self.norm_plus_one,
                   axis_name="head_dim", param_dtype=self.param_dtype, name=name)

  def _rope(self, y: jax.Array, positions: jax.Array) -> jax.Array:
    return apply_rope(y, positions, base=self.rope_base, scale=self.rope_scale,
                      fraction=self.rope_fraction)

  def _queries(self, q: jax.Array, positions: Optional[jax.Array]) -> jax.Array:
    """Projected queries [B, T, N, H] normed, rotated and scaled."""
    if self.use_qk_norm:
      q = self._norm("q_norm")(q)
    if self.use_rope:
      q = self._rope(q, positions)
    q = q * jnp.asarray(self.query_scale, self.dtype)
    return nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))

  def _attend_and_project(self, q, k, v, mask, d: int) -> jax.Array:
    """Queries [B, T, N, H] over keys and values [B, S, K, H] under `mask` (a cache
    access's own mask), then the output projection -> [B, T, D]."""
    mask = cache_access.own_mask(mask)
    if isinstance(mask, LocalBlocks):
      out = local_block_attention(q, k, v, mask, self.logit_softcap, self.kernel)
    elif isinstance(mask, CausalBlocks):
      out = causal_block_attention(q, k, v, mask, self.logit_softcap, self.kernel)
    elif isinstance(mask, CausalMask):
      out = dot_product_attention(q, k, v, mask.mask, self.logit_softcap, self.kernel,
                                  causal=True, window=mask.window)
    else:
      out = dot_product_attention(q, k, v, mask, self.logit_softcap, self.kernel)
    out = Linear((d,), ("heads", "head_dim", "embed"), in_dims=2, use_bias=self.use_bias,
                 dtype=self.dtype, param_dtype=self.param_dtype, name="out")(out)
    return checkpoint_name(out, "out_proj")
