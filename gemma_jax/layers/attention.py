"""Multi-head attention (MHA, GQA, MQA) and the masks it is used with.

Dims: B batch, T query length, S key length, D model width, N query heads,
K key/value heads, G = N / K queries per key head, H head dim.
"""

from typing import Optional

import chex
import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

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
    window: if set, a query sees only the `window` most recent keys (itself included).
    q_spans, kv_spans: [B, T], [B, S] span ids; tokens sharing a span id > 0 see
      each other in both directions (e.g. the soft tokens of one image).
  """
  q, k = q_index[:, :, None], kv_index[:, None, :]
  visible = k <= q
  if window is not None:
    visible &= q - k < window
  if q_spans is not None:
    visible |= (q_spans[:, :, None] == kv_spans[:, None, :]) & (q_spans[:, :, None] > 0)
  return visible & (q_segments[:, :, None] == kv_segments[:, None, :])


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
  """cap * tanh(x / cap), or x when cap is None."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                          logit_softcap: Optional[float] = None) -> jax.Array:
  """q: [B, T, N, H] (already scaled), k, v: [B, S, K, H], mask: [B, T, S] -> [B, T, N, H].

  Logits and softmax in float32; probabilities cast back to the compute dtype.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
  logits = softcap(logits, logit_softcap)
  logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
  return out.reshape(b, t, n, h)


class Attention(nn.Module):
  """Self-attention with optional per-head RMSNorm on queries and keys and RoPE.

  Attributes:
    num_heads, num_kv_heads, head_dim: N, K, H.
    query_scale: multiplies the queries (query_pre_attn_scalar ** -0.5 for Gemma).
    rope_base, rope_scale, rope_fraction: see `rope.apply_rope`.
    use_qk_norm: RMSNorm (1 + scale) over H on queries and keys.
    logit_softcap: tanh cap on attention logits, or None.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  query_scale: float
  rope_base: float
  rope_scale: float = 1.0
  rope_fraction: float = 1.0
  use_qk_norm: bool = True
  logit_softcap: Optional[float] = None
  norm_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    """x: [B, T, D], positions: [B, T], mask: [B, T, S=T] -> [B, T, D]."""
    b, t, d = x.shape
    n, kv, h = self.num_heads, self.num_kv_heads, self.head_dim
    chex.assert_shape(positions, (b, t))
    chex.assert_shape(mask, (b, t, t))
    dense = lambda shape, axes, name, in_dims=1: Linear(
        shape, axes, in_dims=in_dims, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    q = dense((n, h), ("embed", "heads", "head_dim"), "q")(x)
    k = dense((kv, h), ("embed", "kv_heads", "head_dim"), "k")(x)
    v = dense((kv, h), ("embed", "kv_heads", "head_dim"), "v")(x)
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(k, "key_proj")
    v = checkpoint_name(v, "value_proj")
    if self.use_qk_norm:
      norm = lambda name: RMSNorm(self.norm_eps, axis_name="head_dim",
                                  param_dtype=self.param_dtype, name=name)
      q, k = norm("q_norm")(q), norm("k_norm")(k)
    rope = lambda y: apply_rope(y, positions, base=self.rope_base, scale=self.rope_scale,
                                fraction=self.rope_fraction)
    q = rope(q) * jnp.asarray(self.query_scale, self.dtype)
    k = rope(k)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))
    out = dot_product_attention(q, k, v, mask, self.logit_softcap)
    out = dense((d,), ("heads", "head_dim", "embed"), "out", in_dims=2)(out)
    return checkpoint_name(out, "out_proj")
