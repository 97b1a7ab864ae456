"""The MLPs: gated, down(act(gate(x)) * up(x)) (Gemma), and plain, down(act(up(x))) (GPT-3)."""

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from gemma_jax.layers.linear import Linear

# Every name of config.ACTIVATIONS (the schema's) -> its function.
ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def gated_activation(activation: str, gate: jax.Array, up: jax.Array) -> jax.Array:
  """act(gate) * up, both [..., F] -> [..., F].

  Its gradient recomputes act(gate) from gate rather than keeping act's intermediates:
  left to itself, XLA on a GPU writes one of them as a second [..., F] output of the
  forward and reads it back in the backward, the MLP's widest tensor moved twice more
  per layer and kept alive in between. The backward already reads gate and up, so the
  recomputation costs no traffic.
  """
  return jax.checkpoint(lambda g, u: ACTIVATIONS[activation](g) * u)(gate, up)


class GatedMlp(nn.Module):
  """[B, T, D] -> [B, T, D] through a gated hidden layer of width F."""
  mlp_dim: int
  activation: str = "gelu_tanh"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda shape, axes, name: Linear(shape, axes, dtype=self.dtype,
                                             param_dtype=self.param_dtype, name=name)
    gate = checkpoint_name(dense((self.mlp_dim,), ("embed", "mlp"), "gate")(x), "mlpwi_0")
    up = checkpoint_name(dense((self.mlp_dim,), ("embed", "mlp"), "up")(x), "mlpwi_1")
    hidden = nn.with_logical_constraint(gated_activation(self.activation, gate, up),
                                        ("batch", "length", "mlp"))
    out = dense((x.shape[-1],), ("mlp", "embed"), "down")(hidden)
    return checkpoint_name(out, "mlpwo")


class Mlp(nn.Module):
  """[B, T, D] -> [B, T, D] through one hidden layer of width F, biases optional."""
  mlp_dim: int
  activation: str = "gelu_tanh"
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dense = lambda shape, axes, name: Linear(shape, axes, use_bias=self.use_bias,
                                             dtype=self.dtype, param_dtype=self.param_dtype,
                                             name=name)
    hidden = checkpoint_name(dense((self.mlp_dim,), ("embed", "mlp"), "up")(x), "mlpwi_0")
    hidden = nn.with_logical_constraint(ACTIVATIONS[self.activation](hidden),
                                        ("batch", "length", "mlp"))
    return checkpoint_name(dense((x.shape[-1],), ("mlp", "embed"), "down")(hidden), "mlpwo")
