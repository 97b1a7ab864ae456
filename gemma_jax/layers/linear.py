"""A projection with named kernel axes: contracts x's trailing dims with a kernel."""

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.matmul import matmul


def float_param(module: nn.Module, name: str, init, shape, dtype) -> jax.Array:
  """module.param(name, init, shape, dtype) for a float weight. A stored one (quant's
  int8_weights or int4_weights, which only their model.quant reads, with their scales;
  int4 packs two a byte, so its shape differs too) is one ValueError naming it."""
  if module.has_variable("params", name):
    stored = nn.meta.unbox(module.get_variable("params", name))
    if not jnp.issubdtype(stored.dtype, jnp.floating):
      raise ValueError(f"{'/'.join(module.scope.path + (name,))} holds {stored.dtype} "
                       "weights, which run only under the model.quant they were stored "
                       "for (int8_weights or int4_weights)")
  return module.param(name, init, shape, dtype)


class Linear(nn.Module):
  """y = x . kernel (+ bias), the kernel shaped in_shape + out_shape.

  Attributes:
    out_shape: trailing output dims, e.g. (N, H) for a query projection.
    axes: logical names of the kernel's dims (input dims first), e.g.
      ("embed", "heads", "head_dim").
    in_dims: how many trailing dims of x are contracted (2 for [.., N, H] -> D).
    use_bias: add a bias over the output dims.
  """
  # The methods a method interceptor may replace (gemma_jax.quant.projections): their
  # names and signatures are part of this class's interface.
  HOOKS = ("kernel", "product")
  out_shape: Sequence[int]
  axes: Sequence[str]
  in_dims: int = 1
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., *in_shape] -> [..., *out_shape]."""
    in_shape = x.shape[x.ndim - self.in_dims:]
    out_shape = tuple(self.out_shape)
    kernel = self.kernel(in_shape)
    # One [rows, in] x [in, out] matmul: its gradients are plain matmuls too, where a
    # contraction over several leading dims makes XLA's CPU backend run at half speed.
    rows = x.shape[:x.ndim - self.in_dims]
    y = self.product(x.reshape(math.prod(rows), math.prod(in_shape)).astype(self.dtype),
                     kernel.reshape(math.prod(in_shape), math.prod(out_shape)).astype(self.dtype))
    if self.use_bias:   # added to the [rows, out] view: see `norms.scale_features`
      bias = self.param("bias", nn.with_logical_partitioning(
          nn.initializers.zeros_init(), tuple(self.axes[self.in_dims:])), out_shape,
                        self.param_dtype)
      y = y + bias.astype(self.dtype).reshape(-1)
    return y.reshape(rows + out_shape)

  def kernel(self, in_shape: Sequence[int]) -> jax.Array:
    """The kernel [*in_shape, *out_shape] (a hook: quantization stores it otherwise)."""
    rank = self.in_dims + len(self.out_shape)
    init = nn.initializers.variance_scaling(
        1.0, "fan_in", "normal",
        in_axis=tuple(range(self.in_dims)), out_axis=tuple(range(self.in_dims, rank)))
    return float_param(self, "kernel", nn.with_logical_partitioning(init, tuple(self.axes)),
                       tuple(in_shape) + tuple(self.out_shape), self.param_dtype)

  def product(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [R, I] @ kernel [I, O] (a hook: int8 training quantizes both)."""
    return matmul(x, kernel)
