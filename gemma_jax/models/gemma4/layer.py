"""The Gemma 4 decoder layer: Gemma 3's layer with what Gemma 4 adds.

Its attention options (global key/value heads and head dim, keys as values, the value
norm, partial RoPE, query scale 1) are the config's, read by `Gemma3Layer`. What this
layer adds: the feed-forward is a `MoeBlock` (a shared MLP beside routed experts) when
the config has experts; the small models' per-layer input (`per_layer_input_dim`, see
`models.gemma4.per_layer_inputs`) and shared keys and values (`num_kv_shared_layers`: a
"reuse" layer attends over a "store" layer's, and with `double_wide_mlp` its MLP is
twice as wide); and the layer's output is scaled by a learned scalar.
"""

from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers.linear import Linear
from gemma_jax.layers.mlp import gated_activation
from gemma_jax.layers.moe import MoeBlock
from gemma_jax.models.gemma3.layer import Gemma3Layer
from gemma_jax.models.layer import ACTIVATION_AXES, layer_output


class Gemma4Layer(Gemma3Layer):
  """layer_scalar * (Gemma3Layer(x) + its per-layer input branch), whose feed-forward may
  be a mixture of experts and whose attention may share keys and values.

  Attributes:
    kv_sharing: None, "store" (return the keys and values attended over too) or "reuse"
      (attend over `shared_kv`), see `models.gemma4.plan`.
  """
  kv_sharing: Optional[str] = None

  def attention(self, **options):
    return super().attention(return_kv=self.kv_sharing == "store", **options)

  def mlp_dim(self) -> int:
    c = self.config
    return c.mlp_dim * (2 if c.double_wide_mlp and self.kv_sharing == "reuse" else 1)

  def feed_forward(self, x: jax.Array) -> jax.Array:
    c = self.config
    if not c.num_experts:
      return super().feed_forward(x)
    return MoeBlock(
        mlp_dim=self.mlp_dim(), num_experts=c.num_experts,
        experts_per_token=c.experts_per_token, expert_mlp_dim=c.expert_mlp_dim,
        activation=c.activation, dispatch=c.moe_dispatch,
        load_balance_loss_weight=c.load_balance_loss_weight,
        router_z_loss_weight=c.router_z_loss_weight, norm_eps=c.norm_eps,
        norm_plus_one=c.norm_plus_one, dtype=jnp.dtype(c.dtype),
        param_dtype=jnp.dtype(c.param_dtype), name="moe")(x)

  def per_layer_residual(self, x: jax.Array, per_layer_input: jax.Array) -> jax.Array:
    """x [B, T, D] plus norm(act(x @ gate) * per_layer_input [B, T, P] @ proj)."""
    c = self.config
    dense = lambda shape, axes, name: Linear(shape, axes, dtype=jnp.dtype(c.dtype),
                                             param_dtype=jnp.dtype(c.param_dtype), name=name)
    gate = dense((c.per_layer_input_dim,), ("embed", None), "per_layer_gate")(x)
    y = gated_activation(c.activation, gate, per_layer_input.astype(gate.dtype))
    y = dense((c.d_model,), (None, "embed"), "per_layer_proj")(y)
    return x + self.norm("post_per_layer_norm")(y)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict,
               per_layer_input: Optional[jax.Array] = None,
               shared_kv: Optional[Tuple[jax.Array, jax.Array]] = None):
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]},
    per_layer_input: [B, T, P] (with `per_layer_input_dim`), shared_kv: a "store"
    layer's keys and values (kv_sharing "reuse") -> [B, T, D]; with kv_sharing "store",
    (that, (keys, values))."""
    if (self.kv_sharing == "reuse") != (shared_kv is not None):
      raise ValueError(f"a Gemma 4 layer with kv_sharing={self.kv_sharing!r} takes shared_kv "
                       f"only when it reuses them (kv_sharing 'reuse')")
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    attended = self.attention()(self.norm("pre_attn_norm")(x), positions,
                                masks[self.attention_type], shared_kv)
    attended, kv = attended if self.kv_sharing == "store" else (attended, None)
    x = self.feed_forward_residual(self.attention_residual(x, attended))
    if self.config.per_layer_input_dim:
      x = self.per_layer_residual(x, per_layer_input)
    x = layer_output(self, x)
    scalar = self.param("layer_scalar", nn.with_logical_partitioning(
        nn.initializers.ones_init(), (None,)), (1,), jnp.dtype(self.config.param_dtype))
    x = x * scalar.astype(x.dtype)
    return (x, kv) if self.kv_sharing == "store" else x
