"""What every family's decoder layer shares: its fields, and how it ends.

A layer is `Layer(config, attention_type, deterministic)(x, positions, masks, ...)` ->
x [B, T, D]; its class gives `make_norm(config, name)`, the family's norm over D, which
the decoder's final norm uses too.
"""

import flax.linen as nn
import jax
from ml_collections import config_dict

from gemma_jax.layers import activation_stats

ACTIVATION_AXES = ("batch", "length", "embed")


class DecoderLayer(nn.Module):
  """The fields of a decoder layer (each family's layer subclasses it).

  Attributes:
    config: the model section of the config.
    attention_type: "local" (sliding window) or "global".
    deterministic: disables dropout.
  """
  config: config_dict.ConfigDict
  attention_type: str
  deterministic: bool = True


def layer_output(layer: DecoderLayer, x: jax.Array) -> jax.Array:
  """A layer's output [B, T, D]: dropout on it, its statistics recorded where the config
  asks."""
  c = layer.config
  x = nn.Dropout(c.dropout_rate, broadcast_dims=(-2,))(x, deterministic=layer.deterministic)
  if c.record_internal_nn_metrics:
    activation_stats.record(layer, x)
  return nn.with_logical_constraint(x, ACTIVATION_AXES)
