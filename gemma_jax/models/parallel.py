"""The generic parallel decoder layer: attention and MLP side by side.

    y = norm(x);  x = x + dropout(attn(y) + mlp(y))

One RMSNorm feeds both branches, and their sum joins the residual once (GPT-J, PaLM).
Attention and the gated MLP are Gemma 3's, read from the same config fields (RoPE per
attention type, query/key norms, soft caps); the post-norm fields are not used.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers import activation_stats
from gemma_jax.layers.mlp import GatedMlp
from gemma_jax.layers.row_chunks import apply_in_row_chunks
from gemma_jax.models.gemma3.layer import Gemma3Layer
from gemma_jax.models.layer import ACTIVATION_AXES


class ParallelLayer(Gemma3Layer):
  """x + attn(norm(x)) + mlp(norm(x)), one norm for both."""

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, masks: dict) -> jax.Array:
    """x: [B, T, D], positions: [B, T], masks: {"local"|"global": [B, T, T]} -> [B, T, D]."""
    c = self.config
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    y = self.norm("pre_norm")(x)
    attended = self.attention()(y, positions, masks[self.attention_type])
    mlp = apply_in_row_chunks(GatedMlp(c.mlp_dim, c.activation, dtype=jnp.dtype(c.dtype),
                                       param_dtype=jnp.dtype(c.param_dtype), name="mlp"), y)
    branches = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))(
        attended + mlp, deterministic=self.deterministic)
    x = x + branches
    if c.record_internal_nn_metrics:
      activation_stats.record(self, x)
    return nn.with_logical_constraint(x, ACTIVATION_AXES)
