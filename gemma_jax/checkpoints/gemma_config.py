"""Gemma 3 and Gemma 4 configs: transformers' config.json <-> our config.

    config = gemma_config.config_from_hf(json_dict, "path/config.json")
    json_dict = gemma_config.config_to_hf(config)   # CheckpointError: what it cannot say

Every value read is checked for its kind as it is read (`checkpoints.config_fields`), so a wrong
one is one error naming the file and field. Text-only models save as
`Gemma3ForCausalLM` / `Gemma4ForCausalLM`, image models as the family's
`ConditionalGeneration` class with the vision tower's config (`VISION`).
"""

import functools
import json
from typing import Tuple

from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints import config_fields
from gemma_jax.checkpoints import gemma3_tower
from gemma_jax.checkpoints import gemma4_tower
from gemma_jax.decoder import layer_types

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu",
                "relu": "relu"}
_ATTENTION_TYPES = {"sliding_attention": "local", "full_attention": "global"}
_HF_ATTENTION_TYPES = {v: k for k, v in _ATTENTION_TYPES.items()}
_ROPE_TYPES = config_fields.one_of(("default", "linear", "proportional"))
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


# What transformers' Gemma4TextConfig reads for the small models' keys a config.json
# leaves out.
_GEMMA4_DEFAULTS = {"hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
                    "num_kv_shared_layers": 0, "use_double_wide_mlp": False}
# Block type -> (the vision tower's names and config keys, the multimodal class, where its
# saved files keep the text model).
VISION = {"gemma3": (gemma3_tower, "Gemma3ForConditionalGeneration", "language_model.model."),
           "gemma4": (gemma4_tower, "Gemma4ForConditionalGeneration",
                      "model.language_model.")}


def _text_config(hf: config_fields.Section) -> Tuple[str, config_fields.Section]:
  """(model_type, the text model's section of a config.json, its family's defaults
  filled in)."""
  model_type = hf.read("model_type", config_fields.optional(config_fields.STRING), None)
  text = hf
  if model_type in _MULTIMODAL:
    text = hf.section("text_config")
    model_type = text.read("model_type", config_fields.STRING, _MULTIMODAL[model_type])
  if model_type not in _FAMILIES:
    raise config_fields.FieldError(
        f"unsupported {text.where}model_type {model_type!r}: this reader knows "
        f"{sorted([*_FAMILIES, *_MULTIMODAL, 'gpt2'])}")
  defaults = _GEMMA3_DEFAULTS if model_type == "gemma3_text" else _GEMMA4_DEFAULTS
  return model_type, config_fields.Section(text.values, text.where, defaults)


def _rope(text: config_fields.Section, layer_type: str,
          legacy_theta: str) -> Tuple[float, float, float]:
  """(base, linear scale, rotated fraction) of one layer type, from either config generation."""
  per_type = text.section("rope_parameters")
  if per_type.read(layer_type, config_fields.optional(config_fields.OBJECT), None) is not None:
    params = per_type.section(layer_type)
  elif layer_type == "full_attention":   # transformers 4: rope_theta and rope_scaling
    params = text.section("rope_scaling")
  else:   # transformers 4: rope_local_base_freq
    params = config_fields.Section({}, text.where)
  kind = params.read("rope_type" if "rope_type" in params else "type", _ROPE_TYPES, "default")
  scale = float(params.read("factor", config_fields.POSITIVE, 1.0)) if kind != "default" else 1.0
  fraction = float(params.read("partial_rotary_factor", config_fields.FRACTION, 1.0))
  if fraction != 1.0 and kind != "proportional":
    # transformers' Gemma rotates whole heads by cos and sin of the fraction's width:
    # such a checkpoint does not run there, and reading it as whole rotation is wrong.
    raise params.error("partial_rotary_factor", f"{fraction} with rope_type {kind!r}; only "
                       "'proportional' rotates part of a head")
  if "rope_theta" in params:
    return float(params.read("rope_theta", config_fields.POSITIVE)), scale, fraction
  return float(text.read(legacy_theta, config_fields.POSITIVE)), scale, fraction


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


def _global_override(text: config_fields.Section, global_layers: list) -> config_fields.Section:
  """The one override in transformers 5's per_layer_config (what differs, layer by layer),
  which must override every global layer alike and no other layer."""
  per_layer = text.section("per_layer_config")
  layers = {}
  for key in per_layer.keys():
    if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
      raise per_layer.error(key, "expected a layer index")
    layers[int(key)] = per_layer.section(key)
  empty = config_fields.Section({}, per_layer.where)
  override = layers.get(global_layers[0], empty) if global_layers else empty
  if set(layers) - set(global_layers) or any(
      layers.get(i, empty).values != override.values for i in global_layers):
    raise text.error("per_layer_config", "must override every global layer alike and no "
                     "other layer")
  extra = set(override.keys()) - {"head_dim", "num_key_value_heads"}
  if extra:
    raise text.error("per_layer_config", f"overrides {sorted(extra)}")
  return override


