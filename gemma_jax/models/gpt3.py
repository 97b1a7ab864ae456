"""The GPT-3 decoder layer: Gemma 3's residual wiring with GPT's parts.

    x = x + attn(layer_norm(x));  x = x + mlp(layer_norm(x))

What differs from `Gemma3Layer` (whose `__call__` it runs, with the post-norms off in
the presets): LayerNorm with a bias, scale applied as (1 + scale); attention with
biases, a key/value head per query head, optionally one fused [D, 3, N, H] projection,
queries scaled by head_dim^-0.5 and no RoPE (positions come from the decoder's learned
embedding); a plain (ungated) MLP with biases. Config fields it ignores: the RoPE and
query/key norm fields, `query_pre_attn_scalar` and the Gemma 4 attention options.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.layers.attention import Attention
from gemma_jax.layers.layer_norm import LayerNorm
from gemma_jax.layers.mlp import Mlp
from gemma_jax.layers.row_chunks import apply_in_row_chunks
from gemma_jax.models.gemma3.layer import Gemma3Layer


class Gpt3Layer(Gemma3Layer):
  """x + attn(pre_attn_norm(x)), then x + mlp(pre_mlp_norm(x)); LayerNorms, biases."""

  @staticmethod
  def make_norm(config: config_dict.ConfigDict, name: str) -> nn.Module:
    """LayerNorm with a bias (the decoder's final norm too)."""
    return LayerNorm(config.norm_eps, reductions_in_float32=config.layer_norm_float32,
                     param_dtype=jnp.dtype(config.param_dtype), name=name)

  def attention(self) -> Attention:
    c = self.config
    return Attention(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     query_scale=c.head_dim ** -0.5, use_rope=False, use_qk_norm=False,
                     logit_softcap=c.attn_logit_softcap, fused_qkv=c.fused_qkv, use_bias=True,
                     kernel=c.attention_kernel, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), name="attn")

  def feed_forward(self, x: jax.Array) -> jax.Array:
    c = self.config
    mlp = Mlp(c.mlp_dim, c.activation, use_bias=True, dtype=jnp.dtype(c.dtype),
              param_dtype=jnp.dtype(c.param_dtype), name="mlp")
    return apply_in_row_chunks(mlp, self.norm("pre_mlp_norm")(x))
