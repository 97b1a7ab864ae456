"""Gemma 4's per-layer inputs (PLE): besides the residual stream, every layer reads a
P-wide input of its own per token.

Dims: B batch, T length, D model width, L layers, P per-layer width, V' table rows.

    table [V', L x P] at each token, x sqrt(P)                     (the token's identity)
    embedded input [B, T, D] @ [D, L, P] / sqrt(D), RMSNorm over P  (its context)
    -> (identity + context) / sqrt(2): [B, T, L, P]

Layer i then adds norm(act(x @ gate [D, P]) * inputs[:, :, i] @ [P, D]) to its output
(`models.gemma4.Gemma4Layer`). Parameters (the decoder's `per_layer_inputs`):
embed/embedding [V', L x P], proj/kernel [D, L, P], norm/scale [P].
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.embed import Embed
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.norms import RMSNorm

AXES = ("batch", "length", "layers", None)


class PerLayerInputs(nn.Module):
  """(tokens [B, T], the embedded input x [B, T, D]) -> per-layer inputs [B, T, L, P].

  Attributes:
    num_layers, width, vocab_size: L, P, V'.
    norm_eps, norm_plus_one: the RMSNorm over P.
  """
  num_layers: int
  width: int
  vocab_size: int
  norm_eps: float = 1e-6
  norm_plus_one: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
    layers, width = self.num_layers, self.width
    identity = Embed(self.vocab_size, layers * width, scale_dim=width, dtype=self.dtype,
                     param_dtype=self.param_dtype, name="embed").encode(tokens)
    identity = identity.reshape(*tokens.shape, layers, width)
    context = Linear((layers, width), ("embed", "layers", None), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="proj")(x)
    context = context * jnp.asarray(x.shape[-1] ** -0.5, self.dtype)
    context = RMSNorm(self.norm_eps, plus_one=self.norm_plus_one, param_dtype=self.param_dtype,
                      name="norm")(context)
    inputs = (context + identity) * jnp.asarray(math.sqrt(0.5), self.dtype)
    return nn.with_logical_constraint(inputs, AXES)
