"""transformers <-> gemma_jax: configs and weights in the published (safetensors) layout.

    config, params = gemma_jax.hf.load("path/to/save_pretrained_dir")
    gemma_jax.hf.save("out_dir", config, params)   # transformers' from_pretrained reads it

Reads `Gemma3ForCausalLM` and `Gemma4ForCausalLM` checkpoints (Gemma 4 dense,
mixture-of-experts and the small models), and `Gemma3ForConditionalGeneration` and
`Gemma4ForConditionalGeneration` ones whole: the vision tower through
`gemma_jax.hf_vision` or `gemma_jax.hf_gemma4_vision` (a model with `vision.enabled`
saves as one; Gemma 4's audio tower is refused unless `skip_audio`), transformers 4 and 5
name layouts. Linear weights are stored [..., out, in] there and
[..., in..., out...] here; everything else is copied. Parameters come back as host
numpy arrays in the config's `param_dtype`, or straight onto a mesh (`load(...,
shardings=...)`, each device's part read alone). GPT-2 checkpoints (`GPT2LMHeadModel`,
`GPT2Model`) load into the GPT-3 block and a GPT-3 model saves as one; their mapping is
`gemma_jax.hf_gpt2`.
"""

import functools
import json
import os
import re
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax import hf_fields
from gemma_jax import hf_gemma4_vision
from gemma_jax import hf_tower
from gemma_jax import hf_vision
from gemma_jax import quant
from gemma_jax import safetensors_io
from gemma_jax import sharded_read
from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints import bounded_json
from gemma_jax.checkpoints import directory
from gemma_jax.decoder import layer_types, scan_segments, stack_layers, unstack_layers
from gemma_jax.transformer import transform

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu",
                "relu": "relu"}
_ATTENTION_TYPES = {"sliding_attention": "local", "full_attention": "global"}
_HF_ATTENTION_TYPES = {v: k for k, v in _ATTENTION_TYPES.items()}
_ROPE_TYPES = hf_fields.one_of(("default", "linear", "proportional"))
# model_type of a text config -> (our block type, the causal LM class it saves as).
_FAMILIES = {"gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
             "gemma4_text": ("gemma4", "Gemma4ForCausalLM")}
_MULTIMODAL = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# What transformers' Gemma3TextConfig reads for a key its config.json leaves out: its
# defaults in ~4.50, which wrote the published 4B/12B/27B configs (transformers 5 keeps
# the same two rope bases as default rope_parameters).
_GEMMA3_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0}


class _Tensor(NamedTuple):
  """Where one of our parameters lives in transformers' layout."""
  name: str                      # below the text model (and below "layers.{i}." for a layer)
  in_dims: Optional[int] = None  # a linear weight's contracted dims; None: copied as is
  lead: int = 0                  # leading dims that stay in place (the expert axis)
  part: Tuple[int, int] = (0, 1)  # (index, count): this slice of the stored output dim


