"""Gemma 4's plan of layers (see `models.plan`): shared keys and values, per-layer inputs.

Shared keys and values (`num_kv_shared_layers`): the last layers compute none; each
attends over the keys and values of the last earlier layer of its attention type, the
"store" layer, which hands them on. Those shared ("reuse") layers scan together as
"shared_blocks" (from the first period start among them); a "store" layer runs
unscanned, so a period holding one does too (gemma4-e2b: blocks 0..9, layers 10..14,
shared_blocks 15..34).

Per-layer inputs (`per_layer_input_dim`): computed once from the tokens and the embedded
input (`per_layer_inputs.PerLayerInputs`, parameters `per_layer_inputs/...`); layer i
reads slice i.
"""

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.config import layer_types
from gemma_jax.models.gemma4.layer import Gemma4Layer
from gemma_jax.models.gemma4.per_layer_inputs import PerLayerInputs
from gemma_jax.models.plan import Family, LayerSpec


def kv_sharing_modes(model: config_dict.ConfigDict) -> Tuple[Optional[str], ...]:
  """Per layer: None, "store" (the last layer of its attention type before the shared
  ones: its keys and values serve them) or "reuse" (a shared layer)."""
  first = model.num_layers - model.num_kv_shared_layers
  types = layer_types(model)
  modes = [None] * first + ["reuse"] * model.num_kv_shared_layers
  if model.num_kv_shared_layers:
    for kind in set(types[first:]):
      modes[max(i for i in range(first) if types[i] == kind)] = "store"
  return tuple(modes)


_GROUPS = {None: "blocks", "reuse": "shared_blocks", "store": None}


def plan(model: config_dict.ConfigDict) -> Tuple[LayerSpec, ...]:
  """A spec per layer: its kv_sharing mode as a layer field, and its scan group."""
  return tuple(LayerSpec(kind, (("kv_sharing", mode),) if mode else (), _GROUPS[mode])
               for kind, mode in zip(layer_types(model), kv_sharing_modes(model)))


def text_ids(model: config_dict.ConfigDict, tokens: jax.Array) -> jax.Array:
  """tokens [B, T] with the image placeholders replaced by `vision.pad_token_id`: what
  the per-layer input table is read with (transformers' rule)."""
  if not model.vision.enabled:
    return tokens
  v = model.vision
  return jnp.where(tokens == v.image_token_id, v.pad_token_id, tokens)


def side_inputs(model: config_dict.ConfigDict, tokens: jax.Array,
                x: jax.Array) -> Optional[jax.Array]:
  """Inside the decoder's compact call: per-layer inputs [L, B, T, P], or None without
  `per_layer_input_dim`."""
  if not model.per_layer_input_dim:
    return None
  inputs = PerLayerInputs(
      model.num_layers, model.per_layer_input_dim,
      model.per_layer_vocab_size or model.vocab_size, model.norm_eps, model.norm_plus_one,
      jnp.dtype(model.dtype), jnp.dtype(model.param_dtype),
      name="per_layer_inputs")(text_ids(model, tokens), x)          # [B, T, L, P]
  return jnp.moveaxis(inputs, 2, 0)


def run_layer(layer, x, positions, masks, per_layer_input, handed) -> tuple:
  """Calls a Gemma 4 layer; `handed` maps an attention type to its "store" layer's
  (keys, values), which a "store" layer adds to and a "reuse" layer reads."""
  kind, mode = layer.attention_type, layer.kv_sharing
  out = layer(x, positions, masks, per_layer_input,
              handed[kind] if mode == "reuse" else None)
  if mode != "store":
    return out, handed
  x, kv = out
  return x, {**handed, kind: kv}


FAMILY = Family(layer=Gemma4Layer, plan=plan, side_inputs=side_inputs, run_layer=run_layer)