def _gemma4_fields(text: config_fields.Section, kinds) -> dict:
  """Our Gemma 4 model fields from its transformers text config."""
  optional = config_fields.optional
  bidirectional = text.read("use_bidirectional_attention", optional(config_fields.one_of(
      ["vision"])), None)
  global_layers = [i for i, kind in enumerate(kinds) if kind == "global"]
  k_eq_v = bool(text.read("attention_k_eq_v", optional(config_fields.FLAG), None))
  head_dim = text.read("head_dim", config_fields.POSITIVE_INT)
  kv_heads = text.read("num_key_value_heads", config_fields.POSITIVE_INT)
  if "per_layer_config" in text:
    override = _global_override(text, global_layers)
    head_dim = override.read("head_dim", config_fields.POSITIVE_INT, head_dim)
    kv_heads = override.read("num_key_value_heads", config_fields.POSITIVE_INT, kv_heads)
  else:   # the published form; transformers' defaults
    head_dim = text.read("global_head_dim", optional(config_fields.COUNT), 512) or head_dim
    kv_heads = (k_eq_v and text.read("num_global_key_value_heads",
                                     optional(config_fields.COUNT), None)) or kv_heads
  per_layer_dim = text.read("hidden_size_per_layer_input", optional(config_fields.COUNT)) or 0
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
      per_layer_vocab_size=(text.read("vocab_size_per_layer_input", config_fields.POSITIVE_INT)
                            if per_layer_dim else None),
      num_kv_shared_layers=text.read("num_kv_shared_layers", optional(config_fields.COUNT)) or 0,
      double_wide_mlp=bool(text.read("use_double_wide_mlp", optional(config_fields.FLAG))))
  if text.read("enable_moe_block", optional(config_fields.FLAG), None):
    fields.update({ours: text.read(key, config_fields.POSITIVE_INT) for ours, key in (
        ("num_experts", "num_experts"), ("experts_per_token", "top_k_experts"),
        ("expert_mlp_dim", "moe_intermediate_size"))})
  return fields


def config_from_hf(hf: dict, file: str = "config.json") -> config_dict.ConfigDict:
  """A transformers config.json (as a dict) -> our full config. Raises CheckpointError
  naming `file` and the first field that is missing, of the wrong kind or not supported."""
  try:
    return _read_config(config_fields.Section(hf))
  except config_fields.FieldError as error:
    raise CheckpointError(f"{file}: {error}") from None


def _read_config(hf: config_fields.Section) -> config_dict.ConfigDict:
  """config_from_hf's reading, field by field (FieldError naming the first bad one)."""
  model_type, text = _text_config(hf)
  block_type = _FAMILIES[model_type][0]
  for field, ok in (("attention_bias", False),) + (
      (("use_bidirectional_attention", False),) if block_type == "gemma3" else ()):
    if text.read(field, config_fields.FLAG, ok) != ok:
      raise text.error(field, f"only {json.dumps(ok)} is supported")
  tied = hf.read("tie_word_embeddings", config_fields.FLAG, True)
  if not text.read("tie_word_embeddings", config_fields.FLAG, tied):
    raise text.error("tie_word_embeddings", "false is not supported")
  n_layers = text.read("num_hidden_layers", config_fields.LAYER_COUNT)
  hf_types = text.read("layer_types", config_fields.optional(config_fields.STRINGS), None)
  if hf_types is None:   # transformers 4: every sliding_window_pattern-th layer is global
    period = text.read("sliding_window_pattern", config_fields.POSITIVE_INT, 6)
    hf_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                for i in range(n_layers)]
  unknown = sorted(set(hf_types) - set(_ATTENTION_TYPES))
  if unknown:
    raise config_fields.FieldError(f"{text.where}layer_types holds {unknown}, not one of "
                               f"{sorted(_ATTENTION_TYPES)}")
  if len(hf_types) != n_layers:
    raise text.error("layer_types", f"lists {len(hf_types)} layers; num_hidden_layers is "
                     f"{n_layers}")
  kinds = [_ATTENTION_TYPES[t] for t in hf_types]
  local = _rope(text, "sliding_attention", "rope_local_base_freq")
  global_ = _rope(text, "full_attention", "rope_theta")
  size = functools.partial(text.read, kind=config_fields.POSITIVE_INT)
  config = config_lib.default_config()
  config.model.update(dict(
      name="hf", block_type=block_type, vocab_size=size("vocab_size"),
      d_model=size("hidden_size"), num_layers=n_layers,
      num_heads=size("num_attention_heads"), num_kv_heads=size("num_key_value_heads"),
      head_dim=size("head_dim"), mlp_dim=size("intermediate_size"),
      activation=_ACTIVATIONS[text.read("hidden_activation", config_fields.one_of(_ACTIVATIONS))],
      attention_pattern=_pattern(kinds, last_exempt=block_type == "gemma4"),
      sliding_window=size("sliding_window"),
      rope_local_base=local[0], rope_local_scale=local[1], rope_local_fraction=local[2],
      rope_global_base=global_[0], rope_global_scale=global_[1],
      rope_global_fraction=global_[2],
      # transformers' Gemma 3 stores attn_logit_softcapping but never applies it;
      # we compute what it computes.
      attn_logit_softcap=None,
      final_logit_softcap=text.read("final_logit_softcapping",
                                    config_fields.optional(config_fields.POSITIVE), None),
      norm_eps=text.read("rms_norm_eps", config_fields.POSITIVE)))
  if block_type == "gemma3":
    config.model.query_pre_attn_scalar = float(text.read("query_pre_attn_scalar",
                                                         config_fields.POSITIVE))
  else:
    config.model.update(_gemma4_fields(text, kinds))
  if hf.read("audio_config", config_fields.optional(config_fields.OBJECT), None):
    raise hf.error("audio_config", "Gemma 4's audio tower is not read yet; "
                   "hf.load(..., skip_audio=True) reads the text and vision parts")
  if (hf.read("model_type", config_fields.STRING) in _MULTIMODAL
      and hf.read("vision_config", config_fields.optional(config_fields.OBJECT), None)):
    config.model.vision.update(VISION[block_type][0].config_from_hf(hf.values, _ACTIVATIONS))
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
  arch["vision"] = ({k: m.vision[k] for k in VISION[m.block_type][0].FIELDS}
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
    mapping, architecture, _ = VISION[m.block_type]
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
