"""Embeddings: a table used both ways (ids -> vectors, vectors -> logits when tied), and
the untrainable sinusoidal embedding of positions."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.matmul import matmul_transposed


def sinusoidal(positions: jax.Array, dim: int, max_wavelength: float = 10_000.0) -> jax.Array:
  """positions [B, T] -> [B, T, dim] float32: [sin(p w_i), cos(p w_i)] for i < dim/2,
  the w_i geometric from 1 down to 1/max_wavelength (tensor2tensor's timing signal)."""
  half = dim // 2
  rates = jnp.exp(-math.log(max_wavelength) * jnp.arange(half, dtype=jnp.float32)
                  / max(half - 1, 1))
  angles = positions[..., None].astype(jnp.float32) * rates
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Embed(nn.Module):
  """A [V, D] table; `encode` scales by sqrt(D) as Gemma does, unless `scale_by_sqrt_dim`
  is False (GPT; position tables).

  The scale is rounded to the compute dtype first, as the published models were
  trained with it (sqrt(3072) = 55.43 becomes 55.5 in bfloat16).
  """
  vocab_size: int
  d_model: int
  scale_by_sqrt_dim: bool = True
  scale_dim: int = 0        # encode scales by sqrt(scale_dim) instead (a packed table)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(
            nn.initializers.normal(stddev=self.d_model ** -0.5), ("vocab", "embed")),
        (self.vocab_size, self.d_model), self.param_dtype)

  def encode(self, tokens: jax.Array) -> jax.Array:
    """tokens: [B, T] int -> [B, T, D]."""
    x = jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)
    if not self.scale_by_sqrt_dim:
      return x
    return x * jnp.asarray(math.sqrt(self.scale_dim or self.d_model), self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x: [B, T, D] -> logits [B, T, V] in the compute dtype (one [B*T, D] x [D, V]
    matmul, whose gradients are plain matmuls too, see `matmul.matmul_transposed`)."""
    rows = x.reshape(-1, x.shape[-1])
    logits = matmul_transposed(rows, self.embedding.astype(self.dtype))
    return logits.reshape(*x.shape[:-1], self.vocab_size)
