"""RMSNorm in Gemma's two forms: x / rms(x) * (1 + scale) with scale stored
zero-initialised (Gemma 3), or x / rms(x) * scale with scale ones-initialised (Gemma 4)."""

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.extend.backend
import jax.numpy as jnp

from gemma_jax.layers import rms_norm_gradient

GRADIENT_KERNEL = True   # on a single CUDA GPU, RMSNorm's gradient as one Pallas kernel

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
    weight = None
    if self.with_scale:
      init = nn.initializers.zeros_init() if self.plus_one else nn.initializers.ones_init()
      scale = self.param("scale", nn.with_logical_partitioning(init, (self.axis_name,)),
                         (x.shape[-1],), self.param_dtype).astype(jnp.float32)
      weight = 1.0 + scale if self.plus_one else scale
    if uses_gradient_kernel(x.shape[-1]):
      return rms_norm(x, jnp.ones(x.shape[-1], jnp.float32) if weight is None else weight,
                      self.eps)
    y = normalise(x, self.eps)
    return (y if weight is None else scale_features(y, weight)).astype(x.dtype)


def uses_gradient_kernel(width: int) -> bool:
  """Whether RMSNorm's gradient over `width` features is `rms_norm_gradient`'s kernel:
  on a single CUDA GPU, the default backend (XLA cannot partition a Pallas call, so
  across several devices XLA's gradient stays rather than the kernel see gathered rows;
  the kernel was measured on NVIDIA cards only), for widths that are multiples of 16
  (the kernel's pieces of a row then load at least 16 elements; every Gemma width is)."""
  return (GRADIENT_KERNEL and "cuda" in jax.extend.backend.get_backend().platform_version
          and jax.device_count() == 1 and width % 16 == 0)


def normalise(x: jax.Array, eps: float) -> jax.Array:
  """x [..., D] -> x / rms(x) [..., D], float32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x [..., D] / rms(x) * weight [D] (float32) -> [..., D] in x's dtype: XLA's forward
  pass, `rms_norm_gradient.backward`'s gradient."""
  return scale_features(normalise(x, eps), weight).astype(x.dtype)


def _rms_norm_fwd(x, weight, eps):
  return rms_norm(x, weight, eps), (x, weight)


def _rms_norm_bwd(eps, residuals, dy):
  x, weight = residuals
  width = x.shape[-1]
  dx, dw = rms_norm_gradient.backward(x.reshape(-1, width), weight,
                                      dy.reshape(-1, width), eps)
  return dx.reshape(x.shape), dw


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def scale_features(y: jax.Array, scale: jax.Array, bias: Optional[jax.Array] = None
                   ) -> jax.Array:
  """y [..., D] * scale [D] (+ bias [D]), broadcast over a [N, D] view of y so that
  the parameters' gradients reduce over one leading axis: reduced over [1, T, D] (a
  batch of one row), XLA's CPU backend took thirty times as long as over [T, D]."""
  flat = y.reshape(-1, y.shape[-1]) * scale
  return (flat if bias is None else flat + bias).reshape(y.shape)
