"""Gemma 3 and Gemma 4 tensors: where each of our parameters lives in transformers'
layout, and the family's mapping (`family`) that gemma_jax.checkpoints.hf reads and
writes with.

Linear weights are stored [..., out, in] there and [..., in..., out...] here (`Tensor`
says which dims are contracted, and which part of a fused stored tensor is ours);
everything else is copied. The vision tower's names are its layout's
(`gemma_config.VISION`).
"""

import functools
import re
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax.checkpoints import gemma_config
from gemma_jax.checkpoints import tower_layout
from gemma_jax.checkpoints.family import Family
from gemma_jax.models.gemma4.plan import kv_sharing_modes


class Tensor(NamedTuple):
  """Where one of our parameters lives in transformers' layout."""
  name: str                      # below the text model (and below "layers.{i}." for a layer)
  in_dims: Optional[int] = None  # a linear weight's contracted dims; None: copied as is
  lead: int = 0                  # leading dims that stay in place (the expert axis)
  part: Tuple[int, int] = (0, 1)  # (index, count): this slice of the stored output dim


# Our parameter path below one layer -> where transformers keeps it.
LAYER_NAMES = {
    ("attn", "q", "kernel"): Tensor("self_attn.q_proj.weight", 1),
    ("attn", "k", "kernel"): Tensor("self_attn.k_proj.weight", 1),
    ("attn", "v", "kernel"): Tensor("self_attn.v_proj.weight", 1),
    ("attn", "out", "kernel"): Tensor("self_attn.o_proj.weight", 2),
    ("attn", "q_norm", "scale"): Tensor("self_attn.q_norm.weight"),
    ("attn", "k_norm", "scale"): Tensor("self_attn.k_norm.weight"),
    ("mlp", "gate", "kernel"): Tensor("mlp.gate_proj.weight", 1),
    ("mlp", "up", "kernel"): Tensor("mlp.up_proj.weight", 1),
    ("mlp", "down", "kernel"): Tensor("mlp.down_proj.weight", 1),
    ("pre_attn_norm", "scale"): Tensor("input_layernorm.weight"),
    ("post_attn_norm", "scale"): Tensor("post_attention_layernorm.weight"),
    ("pre_mlp_norm", "scale"): Tensor("pre_feedforward_layernorm.weight"),
    ("post_mlp_norm", "scale"): Tensor("post_feedforward_layernorm.weight"),
    # Gemma 4.
    ("layer_scalar",): Tensor("layer_scalar"),
    ("moe", "shared", "gate", "kernel"): Tensor("mlp.gate_proj.weight", 1),
    ("moe", "shared", "up", "kernel"): Tensor("mlp.up_proj.weight", 1),
    ("moe", "shared", "down", "kernel"): Tensor("mlp.down_proj.weight", 1),
    ("moe", "pre_shared_norm", "scale"): Tensor("pre_feedforward_layernorm.weight"),
    ("moe", "post_shared_norm", "scale"): Tensor("post_feedforward_layernorm_1.weight"),
    ("moe", "pre_routed_norm", "scale"): Tensor("pre_feedforward_layernorm_2.weight"),
    ("moe", "post_routed_norm", "scale"): Tensor("post_feedforward_layernorm_2.weight"),
    ("moe", "router", "proj", "kernel"): Tensor("router.proj.weight", 1),
    ("moe", "router", "scale"): Tensor("router.scale"),
    ("moe", "router", "per_expert_scale"): Tensor("router.per_expert_scale"),
    ("moe", "experts", "gate"): Tensor("experts.gate_up_proj", 1, lead=1, part=(0, 2)),
    ("moe", "experts", "up"): Tensor("experts.gate_up_proj", 1, lead=1, part=(1, 2)),
    ("moe", "experts", "down"): Tensor("experts.down_proj", 1, lead=1),
    ("per_layer_gate", "kernel"): Tensor("per_layer_input_gate.weight", 1),
    ("per_layer_proj", "kernel"): Tensor("per_layer_projection.weight", 1),
    ("post_per_layer_norm", "scale"): Tensor("post_per_layer_input_norm.weight"),
}
TOP_NAMES = {
    ("embed", "embedding"): Tensor("embed_tokens.weight"),
    ("final_norm", "scale"): Tensor("norm.weight"),
    # Gemma 4's per-layer inputs.
    ("per_layer_inputs", "embed", "embedding"): Tensor("embed_tokens_per_layer.weight"),
    ("per_layer_inputs", "proj", "kernel"): Tensor("per_layer_model_projection.weight", 1),
    ("per_layer_inputs", "norm", "scale"): Tensor("per_layer_projection_norm.weight"),
}
# Where the text model sits in each checkpoint layout, and what else may be there.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# (SigLIP's attention-pooling head, "vision_use_head", is never run by Gemma 3; Gemma 4's
# audio tower is read only with skip_audio.)
_OTHER_PREFIXES = ("model.audio_tower.", "model.embed_audio.",
                   "model.vision_tower.head.", "model.vision_tower.vision_model.head.",
                   "vision_tower.head.", "vision_tower.vision_model.head.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def stored_tensor(path: Tuple[str, ...]) -> Tensor:
  """Our unrolled parameter path -> where transformers keeps it (name below the text model)."""
  match = re.fullmatch(r"layers_(\d+)", path[0])
  if match:
    tensor = LAYER_NAMES[path[1:]]
    return tensor._replace(name=f"layers.{match.group(1)}.{tensor.name}")
  return TOP_NAMES[path]


def _text_tensors(tensors: Dict[str, np.ndarray],
                  layout: tower_layout.TowerLayout) -> Tuple[Dict[str, np.ndarray], list]:
  """Names below the text model, and the vision tower's tensors by their canonical names
  (`layout.canonical_name`) -> tensors; plus the names that belong nowhere."""
  text, unexpected = {}, []
  for name, value in tensors.items():
    if name in _LM_HEADS or name.startswith(_OTHER_PREFIXES):
      continue
    prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
    if layout.canonical_name(name):
      text[layout.canonical_name(name)] = value
    elif prefix is None:
      unexpected.append(name)
    else:
      text[name[len(prefix):]] = value
  return text, unexpected


def tensor_from_hf(value: np.ndarray, tensor: Tensor, shape: Tuple[int, ...]):
  """A stored tensor -> our parameter of `shape`, or a message saying why it does not fit
  (only the stored shape does: a transposed weight has the right size, not the shape)."""
  if tensor.in_dims is None:
    return value if value.shape == shape else f"{value.shape} != expected {shape}"
  index, count = tensor.part
  split = tensor.lead + tensor.in_dims
  rows = int(np.prod(shape[split:]))   # this part's share of the stored output dim
  stored = shape[:tensor.lead] + (count * rows, int(np.prod(shape[tensor.lead:split])))
  if value.shape != stored:
    return f"{value.shape} != expected {stored}"
  return np.swapaxes(value[..., index * rows:(index + 1) * rows, :], -1, -2).reshape(shape)


def tensor_to_hf(value: np.ndarray, path: Tuple[str, ...],
           layout: Optional[tower_layout.TowerLayout] = None,
           text_prefix: str = "model.") -> Tuple[str, int, np.ndarray]:
  """Our parameter -> (its stored name, which part of it, the stored part); the text
  model's names start with `text_prefix`, the vision tower's are `layout`'s."""
  if path[0] == "vision":
    name, value = layout.to_hf(value, path[1:])
    return name, 0, value
  tensor = stored_tensor(path)
  if tensor.in_dims is not None:
    lead = value.shape[:tensor.lead]
    inputs = int(np.prod(value.shape[tensor.lead:tensor.lead + tensor.in_dims]))
    value = np.swapaxes(value.reshape(lead + (inputs, -1)), -1, -2)
  return text_prefix + tensor.name, tensor.part[0], value


def _gemma_tensor_name(path: Tuple[str, ...], layout: tower_layout.TowerLayout) -> str:
  if path[0] == "vision":
    return layout.tensor_name(path[1:])
  return stored_tensor(path).name


def _gemma_layer_of(name: str) -> Optional[int]:
  match = re.match(r"layers\.(\d+)\.", name)
  return int(match.group(1)) if match else None


def _gemma_from_hf(value: np.ndarray, path: Tuple[str, ...], shape: Tuple[int, ...],
                   layout: tower_layout.TowerLayout):
  if path[0] == "vision":
    return layout.from_hf(value, path[1:], shape)
  return tensor_from_hf(value, stored_tensor(path), shape)


def family(block_type: str, multimodal: bool) -> Family:
  """Gemma 3's or Gemma 4's mapping, its vision tower's names included; a multimodal
  model saves as the family's ConditionalGeneration class, its text model below that
  class's prefix."""
  mapping, _, text_prefix = gemma_config.VISION[block_type]
  layout = mapping.LAYOUT
  return Family(
      config_from_hf=gemma_config.config_from_hf, config_to_hf=gemma_config.config_to_hf,
      model_tensors=functools.partial(_text_tensors, layout=layout),
      tensor_name=functools.partial(_gemma_tensor_name, layout=layout),
      layer_of=_gemma_layer_of,
      from_hf=functools.partial(_gemma_from_hf, layout=layout),
      to_hf=functools.partial(tensor_to_hf, layout=layout,
                              text_prefix=text_prefix if multimodal else "model."),
      unused_tensors=_unused_by_shared_layers)


def _unused_by_shared_layers(m: config_dict.ConfigDict) -> set:
  """Key/value weights a published Gemma 4 checkpoint holds for its shared key/value
  layers, which compute none (transformers skips them too)."""
  return {f"layers.{i}.self_attn.{name}.weight" for i, mode in enumerate(
      kv_sharing_modes(m)) if mode == "reuse"
          for name in ("k_proj", "v_proj", "k_norm", "v_norm")}
