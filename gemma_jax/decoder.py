"""The decoder: embed -> scanned blocks of layers -> final norm -> logits.

The attention pattern (e.g. 5 local, 1 global) repeats every `len(pattern)` layers;
one period is a `Block`. With `scan_layers` the first `num_layers // period` blocks
run under `nn.scan` (parameters stacked on a leading "layers" axis, compile time
independent of depth) and the remaining `num_layers % period` layers run unscanned.
Without it every layer is unrolled. Parameter names:

  scanned:   blocks/layer_{j}/...  (stacked, block b holds layer b * period + j)
             layers_{i}/...        (the remainder, i >= n_blocks * period)
  unrolled:  layers_{i}/...        for every i

`stack_layers` / `unstack_layers` convert between the two.
"""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.layers.attention import attention_mask, softcap
from gemma_jax.layers.embed import Embed
from gemma_jax.layers.norms import RMSNorm
from gemma_jax.models.gemma3 import Gemma3Layer

LAYERS = {"gemma3": Gemma3Layer}


def scanned_block_count(config: config_dict.ConfigDict) -> int:
  """How many whole pattern periods run under nn.scan (0 when unrolled)."""
  return config.num_layers // len(config.attention_pattern) if config.scan_layers else 0


def _with_remat(module_cls, config, prevent_cse):
  if not remat.is_remat(config.remat_policy):
    return module_cls
  return nn.remat(module_cls, policy=remat.POLICIES[config.remat_policy],
                  prevent_cse=prevent_cse)


class Block(nn.Module):
  """One period of the attention pattern; returns (x, None) to serve as a scan body."""
  config: config_dict.ConfigDict
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, positions, masks):
    layer_cls = LAYERS[self.config.block_type]
    for j, kind in enumerate(self.config.attention_pattern):
      x = layer_cls(self.config, kind, self.deterministic, name=f"layer_{j}")(x, positions, masks)
    return x, None


class Decoder(nn.Module):
  """tokens [B, T] -> logits [B, T, V] (float32).

  Attributes:
    config: the model section of the config.
    deterministic: disables dropout.
  """
  config: config_dict.ConfigDict
  deterministic: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
               span_ids: Optional[jax.Array] = None) -> jax.Array:
    """tokens, positions, segment_ids, span_ids: [B, T] -> [B, T, V]."""
    c = self.config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    embed = Embed(c.vocab_size, c.d_model, dtype=dtype, param_dtype=param_dtype, name="embed")
    x = embed.encode(tokens)

    index = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    masks = {
        kind: attention_mask(index, index, segment_ids, segment_ids, q_spans=span_ids,
                             kv_spans=span_ids,
                             window=c.sliding_window if kind == "local" else None)
        for kind in set(c.attention_pattern)
    }

    period = len(c.attention_pattern)
    n_blocks = scanned_block_count(c)
    if n_blocks:
      blocks = nn.scan(
          _with_remat(Block, c, prevent_cse=False),
          variable_axes={"params": 0, "intermediates": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast),
          length=n_blocks,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )(c, self.deterministic, name="blocks")
      x, _ = blocks(x, positions, masks)
    layer_cls = _with_remat(LAYERS[c.block_type], c, prevent_cse=True)
    for i in range(n_blocks * period, c.num_layers):
      layer = layer_cls(c, c.attention_pattern[i % period], self.deterministic,
                        name=f"layers_{i}")
      x = layer(x, positions, masks)

    x = RMSNorm(c.norm_eps, param_dtype=param_dtype, name="final_norm")(x)
    logits = embed.attend(x).astype(jnp.float32)
    logits = softcap(logits, c.final_logit_softcap)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def unstack_layers(params: dict, config: config_dict.ConfigDict) -> dict:
  """Scanned parameter tree -> one entry `layers_{i}` per layer."""
  params = dict(params)
  blocks = params.pop("blocks", None)
  if blocks is None:
    return params
  period = len(config.attention_pattern)
  n_blocks = jax.tree_util.tree_leaves(blocks)[0].shape[0]
  for b in range(n_blocks):
    for j in range(period):
      params[f"layers_{b * period + j}"] = jax.tree_util.tree_map(
          lambda a, b=b: a[b], blocks[f"layer_{j}"])
  return params


def _stack(*arrays):
  """Stacks host arrays on the host and device arrays on the device."""
  if all(isinstance(a, np.ndarray) for a in arrays):
    return np.stack(arrays)
  return jnp.stack(arrays)


def stack_layers(params: dict, config: config_dict.ConfigDict) -> dict:
  """`layers_{i}` parameter tree -> the layout `config.scan_layers` asks for."""
  n_blocks = scanned_block_count(config)
  if not n_blocks:
    return dict(params)
  period = len(config.attention_pattern)
  params = dict(params)
  layer = lambda i: params.pop(f"layers_{i}")
  per_block = [[layer(b * period + j) for j in range(period)] for b in range(n_blocks)]
  params["blocks"] = {
      f"layer_{j}": jax.tree_util.tree_map(_stack,
                                           *[per_block[b][j] for b in range(n_blocks)])
      for j in range(period)
  }
  return params
