"""Token embedding, used both ways: ids -> vectors, and vectors -> logits (tied)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


class Embed(nn.Module):
  """A [V, D] table; `encode` scales by sqrt(D) as Gemma does.

  The scale is rounded to the compute dtype first, as the published models were
  trained with it (sqrt(3072) = 55.43 becomes 55.5 in bfloat16).
  """
  vocab_size: int
  d_model: int
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
    return x * jnp.asarray(math.sqrt(self.d_model), self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x: [B, T, D] -> logits [B, T, V] in the compute dtype."""
    return jnp.einsum("btd,vd->btv", x, self.embedding.astype(self.dtype))
