"""The GPT-3 decoder layer: pre-LayerNorm attention and MLP, each added to the stream.

    x = x + attn(layer_norm(x));  x = x + mlp(layer_norm(x))

LayerNorm with a bias, scale applied as (1 + scale); attention with biases, a key/value
head per query head, optionally one fused [D, 3, N, H] projection, queries scaled by
head_dim^-0.5 and no RoPE (positions come from the decoder's learned embedding); a plain
(ungated) MLP with biases. No post-norms (`config.validate` refuses them for GPT-3).
Config fields it ignores: the RoPE and query/key norm fields, `query_pre_attn_scalar`
and the Gemma 4 attention options.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.layers.attention import Attention
from gemma_jax.layers.layer_norm import LayerNorm
from gemma_jax.layers.mlp import Mlp
from gemma_jax.layers.row_chunks import apply_in_row_chunks
from gemma_jax.models.layer import ACTIVATION_AXES, DecoderLayer, layer_output


class Gpt3Layer(DecoderLayer):
  """x + attn(pre_attn_norm(x)), then x + mlp(pre_mlp_norm(x)); LayerNorms, biases."""

  @staticmethod
  def make_norm(config: config_dict.ConfigDict, name: str) -> nn.Module:
    """LayerNorm with a bias (the decoder's final norm too)."""
    return LayerNorm(config.norm_eps, reductions_in_float32=config.layer_norm_float32,
                     param_dtype=jnp.dtype(config.param_dtype), name=name)

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict) -> jax.Array:
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]} -> [B, T, D]."""
    c = self.config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    attention = Attention(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, query_scale=c.head_dim ** -0.5, use_rope=False,
                          use_qk_norm=False, logit_softcap=c.attn_logit_softcap,
                          fused_qkv=c.fused_qkv, use_bias=True, kernel=c.attention_kernel,
                          dtype=dtype, param_dtype=param_dtype, name="attn")
    x = x + attention(self.make_norm(c, "pre_attn_norm")(x), positions,
                      masks[self.attention_type])
    mlp = Mlp(c.mlp_dim, c.activation, use_bias=True, dtype=dtype, param_dtype=param_dtype,
              name="mlp")
    x = x + apply_in_row_chunks(mlp, self.make_norm(c, "pre_mlp_norm")(x))
    return layer_output(self, x)