# Our parameter path below one layer -> where transformers keeps it.
_LAYER_NAMES = {
    ("attn", "q", "kernel"): _Tensor("self_attn.q_proj.weight", 1),
    ("attn", "k", "kernel"): _Tensor("self_attn.k_proj.weight", 1),
    ("attn", "v", "kernel"): _Tensor("self_attn.v_proj.weight", 1),
    ("attn", "out", "kernel"): _Tensor("self_attn.o_proj.weight", 2),
    ("attn", "q_norm", "scale"): _Tensor("self_attn.q_norm.weight"),
    ("attn", "k_norm", "scale"): _Tensor("self_attn.k_norm.weight"),
    ("mlp", "gate", "kernel"): _Tensor("mlp.gate_proj.weight", 1),
    ("mlp", "up", "kernel"): _Tensor("mlp.up_proj.weight", 1),
    ("mlp", "down", "kernel"): _Tensor("mlp.down_proj.weight", 1),
    ("pre_attn_norm", "scale"): _Tensor("input_layernorm.weight"),
    ("post_attn_norm", "scale"): _Tensor("post_attention_layernorm.weight"),
    ("pre_mlp_norm", "scale"): _Tensor("pre_feedforward_layernorm.weight"),
    ("post_mlp_norm", "scale"): _Tensor("post_feedforward_layernorm.weight"),
    # Gemma 4.
    ("layer_scalar",): _Tensor("layer_scalar"),
    ("moe", "shared", "gate", "kernel"): _Tensor("mlp.gate_proj.weight", 1),
    ("moe", "shared", "up", "kernel"): _Tensor("mlp.up_proj.weight", 1),
    ("moe", "shared", "down", "kernel"): _Tensor("mlp.down_proj.weight", 1),
    ("moe", "pre_shared_norm", "scale"): _Tensor("pre_feedforward_layernorm.weight"),
    ("moe", "post_shared_norm", "scale"): _Tensor("post_feedforward_layernorm_1.weight"),
    ("moe", "pre_routed_norm", "scale"): _Tensor("pre_feedforward_layernorm_2.weight"),
    ("moe", "post_routed_norm", "scale"): _Tensor("post_feedforward_layernorm_2.weight"),
    ("moe", "router", "proj", "kernel"): _Tensor("router.proj.weight", 1),
    ("moe", "router", "scale"): _Tensor("router.scale"),
    ("moe", "router", "per_expert_scale"): _Tensor("router.per_expert_scale"),
    ("moe", "experts", "gate"): _Tensor("experts.gate_up_proj", 1, lead=1, part=(0, 2)),
    ("moe", "experts", "up"): _Tensor("experts.gate_up_proj", 1, lead=1, part=(1, 2)),
    ("moe", "experts", "down"): _Tensor("experts.down_proj", 1, lead=1),
    ("per_layer_gate", "kernel"): _Tensor("per_layer_input_gate.weight", 1),
    ("per_layer_proj", "kernel"): _Tensor("per_layer_projection.weight", 1),
    ("post_per_layer_norm", "scale"): _Tensor("post_per_layer_input_norm.weight"),
}
_TOP_NAMES = {
    ("embed", "embedding"): _Tensor("embed_tokens.weight"),
    ("final_norm", "scale"): _Tensor("norm.weight"),
    # Gemma 4's per-layer inputs.
    ("per_layer_inputs", "embed", "embedding"): _Tensor("embed_tokens_per_layer.weight"),
    ("per_layer_inputs", "proj", "kernel"): _Tensor("per_layer_model_projection.weight", 1),
    ("per_layer_inputs", "norm", "scale"): _Tensor("per_layer_projection_norm.weight"),
}
# What transformers' Gemma4TextConfig reads for the small models' keys a config.json
# leaves out.
_GEMMA4_DEFAULTS = {"hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                    "num_kv_shared_layers": 0, "use_double_wide_mlp": False}
# Where the text model sits in each checkpoint layout, and what else may be there.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# (SigLIP's attention-pooling head, "vision_use_head", is never run by Gemma 3; Gemma 4's
# audio tower is read only with skip_audio.)
_OTHER_PREFIXES = ("model.audio_tower.", "model.embed_audio.",
                   "model.vision_tower.head.", "model.vision_tower.vision_model.head.",
                   "vision_tower.head.", "vision_tower.vision_model.head.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
# Block type -> (the vision tower's names and config keys, the multimodal class, where its
# saved files keep the text model).
_VISION = {"gemma3": (hf_vision, "Gemma3ForConditionalGeneration", "language_model.model."),
           "gemma4": (hf_gemma4_vision, "Gemma4ForConditionalGeneration",
                      "model.language_model.")}


def _hf_tensor(path: Tuple[str, ...]) -> _Tensor:
  """Our unrolled parameter path -> where transformers keeps it (name below the text model)."""
  match = re.fullmatch(r"layers_(\d+)", path[0])
  if match:
    tensor = _LAYER_NAMES[path[1:]]
    return tensor._replace(name=f"layers.{match.group(1)}.{tensor.name}")
  return _TOP_NAMES[path]


# ----------------------------------------------------------------------------- configs


def _text_config(hf: hf_fields.Section) -> Tuple[str, hf_fields.Section]:
  """(model_type, the text model's section of a config.json, its family's defaults
  filled in)."""
  model_type = hf.read("model_type", hf_fields.optional(hf_fields.STRING), None)
  text = hf
  if model_type in _MULTIMODAL:
    text = hf.section("text_config")
    model_type = text.read("model_type", hf_fields.STRING, _MULTIMODAL[model_type])
  if model_type not in _FAMILIES:
    raise hf_fields.FieldError(
        f"unsupported {text.where}model_type {model_type!r}: this reader knows "
        f"{sorted([*_FAMILIES, *_MULTIMODAL, 'gpt2'])}")
  defaults = _GEMMA3_DEFAULTS if model_type == "gemma3_text" else _GEMMA4_DEFAULTS
  return model_type, hf_fields.Section(text.values, text.where, defaults)


def _rope(text: hf_fields.Section, layer_type: str,
          legacy_theta: str) -> Tuple[float, float, float]:
  """(base, linear scale, rotated fraction) of one layer type, from either config generation."""
  per_type = text.section("rope_parameters")
  if per_type.read(layer_type, hf_fields.optional(hf_fields.OBJECT), None) is not None:
    params = per_type.section(layer_type)
  elif layer_type == "full_attention":   # transformers 4: rope_theta and rope_scaling
    params = text.section("rope_scaling")
  else:   # transformers 4: rope_local_base_freq
    params = hf_fields.Section({}, text.where)
  kind = params.read("rope_type" if "rope_type" in params else "type", _ROPE_TYPES, "default")
  scale = float(params.read("factor", hf_fields.POSITIVE, 1.0)) if kind != "default" else 1.0
  fraction = float(params.read("partial_rotary_factor", hf_fields.FRACTION, 1.0))
  if fraction != 1.0 and kind != "proportional":
    # transformers' Gemma rotates whole heads by cos and sin of the fraction's width:
    # such a checkpoint does not run there, and reading it as whole rotation is wrong.
    raise params.error("partial_rotary_factor", f"{fraction} with rope_type {kind!r}; only "
                       "'proportional' rotates part of a head")
  if "rope_theta" in params:
    return float(params.read("rope_theta", hf_fields.POSITIVE)), scale, fraction
  return float(text.read(legacy_theta, hf_fields.POSITIVE)), scale, fraction


def _pattern(kinds, last_exempt: bool = False) -> Tuple[str, ...]:
  """The shortest period that repeats to give every layer its type. With `last_exempt`
  the last layer (global) need not follow it, and the period ends with a global layer."""
  body = kinds[:-1] if last_exempt else kinds
  for period in range(1, len(kinds) + 1):
    pattern = kinds[:period]
    if last_exempt and pattern[-1] != kinds[-1]:
      continue
    if all(k == pattern[i % period] for i, k in enumerate(body)):
      return tuple(pattern)
  raise AssertionError("unreachable: the full list is its own period")


def _global_override(text: hf_fields.Section, global_layers: list) -> hf_fields.Section:
  """The one override in transformers 5's per_layer_config (what differs, layer by layer),
  which must override every global layer alike and no other layer."""
  per_layer = text.section("per_layer_config")
  layers = {}
  for key in per_layer.keys():
    if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
      raise per_layer.error(key, "expected a layer index")
    layers[int(key)] = per_layer.section(key)
  empty = hf_fields.Section({}, per_layer.where)
  override = layers.get(global_layers[0], empty) if global_layers else empty
  if set(layers) - set(global_layers) or any(
      layers.get(i, empty).values != override.values for i in global_layers):
    raise text.error("per_layer_config", "must override every global layer alike and no "
                     "other layer")
  extra = set(override.keys()) - {"head_dim", "num_key_value_heads"}
  if extra:
    raise text.error("per_layer_config", f"overrides {sorted(extra)}")
  return override


def _gemma4_fields(text: hf_fields.Section, kinds) -> dict:
  """Our Gemma 4 model fields from its transformers text config."""
  optional = hf_fields.optional
  bidirectional = text.read("use_bidirectional_attention", optional(hf_fields.one_of(
      ["vision"])), None)
  global_layers = [i for i, kind in enumerate(kinds) if kind == "global"]
  k_eq_v = bool(text.read("attention_k_eq_v", optional(hf_fields.FLAG), None))
  head_dim = text.read("head_dim", hf_fields.POSITIVE_INT)
  kv_heads = text.read("num_key_value_heads", hf_fields.POSITIVE_INT)
  if "per_layer_config" in text:
    override = _global_override(text, global_layers)
    head_dim = override.read("head_dim", hf_fields.POSITIVE_INT, head_dim)
    kv_heads = override.read("num_key_value_heads", hf_fields.POSITIVE_INT, kv_heads)
  else:   # the published form; transformers' defaults
    head_dim = text.read("global_head_dim", optional(hf_fields.COUNT), 512) or head_dim
    kv_heads = (k_eq_v and text.read("num_global_key_value_heads",
                                     optional(hf_fields.COUNT), None)) or kv_heads
  per_layer_dim = text.read("hidden_size_per_layer_input", optional(hf_fields.COUNT)) or 0
  fields = dict(
      norm_plus_one=False, use_value_norm=True, query_pre_attn_scalar=1.0,
      final_layer_global=True,
      # Image spans see each other both ways in local layers, where the config asks
      # ("vision"); the small models attend causally throughout.
      bidirectional_span_types=("local",) if bidirectional == "vision" else (),
      global_head_dim=head_dim if global_layers else None,
      global_num_kv_heads=kv_heads if global_layers else None,
      global_k_eq_v=k_eq_v,
      per_layer_input_dim=per_layer_dim,
      per_layer_vocab_size=(text.read("vocab_size_per_layer_input", hf_fields.POSITIVE_INT)
                            if per_layer_dim else None),
      num_kv_shared_layers=text.read("num_kv_shared_layers", optional(hf_fields.COUNT)) or 0,
      double_wide_mlp=bool(text.read("use_double_wide_mlp", optional(hf_fields.FLAG))))
  if text.read("enable_moe_block", optional(hf_fields.FLAG), None):
    fields.update({ours: text.read(key, hf_fields.POSITIVE_INT) for ours, key in (
        ("num_experts", "num_experts"), ("experts_per_token", "top_k_experts"),
        ("expert_mlp_dim", "moe_intermediate_size"))})
  return fields


def config_from_hf(hf: dict, file: str = "config.json") -> config_dict.ConfigDict:
  """A transformers config.json (as a dict) -> our full config. Raises CheckpointError
  naming `file` and the first field that is missing, of the wrong kind or not supported."""
  try:
    return _read_config(hf_fields.Section(hf))
  except hf_fields.FieldError as error:
    raise CheckpointError(f"{file}: {error}") from None


def _read_config(hf: hf_fields.Section) -> config_dict.ConfigDict:
  """config_from_hf's reading, field by field (FieldError naming the first bad one)."""
  model_type, text = _text_config(hf)
  block_type = _FAMILIES[model_type][0]
  for field, ok in (("attention_bias", False),) + (
      (("use_bidirectional_attention", False),) if block_type == "gemma3" else ()):
    if text.read(field, hf_fields.FLAG, ok) != ok:
      raise text.error(field, f"only {json.dumps(ok)} is supported")
  tied = hf.read("tie_word_embeddings", hf_fields.FLAG, True)
  if not text.read("tie_word_embeddings", hf_fields.FLAG, tied):
    raise text.error("tie_word_embeddings", "false is not supported")
  n_layers = text.read("num_hidden_layers", hf_fields.LAYER_COUNT)
  hf_types = text.read("layer_types", hf_fields.optional(hf_fields.STRINGS), None)
  if hf_types is None:   # transformers 4: every sliding_window_pattern-th layer is global
    period = text.read("sliding_window_pattern", hf_fields.POSITIVE_INT, 6)
    hf_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                for i in range(n_layers)]
  unknown = sorted(set(hf_types) - set(_ATTENTION_TYPES))
  if unknown:
    raise hf_fields.FieldError(f"{text.where}layer_types holds {unknown}, not one of "
                               f"{sorted(_ATTENTION_TYPES)}")
  if len(hf_types) != n_layers:
    raise text.error("layer_types", f"lists {len(hf_types)} layers; num_hidden_layers is "
                     f"{n_layers}")
  kinds = [_ATTENTION_TYPES[t] for t in hf_types]
  local = _rope(text, "sliding_attention", "rope_local_base_freq")
  global_ = _rope(text, "full_attention", "rope_theta")
  size = functools.partial(text.read, kind=hf_fields.POSITIVE_INT)
  config = config_lib.default_config()
  config.model.update(dict(
      name="hf", block_type=block_type, vocab_size=size("vocab_size"),
      d_model=size("hidden_size"), num_layers=n_layers,
      num_heads=size("num_attention_heads"), num_kv_heads=size("num_key_value_heads"),
      head_dim=size("head_dim"), mlp_dim=size("intermediate_size"),
      activation=_ACTIVATIONS[text.read("hidden_activation", hf_fields.one_of(_ACTIVATIONS))],
      attention_pattern=_pattern(kinds, last_exempt=block_type == "gemma4"),
      sliding_window=size("sliding_window"),
      rope_local_base=local[0], rope_local_scale=local[1], rope_local_fraction=local[2],
      rope_global_base=global_[0], rope_global_scale=global_[1],
      rope_global_fraction=global_[2],
      # transformers' Gemma 3 stores attn_logit_softcapping but never applies it;
      # we compute what it computes.
      attn_logit_softcap=None,
      final_logit_softcap=text.read("final_logit_softcapping",
                                    hf_fields.optional(hf_fields.POSITIVE), None),
      norm_eps=text.read("rms_norm_eps", hf_fields.POSITIVE)))
  if block_type == "gemma3":
    config.model.query_pre_attn_scalar = float(text.read("query_pre_attn_scalar",
                                                         hf_fields.POSITIVE))
  else:
    config.model.update(_gemma4_fields(text, kinds))
  if hf.read("audio_config", hf_fields.optional(hf_fields.OBJECT), None):
    raise hf.error("audio_config", "Gemma 4's audio tower is not read yet; "
                   "hf.load(..., skip_audio=True) reads the text and vision parts")
  if (hf.read("model_type", hf_fields.STRING) in _MULTIMODAL
      and hf.read("vision_config", hf_fields.optional(hf_fields.OBJECT), None)):
    config.model.vision.update(_VISION[block_type][0].config_from_hf(hf.values, _ACTIVATIONS))
  return config


def _architecture(m: config_dict.ConfigDict) -> dict:
  """The model fields that decide its function (effective values), by config field name."""
  types = layer_types(m)
  arch = {f: m[f] for f in (
      "block_type", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
      "head_dim", "mlp_dim", "activation", "attn_logit_softcap", "final_logit_softcap",
      "norm_eps", "use_qk_norm", "use_post_attn_norm", "use_post_ffw_norm", "norm_plus_one",
      "use_value_norm", "num_experts",
      # Options of every family; Gemma's classes fix them (scaled, tied, no positions).
      "scale_embeddings", "sinusoidal_position_embedding", "logits_via_embedding",
      "trainable_position_size")}
  arch["attention_pattern"] = types
  arch["vision"] = ({k: m.vision[k] for k in _VISION[m.block_type][0].FIELDS}
                    if m.vision.enabled else None)
  if m.vision.enabled:   # which layers let an image's tokens see each other
    arch["bidirectional_span_types"] = tuple(
        kind for kind in config_lib.ATTENTION_TYPES
        if kind in m.bidirectional_span_types and kind in types)
  head_dims = {"local": m.head_dim, "global": m.global_head_dim or m.head_dim}
  arch["query_pre_attn_scalar"] = tuple(m.query_pre_attn_scalar or head_dims[kind]
                                        for kind in sorted(set(types)))
  for kind in set(types):
    for what in ("base", "scale", "fraction"):
      arch[f"rope_{kind}_{what}"] = m[f"rope_{kind}_{what}"]
  if "local" in types:
    arch["sliding_window"] = m.sliding_window
  if "global" in types:
    arch["global_num_kv_heads"] = m.global_num_kv_heads or m.num_kv_heads
    arch["global_head_dim"] = head_dims["global"]
    arch["global_k_eq_v"] = m.global_k_eq_v
  if m.num_experts:
    arch.update(experts_per_token=m.experts_per_token, expert_mlp_dim=m.expert_mlp_dim)
  arch["per_layer_input_dim"] = m.per_layer_input_dim
  if m.per_layer_input_dim:
    arch["per_layer_vocab_size"] = m.per_layer_vocab_size or m.vocab_size
  arch["num_kv_shared_layers"] = m.num_kv_shared_layers
  if m.num_kv_shared_layers:
    arch["double_wide_mlp"] = m.double_wide_mlp
  return arch


def _hf_rope(m: config_dict.ConfigDict, kind: str) -> dict:
  base, scale, fraction = (m[f"rope_{kind}_{what}"] for what in ("base", "scale", "fraction"))
  if fraction != 1.0:
    return {"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": fraction,
            **({"factor": scale} if scale != 1.0 else {})}
  if scale != 1.0:
    return {"rope_type": "linear", "rope_theta": base, "factor": scale}
  return {"rope_type": "default", "rope_theta": base}


def config_to_hf(config: config_dict.ConfigDict) -> dict:
  """Our config -> a transformers `Gemma3ForCausalLM` / `Gemma4ForCausalLM` config.json dict.

  Raises CheckpointError naming the first model field transformers' class would read
  back differently (e.g. Gemma 3 applies no attention soft cap).
  """
  m = config.model
  model_type = {v[0]: k for k, v in _FAMILIES.items()}[m.block_type]
  types = layer_types(m)
  hf = {
      "architectures": [_FAMILIES[model_type][1]], "model_type": model_type,
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
      "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
      "hidden_activation": {v: k for k, v in _ACTIVATIONS.items()}[m.activation],
      "layer_types": [_HF_ATTENTION_TYPES[kind] for kind in types],
      "sliding_window": m.sliding_window,
      "rope_parameters": {"sliding_attention": _hf_rope(m, "local"),
                          "full_attention": _hf_rope(m, "global")},
      "final_logit_softcapping": m.final_logit_softcap,
      "rms_norm_eps": m.norm_eps, "tie_word_embeddings": True, "attention_bias": False,
      "dtype": m.param_dtype,
  }
  if m.block_type == "gemma3":
    if m.rope_local_fraction != 1.0 or m.rope_global_fraction != 1.0:
      raise CheckpointError("config.model.rope_global_fraction: transformers' Gemma 3 "
                            "rotates the whole head dim")
    scalar = m.query_pre_attn_scalar or m.head_dim
    if not float(scalar).is_integer():
      raise CheckpointError(f"config.model.query_pre_attn_scalar: transformers' "
                            f"Gemma3TextConfig takes an integer, not {scalar!r}")
    hf["query_pre_attn_scalar"] = int(scalar)
  else:
    hf.update({
        "use_bidirectional_attention": "vision" if "local" in m.bidirectional_span_types
                                       else None,
        "attention_k_eq_v": m.global_k_eq_v,
        "hidden_size_per_layer_input": m.per_layer_input_dim,
        "vocab_size_per_layer_input": m.per_layer_vocab_size or m.vocab_size,
        "num_kv_shared_layers": m.num_kv_shared_layers,
        "use_double_wide_mlp": m.double_wide_mlp, "enable_moe_block": bool(m.num_experts),
        "num_experts": m.num_experts or None,
        "top_k_experts": m.experts_per_token if m.num_experts else None,
        "moe_intermediate_size": m.expert_mlp_dim or None,
        "per_layer_config": {
            str(i): {"head_dim": m.global_head_dim or m.head_dim,
                     "num_key_value_heads": m.global_num_kv_heads or m.num_kv_heads}
            for i, kind in enumerate(types) if kind == "global"}})
  if m.vision.enabled:   # the text config goes inside the multimodal one
    text = dict(hf, model_type=_MULTIMODAL[m.block_type])
    del text["architectures"]
    if m.block_type == "gemma4":
      text["pad_token_id"] = m.vision.pad_token_id
    mapping, architecture, _ = _VISION[m.block_type]
    hf = dict(architectures=[architecture], model_type=m.block_type,
              text_config=text, tie_word_embeddings=True, dtype=m.param_dtype,
              **mapping.config_to_hf(m.vision, {v: k for k, v in _ACTIVATIONS.items()}))
    if m.block_type == "gemma4":
      hf["audio_config"] = None
  ours, theirs = _architecture(m), _architecture(config_from_hf(hf).model)
  for field, value in ours.items():
    if theirs.get(field) != value:
      raise CheckpointError(
          f"config.model.{field}: transformers' {hf['architectures'][0]} cannot represent "
          f"{value!r} (it would read {theirs.get(field)!r})")
  return hf


# ----------------------------------------------------------------------------- weights


def _index_files(index: str) -> list:
  """The files an index (model.safetensors.index.json) names, sorted; a CheckpointError
  naming the index where it is not one, or names a file outside its directory."""
  weight_map = read_json_object(index).get("weight_map")
  if not (isinstance(weight_map, dict)
          and all(isinstance(name, str) for name in weight_map.values())):
    raise CheckpointError(f"{index}: not an index with a weight_map of tensor names to files")
  for tensor, name in weight_map.items():
    inside = os.path.normpath(name)
    if os.path.isabs(inside) or inside == "." or inside.split(os.sep)[0] == "..":
      raise CheckpointError(f"{index}: weight_map names {hf_fields.shown(name)} for "
                            f"{hf_fields.shown(tensor)}, which is not a file inside "
                            f"{os.path.dirname(index)}")
  return sorted(set(weight_map.values()))


def _read_tensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
  """Every tensor of the checkpoint directory `path` (one file, or the shards its index
  names), and the file each is in; a missing, truncated or malformed file is a
  CheckpointError naming it."""
  index = os.path.join(path, "model.safetensors.index.json")
  indexed = os.path.lexists(index)
  if indexed:
    names = _index_files(index)
  else:
    names = [name for name in sorted(os.listdir(path)) if name.endswith(".safetensors")]
  if not names:
    raise CheckpointError(f"{path}: no .safetensors files")
  tensors, files = {}, {}
  for name in names:
    file = os.path.join(path, name)
    if indexed and not os.path.exists(file):
      raise CheckpointError(f"{index}: names {name}, which is not in {path}")
    try:
      shard = safetensors_io.read(file)
    except OSError as error:
      raise CheckpointError(f"{file}: cannot be read ({error.strerror})") from None
    except ValueError as error:
      raise CheckpointError(str(error)) from None
    twice = sorted(shard.keys() & tensors.keys())
    if twice:   # (one of the two would be read, the other dropped unseen)
      raise CheckpointError(f"{file}: holds tensor {twice[0]}, which {files[twice[0]]} "
                            "holds too")
    tensors.update(shard)
    files.update(dict.fromkeys(shard, file))
  return tensors, files


def _text_tensors(tensors: Dict[str, np.ndarray],
                  layout: hf_tower.TowerLayout) -> Tuple[Dict[str, np.ndarray], list]:
  """Names below the text model, and the vision tower's tensors by their canonical names
  (`layout.canonical_name`) -> tensors; plus the names that belong nowhere."""
  text, unexpected = {}, []
  for name, value in tensors.items():
    if name in _LM_HEADS or name.startswith(_OTHER_PREFIXES):
      continue
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if layout.canonical_name(name):
      text[layout.canonical_name(name)] = value
    elif prefix is None:
      unexpected.append(name)
    else:
      text[name[len(prefix):]] = value
  return text, unexpected


def _from_hf(value: np.ndarray, tensor: _Tensor, shape: Tuple[int, ...]):
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


def _to_hf(value: np.ndarray, path: Tuple[str, ...],
           layout: Optional[hf_tower.TowerLayout] = None,
           text_prefix: str = "model.") -> Tuple[str, int, np.ndarray]:
  """Our parameter -> (its stored name, which part of it, the stored part); the text
  model's names start with `text_prefix`, the vision tower's are `layout`'s."""
  if path[0] == "vision":
    name, value = layout.to_hf(value, path[1:])
    return name, 0, value
  tensor = _hf_tensor(path)
  if tensor.in_dims is not None:
    lead = value.shape[:tensor.lead]
    inputs = int(np.prod(value.shape[tensor.lead:tensor.lead + tensor.in_dims]))
    value = np.swapaxes(value.reshape(lead + (inputs, -1)), -1, -2)
  return text_prefix + tensor.name, tensor.part[0], value


class _Family(NamedTuple):
  """How one transformers family's checkpoints map onto our parameters (paths unrolled)."""
  config_from_hf: Callable[[dict], config_dict.ConfigDict]
  config_to_hf: Callable[[config_dict.ConfigDict], dict]
  # A file's tensors -> (tensors by name below the model, names that belong nowhere).
  model_tensors: Callable[[Dict[str, np.ndarray]], Tuple[Dict[str, np.ndarray], list]]
  tensor_name: Callable[[Tuple[str, ...]], str]          # our path -> name below the model
  layer_of: Callable[[str], Optional[int]]   # a name below the model -> its layer, or None
  # (stored tensor, our path, our shape) -> our parameter, or why it does not fit.
  from_hf: Callable[[np.ndarray, Tuple[str, ...], Tuple[int, ...]], Union[np.ndarray, str]]
  # (our parameter, our path) -> (stored name, part index, stored part).
  to_hf: Callable[[np.ndarray, Tuple[str, ...]], Tuple[str, int, np.ndarray]]


def _gemma_tensor_name(path: Tuple[str, ...], layout: hf_tower.TowerLayout) -> str:
  if path[0] == "vision":
    return layout.tensor_name(path[1:])
  return _hf_tensor(path).name


def _gemma_layer_of(name: str) -> Optional[int]:
  match = re.match(r"layers\.(\d+)\.", name)
  return int(match.group(1)) if match else None


def _gemma_from_hf(value: np.ndarray, path: Tuple[str, ...], shape: Tuple[int, ...],
                   layout: hf_tower.TowerLayout):
  if path[0] == "vision":
    return layout.from_hf(value, path[1:], shape)
  return _from_hf(value, _hf_tensor(path), shape)


def _gemma_family(block_type: str, multimodal: bool) -> _Family:
  """Gemma 3's or Gemma 4's mapping, its vision tower's names included; a multimodal
  model saves as the family's ConditionalGeneration class, its text model below that
  class's prefix."""
  mapping, _, text_prefix = _VISION[block_type]
  layout = mapping.LAYOUT
  return _Family(
      config_from_hf=config_from_hf, config_to_hf=config_to_hf,
      model_tensors=functools.partial(_text_tensors, layout=layout),
      tensor_name=functools.partial(_gemma_tensor_name, layout=layout),
      layer_of=_gemma_layer_of,
      from_hf=functools.partial(_gemma_from_hf, layout=layout),
      to_hf=functools.partial(_to_hf, layout=layout,
                              text_prefix=text_prefix if multimodal else "model."))


def _family(block_type: str, multimodal: bool = False) -> _Family:
  """GPT-2's mapping (block type "gpt3") or Gemma's (text only, or with the vision
  tower)."""
  if block_type != "gpt3":
    return _gemma_family(block_type, multimodal)
  from gemma_jax import hf_gpt2  # pylint: disable=import-outside-toplevel  (it imports this module)
  return _Family(*(getattr(hf_gpt2, field) for field in _Family._fields))


def _unused_by_shared_layers(m: config_dict.ConfigDict) -> set:
  """Key/value weights a published Gemma 4 checkpoint holds for its shared key/value
  layers, which compute none (transformers skips them too)."""
  return {f"layers.{i}.self_attn.{name}.weight" for i, mode in enumerate(
      config_lib.kv_sharing_modes(m)) if mode == "reuse"
          for name in ("k_proj", "v_proj", "k_norm", "v_norm")}


def _unrolled_shapes(config: config_dict.ConfigDict) -> dict:
  """The model's parameter shapes, layers unrolled, without LoRA adapters: traced with
  the layers in a rolled scan (each period once; gemma3-27b 1.0 s instead of 3.3) and
  unstacked."""
  scanned = config_dict.ConfigDict(config.to_dict())
  scanned.model.update(scan_layers=True, scan_unroll="none")
  scanned.lora.rank = 0
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  shapes = jax.eval_shape(transform(scanned).init, jax.random.key(0), tokens)
  return jax.eval_shape(lambda params: unstack_layers(params, scanned.model), shapes)


def _misfits(what: str, missing: list, unexpected: list, mismatched: list) -> str:
  """The non-empty lists among these, as one message ("" when all are empty)."""
  return "; ".join(f"{kind}: {names}" for kind, names in (
      (f"missing {what}", missing), (f"unexpected {what}", unexpected),
      ("shape mismatches", mismatched)) if names)


def _check_params(config: config_dict.ConfigDict, flat: dict) -> None:
  """A CheckpointError naming each of the (unrolled) parameters `flat` that the config's
  model lacks, has no place for, or holds in another shape."""
  expected = flax.traverse_util.flatten_dict(_unrolled_shapes(config))
  missing = ["/".join(key) for key in expected if key not in flat]
  unexpected = sorted("/".join(key) for key in flat if key not in expected)
  mismatched = [f"{'/'.join(key)}: {np.shape(flat[key])} != expected {shape.shape}"
                for key, shape in expected.items()
                if key in flat and np.shape(flat[key]) != shape.shape]
  problems = _misfits("parameters", missing, unexpected, mismatched)
  if any(key[-1] in ("lora_a", "lora_b") for key in flat):
    problems += ("; LoRA adapters are saved merged: save lora.merge(config, params) with "
                 "lora.disabled(config)")
  if problems:
    raise CheckpointError(f"params do not fit config.model: {problems}")


def read_json_object(file: str) -> dict:
  """The JSON object in `file`; a CheckpointError naming the file if it is not a regular
  file, cannot be read, or holds anything else (objects and arrays nested deeper than
  `bounded_json.MAX_DEPTH` included)."""
  try:
    safetensors_io.regular_file_size(file)
    with open(file, "rb") as f:
      text = f.read()
  except OSError as error:
    raise CheckpointError(f"{file}: cannot be read ({error.strerror})") from None
  except ValueError as error:   # not a regular file
    raise CheckpointError(str(error)) from None
  try:
    value = bounded_json.loads(text)
  except bounded_json.NestedTooDeeply as error:
    raise CheckpointError(f"{file}: {error}") from None
  except ValueError as error:
    raise CheckpointError(f"{file}: not JSON ({error})") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{file}: not a JSON object")
  return value


def load_config(path: str, *, skip_audio: bool = False) -> config_dict.ConfigDict:
  """The config of the transformers directory `path` (from its config.json, and for a
  Gemma 4 image model the resize budget of its preprocessor_config.json, if there),
  validated, without reading any weights. A config with Gemma 4's audio tower is refused
  unless `skip_audio`."""
  file = os.path.join(path, "config.json")
  hf_config = read_json_object(file)
  if hf_config.get("model_type") == "gpt2":
    from gemma_jax import hf_gpt2  # pylint: disable=import-outside-toplevel  (it imports this module)
    config = hf_gpt2.config_from_hf(hf_config, file)
  else:
    config = config_from_hf(dict(hf_config, audio_config=None) if skip_audio else hf_config,
                            file)
    processor = _image_processor(path)
    if config.model.vision.enabled and config.model.block_type == "gemma4" and processor:
      processor_file, settings = processor
      try:
        config.model.vision.update(hf_gemma4_vision.processor_from_hf(
            settings, config.model.vision.to_dict()))
      except hf_fields.FieldError as error:
        raise CheckpointError(f"{processor_file}: {error}") from None
  try:
    return config_lib.validate(config)
  except config_lib.ConfigError as error:
    raise CheckpointError(f"{file}: describes a model gemma_jax does not build: "
                          f"{error}") from None


def _image_processor(path: str) -> Optional[Tuple[str, hf_fields.Section]]:
  """(the file, the image processor's settings) in transformers directory `path`, read
  where transformers reads them first: nested in processor_config.json (as transformers
  5 saves a processor), else preprocessor_config.json; None when neither has them."""
  nested = os.path.join(path, "processor_config.json")
  if os.path.exists(nested):
    settings = read_json_object(nested).get("image_processor")
    if isinstance(settings, dict):
      return nested, hf_fields.Section(settings, "image_processor.")
  flat = os.path.join(path, "preprocessor_config.json")
  return (flat, hf_fields.Section(read_json_object(flat))) if os.path.exists(flat) else None


def load(path: str, *, param_dtype: str = "float32", scan_layers: bool = True,
         shardings: Optional[dict] = None,
         skip_audio: bool = False) -> Tuple[config_dict.ConfigDict, dict]:
  """Reads a transformers save_pretrained directory -> (config, params).

  Args:
    path: directory with config.json and *.safetensors (sharded or not).
    param_dtype: dtype of the returned parameters (and config.model.param_dtype).
    scan_layers: parameter layout to return (config.model.scan_layers).
    shardings: a tree of shardings like the parameters' (e.g.
      `gemma_jax.sharding.param_shardings`): the parameters come back as jax.Arrays laid
      out by them, each device's part read from the memory-mapped files alone
      (`gemma_jax.sharded_read`). Default: whole host numpy arrays.
    skip_audio: read a Gemma 4 checkpoint with an audio tower without it (refused
      otherwise: the audio tower is not built yet).
  """
  config = load_config(path, skip_audio=skip_audio)
  config.model.param_dtype = param_dtype
  config.model.scan_layers = scan_layers
  config_lib.validate(config)

  family = _family(config.model.block_type)
  stored, files = _read_tensors(path)
  tensors, unexpected = family.model_tensors(stored)
  sources, _ = family.model_tensors(files)   # (it renames: each one's file, by that name)
  layers = len({family.layer_of(name) for name in tensors} - {None})
  if layers < config.model.num_layers:   # (found before the model is traced for them all)
    raise CheckpointError(f"{os.path.join(path, 'config.json')}: describes "
                          f"{config.model.num_layers} layers; the tensors hold {layers}")
  expected = flax.traverse_util.flatten_dict(_unrolled_shapes(config))
  scanned = {f"layers_{s.start + i}" for s in scan_segments(config.model)
             for i in range(s.count * len(config.model.attention_pattern))}
  params, missing, mismatched, used = {}, [], [], set()
  for key, shape in expected.items():
    name = family.tensor_name(key)
    if name not in tensors:
      missing += [] if name in missing else [name]
      continue
    used.add(name)
    if tensors[name].dtype not in safetensors_io.FLOATS:
      raise CheckpointError(f"{sources[name]}: tensor {name} holds "
                            f"{safetensors_io.NAMES[tensors[name].dtype]} values; the "
                            "model's weights are floats")
    value = family.from_hf(tensors[name], key, shape.shape)
    if isinstance(value, str):   # (said once for a tensor that holds two of ours)
      problem = f"{name}: {value}"
      mismatched += [] if problem in mismatched else [problem]
      continue
    # Read now (into the layout numpy keeps: the stored tensor's memory order) unless a
    # mesh reads it by parts or the scan stacks it: a stack reads its layers into place.
    later = shardings or key[0] in scanned
    params[key] = value if later else np.asarray(value, dtype=np.dtype(param_dtype))
  unexpected += sorted(set(tensors) - used - _unused_by_shared_layers(config.model))
  problems = _misfits("tensors", missing, unexpected, mismatched)
  if problems:
    raise CheckpointError(f"{path}: {problems}")
  views = stack_layers(flax.traverse_util.unflatten_dict(params), config.model,
                       stack_leaves=sharded_read.LayerStack)
  if shardings:
    return config, sharded_read.place(views, shardings, np.dtype(param_dtype))
  return config, jax.tree.map(lambda view: sharded_read.read(view, np.dtype(param_dtype)),
                              views, is_leaf=lambda x: isinstance(x, sharded_read.LayerStack))


def save(path: str, config: config_dict.ConfigDict, params: dict, *,
         write_extra: Optional[Callable[[str], None]] = None, overwrite: bool = False,
         source: Optional[str] = None) -> None:
  """Writes config.json and model.safetensors that transformers' from_pretrained reads
  (and, for a Gemma 4 image model, the preprocessor_config.json of its resize budget).
  `params` are the config's model's, LoRA adapters merged (`lora.merge`); parameters
  missing, unexpected or of another shape are a CheckpointError listing them.

  `write_extra(directory)`, if given, writes more files (tokenizer, generation config)
  into the new checkpoint before it is moved into place.

  The directory is written whole or not at all, and only where it is ours
  (`gemma_jax.checkpoints.directory`): `path` must be new, empty, or an earlier save of
  the same `source` (the workdir exported; None for a model saved here) holding nothing
  else; `overwrite` replaces anything else whole. A training workdir is never replaced.
  """
  directory.check_destination(path, directory.MODEL, source, overwrite)
  if config.model.block_type not in ("gemma3", "gemma4", "gpt3"):
    raise CheckpointError(f"config.model.block_type: transformers has no layout for "
                          f"{config.model.block_type!r}")
  if config.model.quant in quant.STORED_MODES:
    raise CheckpointError(f"config.model.quant: {config.model.quant!r} stores integer "
                          f"weights, transformers' checkpoints float ones: save the float "
                          f"weights it was quantized from, under quant.float_config(config)")
  family = _family(config.model.block_type, config.model.vision.enabled)
  hf_config = family.config_to_hf(config)
  flat = flax.traverse_util.flatten_dict(unstack_layers(params, config.model))
  _check_params(config, flat)
  parts = {}
  for key, value in flat.items():
    name, part, value = family.to_hf(np.asarray(jax.device_get(value)), key)
    parts.setdefault(name, {})[part] = value
  tensors = {name: np.concatenate([p[i] for i in sorted(p)], axis=-2) if len(p) > 1 else p[0]
             for name, p in parts.items()}

  def fill(staging):
    directory.write_json(os.path.join(staging, "config.json"), hf_config)
    safetensors_io.write(os.path.join(staging, "model.safetensors"), tensors)  # synced
    if config.model.vision.enabled and config.model.block_type == "gemma4":
      processor = hf_gemma4_vision.processor_to_hf(config.model.vision)
      directory.write_json(os.path.join(staging, "preprocessor_config.json"), processor)
      # The processor_config.json being replaced (with `overwrite`), whose nested image
      # processor transformers reads first, keeps its other settings with this budget.
      nested = os.path.join(path, "processor_config.json")
      if os.path.isfile(nested) and isinstance(
          read_json_object(nested).get("image_processor"), dict):
        earlier = read_json_object(nested)
        directory.write_json(os.path.join(staging, "processor_config.json"), dict(
            earlier, image_processor=dict(earlier["image_processor"], **processor)))
    if write_extra is not None:
      write_extra(staging)

  directory.write(path, fill, kind=directory.MODEL, source=source, overwrite=overwrite)
