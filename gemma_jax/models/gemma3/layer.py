"""The Gemma 3 decoder layer: sandwich-normed attention and gated MLP.

Its attention options come from the config, per attention type: key/value heads and
head dim on global layers, keys reused as values, a value norm, RoPE base, scale and
rotated fraction. `attention` and `feed_forward` are the hooks Gemma 4 overrides (its
shared keys and values, its experts).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.config import attention_shape
from gemma_jax.layers.attention import Attention
from gemma_jax.layers.mlp import GatedMlp
from gemma_jax.layers.norms import RMSNorm
from gemma_jax.layers.row_chunks import apply_in_row_chunks
from gemma_jax.models.layer import ACTIVATION_AXES, DecoderLayer, layer_output

class Gemma3Layer(DecoderLayer):
  """x + post_norm(attn(pre_norm(x))), then x + post_norm(feed_forward(x))."""

  @staticmethod
  def make_norm(config: config_dict.ConfigDict, name: str) -> nn.Module:
    """The family's norm over D (the decoder's final norm too): RMSNorm."""
    return RMSNorm(config.norm_eps, plus_one=config.norm_plus_one,
                   param_dtype=jnp.dtype(config.param_dtype), name=name)

  def norm(self, name: str) -> nn.Module:
    """The family's norm over D, named `name`."""
    return self.make_norm(self.config, name)

  def attention(self, **options) -> Attention:
    """The attention of this layer's type (`options`: more `Attention` fields)."""
    c = self.config
    is_global = self.attention_type == "global"
    kind = self.attention_type
    kv_heads, head_dim = attention_shape(c, kind)
    return Attention(
        num_heads=c.num_heads, num_kv_heads=kv_heads, head_dim=head_dim, query_scale=(c.query_pre_attn_scalar or head_dim) ** -0.5,
        rope_base=c[f"rope_{kind}_base"], rope_scale=c[f"rope_{kind}_scale"],
        rope_fraction=c[f"rope_{kind}_fraction"], use_qk_norm=c.use_qk_norm,
        use_value_norm=c.use_value_norm, k_eq_v=is_global and c.global_k_eq_v,
        norm_plus_one=c.norm_plus_one, logit_softcap=c.attn_logit_softcap, norm_eps=c.norm_eps,
        kernel=c.attention_kernel,
        dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), name="attn", **options)

  def mlp_dim(self) -> int:
    """F of this layer's MLP."""
    return self.config.mlp_dim

  def feed_forward(self, x: jax.Array) -> jax.Array:
    """The residual stream x [B, T, D] -> the MLP's output [B, T, D], before its post-norm."""
    c = self.config
    mlp = GatedMlp(self.mlp_dim(), c.activation, dtype=jnp.dtype(c.dtype),
                   param_dtype=jnp.dtype(c.param_dtype), name="mlp")
    return apply_in_row_chunks(mlp, self.norm("pre_mlp_norm")(x))

  def attention_residual(self, x: jax.Array, attended: jax.Array) -> jax.Array:
    """x [B, T, D] plus the attention's output (post-normed)."""
    if self.config.use_post_attn_norm:
      attended = self.norm("post_attn_norm")(attended)
    return x + attended

  def feed_forward_residual(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] plus the feed-forward's output (post-normed)."""
    y = self.feed_forward(x)
    if self.config.use_post_ffw_norm:
      y = self.norm("post_mlp_norm")(y)
    return x + y

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict) -> jax.Array:
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]} -> [B, T, D]."""
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    y = self.attention()(self.norm("pre_attn_norm")(x), positions, masks[self.attention_type])
    return layer_output(self, self.feed_forward_residual(self.attention_residual(x, y)))
