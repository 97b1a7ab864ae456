"""RMSNorm in Gemma's two forms: x / rms(x) * (1 + scale) with scale stored
zero-initialised (Gemma 3), or x / rms(x) * scale with scale ones-initialised (Gemma 4)."""

from typing import Optional

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
      y = scale_features(y, 1.0 + scale if self.plus_one else scale)
    return y.astype(x.dtype)


def scale_features(y: jax.Array, scale: jax.Array, bias: Optional[jax.Array] = None
                   ) -> jax.Array:
  """y [..., D] * scale [D] (+ bias [D]), broadcast over a [N, D] view of y so that
  the parameters' gradients reduce over one leading axis: reduced over [1, T, D] (a
  batch of one row), XLA's CPU backend took ~30 ms at T=8192, D=512 against under
  1 ms over [T, D]."""
  flat = y.reshape(-1, y.shape[-1]) * scale
  return (flat if bias is None else flat + bias).reshape(y.shape)
