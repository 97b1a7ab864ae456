"""The Gemma 3 decoder layer: sandwich-normed attention and gated MLP."""

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.layers.attention import Attention
from gemma_jax.layers.mlp import GatedMlp
from gemma_jax.layers.norms import RMSNorm

ACTIVATION_AXES = ("batch", "length", "embed")


class Gemma3Layer(nn.Module):
  """x + post_norm(attn(pre_norm(x))), then the same around the MLP.

  Attributes:
    config: the model section of the config.
    attention_type: "local" (sliding window) or "global".
    deterministic: disables dropout.
  """
  config: config_dict.ConfigDict
  attention_type: str
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict) -> jax.Array:
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]} -> [B, T, D]."""
    c = self.config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    norm = lambda name: RMSNorm(c.norm_eps, param_dtype=param_dtype, name=name)
    kind = self.attention_type
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    x = checkpoint_name(x, "decoder_layer_input")

    attn = Attention(
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        query_scale=(c.query_pre_attn_scalar or c.head_dim) ** -0.5,
        rope_base=c[f"rope_{kind}_base"], rope_scale=c[f"rope_{kind}_scale"],
        rope_fraction=c[f"rope_{kind}_fraction"], use_qk_norm=c.use_qk_norm,
        logit_softcap=c.attn_logit_softcap, norm_eps=c.norm_eps,
        dtype=dtype, param_dtype=param_dtype, name="attn")
    y = attn(norm("pre_attn_norm")(x), positions, masks[kind])
    if c.use_post_attn_norm:
      y = norm("post_attn_norm")(y)
    x = x + y

    y = GatedMlp(c.mlp_dim, c.activation, dtype=dtype, param_dtype=param_dtype,
                 name="mlp")(norm("pre_mlp_norm")(x))
    if c.use_post_ffw_norm:
      y = norm("post_mlp_norm")(y)
    x = x + y
    x = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))(x, deterministic=self.deterministic)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)
