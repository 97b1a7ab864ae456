"""RMSNorm in Gemma's two forms: x / rms(x) * (1 + scale) with scale stored
zero-initialised (Gemma 3), or x / rms(x) * scale with scale ones-initialised (Gemma 4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
  """Normalises the last axis in float32 and casts back to the input dtype.

  Attributes:
    eps: added to the mean square before the reciprocal square root.
    with_scale: learn a per-feature `scale`; without it the norm is parameter-free.
    plus_one: apply the scale as (1 + scale), zero-initialised; else as scale,
      initialised to ones.
    axis_name: logical axis name of the normalised features.
    param_dtype: storage dtype of `scale`.
  """
  eps: float = 1e-6
  with_scale: bool = True
  plus_one: bool = True
  axis_name: str = "norm"
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., D]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    if self.with_scale:
      init = nn.initializers.zeros_init() if self.plus_one else nn.initializers.ones_init()
      scale = self.param("scale", nn.with_logical_partitioning(init, (self.axis_name,)),
                         (x.shape[-1],), self.param_dtype).astype(jnp.float32)
      y = y * (1.0 + scale if self.plus_one else scale)
    return y.astype(x.dtype)
