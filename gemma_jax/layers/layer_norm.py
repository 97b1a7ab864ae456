"""LayerNorm in GPT-3's form: (x - mean) / std * (1 + scale) + bias, scale stored
zero-initialised (so a fresh norm is the identity affine map)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.norms import scale_features


class LayerNorm(nn.Module):
  """Normalises the last axis and casts back to the input dtype.

  Attributes:
    eps: added to the variance before the reciprocal square root.
    reductions_in_float32: mean and variance in float32; else in the input dtype.
    axis_name: logical axis name of the normalised features.
    param_dtype: storage dtype of `scale` and `bias`.
  """
  eps: float = 1e-5
  reductions_in_float32: bool = True
  axis_name: str = "norm"
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., D]."""
    y = x.astype(jnp.float32) if self.reductions_in_float32 else x
    mean = jnp.mean(y, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(variance + self.eps)
    param = lambda name: self.param(
        name, nn.with_logical_partitioning(nn.initializers.zeros_init(), (self.axis_name,)),
        (x.shape[-1],), self.param_dtype).astype(y.dtype)
    return scale_features(y, 1 + param("scale"), param("bias")).astype(x.dtype)
