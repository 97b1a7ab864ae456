"""The Gemma 4 decoder layer: Gemma 3's layer with two differences.

Its attention options (global key/value heads and head dim, keys as values, the value
norm, partial RoPE, query scale 1) are the config's, read by `Gemma3Layer`. What this
layer adds: the feed-forward is a `MoeBlock` (a shared MLP beside routed experts) when
the config has experts, and the layer's output is scaled by a learned scalar.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.moe import MoeBlock
from gemma_jax.models.gemma3 import Gemma3Layer


class Gemma4Layer(Gemma3Layer):
  """layer_scalar * Gemma3Layer(x), whose feed-forward may be a mixture of experts."""

  def feed_forward(self, x: jax.Array) -> jax.Array:
    c = self.config
    if not c.num_experts:
      return super().feed_forward(x)
    return MoeBlock(
        mlp_dim=c.mlp_dim, num_experts=c.num_experts, experts_per_token=c.experts_per_token,
        expert_mlp_dim=c.expert_mlp_dim, activation=c.activation, dispatch=c.moe_dispatch,
        load_balance_loss_weight=c.load_balance_loss_weight,
        router_z_loss_weight=c.router_z_loss_weight, norm_eps=c.norm_eps,
        norm_plus_one=c.norm_plus_one, dtype=jnp.dtype(c.dtype),
        param_dtype=jnp.dtype(c.param_dtype), name="moe")(x)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict) -> jax.Array:
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]} -> [B, T, D]."""
    x = super().__call__(x, positions, masks)
    scalar = self.param("layer_scalar", nn.with_logical_partitioning(
        nn.initializers.ones_init(), (None,)), (1,), jnp.dtype(self.config.param_dtype))
    return x * scalar.astype(x.dtype)
