"""transformers <-> gemma_jax: configs and weights in the published (safetensors) layout.

    config, params = gemma_jax.hf.load("path/to/save_pretrained_dir")
    gemma_jax.hf.save("out_dir", config, params)   # transformers' from_pretrained reads it

Reads `Gemma3ForCausalLM` checkpoints and the text part of
`Gemma3ForConditionalGeneration` ones (transformers 4 and 5 name layouts). Linear
weights are stored [out, in] there and [in..., out...] here; everything else is
copied. Parameters come back as host numpy arrays in the config's `param_dtype`.
"""

import json
import os
import re
import shutil
import tempfile
from typing import Dict, Tuple

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax import safetensors_io
from gemma_jax.decoder import stack_layers, unstack_layers
from gemma_jax.transformer import transform

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu",
                "relu": "relu"}
_ATTENTION_TYPES = {"sliding_attention": "local", "full_attention": "global"}

# Our parameter path (below one layer) -> (transformers name, contracted input dims
# for a linear weight, None for a vector copied as is).
_LAYER_NAMES = {
    ("attn", "q", "kernel"): ("self_attn.q_proj.weight", 1),
    ("attn", "k", "kernel"): ("self_attn.k_proj.weight", 1),
    ("attn", "v", "kernel"): ("self_attn.v_proj.weight", 1),
    ("attn", "out", "kernel"): ("self_attn.o_proj.weight", 2),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", None),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", 1),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", 1),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", 1),
    ("pre_attn_norm", "scale"): ("input_layernorm.weight", None),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", None),
    ("pre_mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", None),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", None),
}
_TOP_NAMES = {
    ("embed", "embedding"): ("embed_tokens.weight", None),
    ("final_norm", "scale"): ("norm.weight", None),
}
# Where the text model sits in each checkpoint layout, and what else may be there.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_OTHER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                   "multi_modal_projector.")
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


class CheckpointError(ValueError):
  """A checkpoint's tensors do not fit the model its config describes."""


def _hf_name(path: Tuple[str, ...]) -> Tuple[str, object]:
  """Our unrolled parameter path -> (transformers name below the text model, in_dims)."""
  match = re.fullmatch(r"layers_(\d+)", path[0])
  if match:
    name, in_dims = _LAYER_NAMES[path[1:]]
    return f"layers.{match.group(1)}.{name}", in_dims
  return _TOP_NAMES[path]


# ----------------------------------------------------------------------------- configs


def _text_config(hf: dict) -> dict:
  if hf.get("model_type") == "gemma3":
    return hf["text_config"]
  if hf.get("model_type") != "gemma3_text":
    raise CheckpointError(f"unsupported model_type {hf.get('model_type')!r}: this reader "
                          "knows gemma3_text and gemma3")
  return hf


def _rope(text: dict, layer_type: str, legacy_theta: str) -> Tuple[float, float]:
  """(base, linear scale) of one layer type, from either config generation."""
  params = (text.get("rope_parameters") or {}).get(layer_type)
  if params is None:  # transformers 4: rope_theta / rope_local_base_freq / rope_scaling
    params = {"rope_theta": text[legacy_theta], "rope_type": "default"}
    if layer_type == "full_attention" and text.get("rope_scaling"):
      params.update(text["rope_scaling"])
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ("default", "linear"):
    raise CheckpointError(f"rope_parameters[{layer_type}]: unsupported rope_type {kind!r}")
  return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def _pattern(layer_types) -> Tuple[str, ...]:
  """The shortest period that repeats to give every layer its type."""
  kinds = [_ATTENTION_TYPES[t] for t in layer_types]
  for period in range(1, len(kinds) + 1):
    if all(k == kinds[i % period] for i, k in enumerate(kinds)):
      return tuple(kinds[:period])
  raise AssertionError("unreachable: the full list is its own period")


def config_from_hf(hf: dict) -> config_dict.ConfigDict:
  """A transformers config.json (as a dict) -> our full config."""
  text = _text_config(hf)
  for field, ok in (("attention_bias", False), ("use_bidirectional_attention", False)):
    if text.get(field, ok) != ok:
      raise CheckpointError(f"config.json: {field}={text[field]} is not supported")
  if not text.get("tie_word_embeddings", hf.get("tie_word_embeddings", True)):
    raise CheckpointError("config.json: tie_word_embeddings=false is not supported")
  if text["hidden_activation"] not in _ACTIVATIONS:
    raise CheckpointError(f"config.json: unknown hidden_activation {text['hidden_activation']!r}")
  n_layers = text["num_hidden_layers"]
  layer_types = text.get("layer_types") or [
      "full_attention" if (i + 1) % text.get("sliding_window_pattern", 6) == 0
      else "sliding_attention" for i in range(n_layers)]
  local_base, local_scale = _rope(text, "sliding_attention", "rope_local_base_freq")
  global_base, global_scale = _rope(text, "full_attention", "rope_theta")
  config = config_lib.default_config()
  config.model.update(dict(
      name="hf", block_type="gemma3", vocab_size=text["vocab_size"],
      d_model=text["hidden_size"], num_layers=n_layers,
      num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
      head_dim=text["head_dim"], mlp_dim=text["intermediate_size"],
      activation=_ACTIVATIONS[text["hidden_activation"]],
      attention_pattern=_pattern(layer_types), sliding_window=text["sliding_window"],
      rope_local_base=local_base, rope_local_scale=local_scale,
      rope_global_base=global_base, rope_global_scale=global_scale,
      query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
      # transformers' Gemma 3 stores attn_logit_softcapping but never applies it;
      # we compute what it computes.
      attn_logit_softcap=None,
      final_logit_softcap=text.get("final_logit_softcapping"),
      norm_eps=text["rms_norm_eps"]))
  return config


def config_to_hf(config: config_dict.ConfigDict) -> dict:
  """Our config -> a transformers `Gemma3ForCausalLM` config.json dict."""
  m = config.model
  if m.block_type != "gemma3" or m.rope_local_fraction != 1.0 or m.rope_global_fraction != 1.0:
    raise CheckpointError("config.model: only Gemma 3 text models with full-width RoPE "
                          "have a transformers Gemma3ForCausalLM layout")
  if m.attn_logit_softcap is not None:
    raise CheckpointError("config.model.attn_logit_softcap: transformers' Gemma 3 does not "
                          "apply an attention soft cap, so it cannot represent this model")
  rope = lambda kind: {"rope_type": "linear" if m[f"rope_{kind}_scale"] != 1.0 else "default",
                       "rope_theta": m[f"rope_{kind}_base"],
                       **({"factor": m[f"rope_{kind}_scale"]}
                          if m[f"rope_{kind}_scale"] != 1.0 else {})}
  scalar = m.query_pre_attn_scalar or m.head_dim
  return {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
      "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
      "hidden_activation": {v: k for k, v in _ACTIVATIONS.items()}[m.activation],
      "layer_types": [{v: k for k, v in _ATTENTION_TYPES.items()}[
          m.attention_pattern[i % len(m.attention_pattern)]] for i in range(m.num_layers)],
      "sliding_window": m.sliding_window,
      "rope_parameters": {"sliding_attention": rope("local"), "full_attention": rope("global")},
      "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
      "final_logit_softcapping": m.final_logit_softcap,
      "rms_norm_eps": m.norm_eps, "tie_word_embeddings": True, "attention_bias": False,
      "dtype": m.param_dtype,
  }


# ----------------------------------------------------------------------------- weights


def _read_tensors(path: str) -> Dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = [name for name in sorted(os.listdir(path)) if name.endswith(".safetensors")]
  if not files:
    raise CheckpointError(f"{path}: no .safetensors files")
  tensors = {}
  for name in files:
    tensors.update(safetensors_io.read(os.path.join(path, name)))
  return tensors


def _text_tensors(tensors: Dict[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], list]:
  """Names below the text model -> tensors; plus the names that belong nowhere."""
  text, unexpected = {}, []
  for name, value in tensors.items():
    if name in _LM_HEADS or name.startswith(_OTHER_PREFIXES):
      continue
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
      unexpected.append(name)
    else:
      text[name[len(prefix):]] = value
  return text, unexpected


def _unrolled_shapes(config: config_dict.ConfigDict) -> dict:
  unrolled = config_dict.ConfigDict(config.to_dict())
  unrolled.model.scan_layers = False
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  return jax.eval_shape(transform(unrolled).init, jax.random.key(0), tokens)


def load(path: str, *, param_dtype: str = "float32",
         scan_layers: bool = True) -> Tuple[config_dict.ConfigDict, dict]:
  """Reads a transformers save_pretrained directory -> (config, params).

  Args:
    path: directory with config.json and *.safetensors (sharded or not).
    param_dtype: dtype of the returned parameters (and config.model.param_dtype).
    scan_layers: parameter layout to return (config.model.scan_layers).
  """
  with open(os.path.join(path, "config.json")) as f:
    hf_config = json.load(f)
  config = config_from_hf(hf_config)
  config.model.param_dtype = param_dtype
  config.model.scan_layers = scan_layers
  config_lib.validate(config)

  tensors, unexpected = _text_tensors(_read_tensors(path))
  expected = flax.traverse_util.flatten_dict(_unrolled_shapes(config))
  params, missing, mismatched = {}, [], []
  for key, shape in expected.items():
    name, in_dims = _hf_name(key)
    if name not in tensors:
      missing.append(name)
      continue
    value = tensors.pop(name)
    if in_dims is not None:
      if value.ndim != 2 or value.size != np.prod(shape.shape):
        mismatched.append(f"{name}: {value.shape} does not fit {shape.shape}")
        continue
      value = value.T.reshape(shape.shape)
    elif value.shape != shape.shape:
      mismatched.append(f"{name}: {value.shape} != expected {shape.shape}")
      continue
    params[key] = np.asarray(value, dtype=np.dtype(param_dtype))
  unexpected += sorted(tensors)
  problems = [f"missing tensors: {missing}" if missing else "",
              f"unexpected tensors: {unexpected}" if unexpected else "",
              f"shape mismatches: {mismatched}" if mismatched else ""]
  if any(problems):
    raise CheckpointError(f"{path}: " + "; ".join(p for p in problems if p))
  return config, stack_layers(flax.traverse_util.unflatten_dict(params), config.model)


def save(path: str, config: config_dict.ConfigDict, params: dict) -> None:
  """Writes config.json and model.safetensors that transformers' from_pretrained reads.

  The directory is written next to `path` and renamed into place when complete, so
  an existing checkpoint at `path` is only replaced by a whole one.
  """
  hf_config = config_to_hf(config)
  flat = flax.traverse_util.flatten_dict(unstack_layers(params, config.model))
  tensors = {}
  for key, value in flat.items():
    name, in_dims = _hf_name(key)
    value = np.asarray(jax.device_get(value))
    if in_dims is not None:
      value = value.reshape(int(np.prod(value.shape[:in_dims])), -1).T
    tensors["model." + name] = value
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".hf-save-", dir=parent)
  try:
    with open(os.path.join(staging, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2)
    safetensors_io.write(os.path.join(staging, "model.safetensors"), tensors)
    if os.path.exists(path):
      old = f"{staging}-old"
      os.rename(path, old)
      os.rename(staging, path)
      shutil.rmtree(old)
    else:
      os.rename(staging, path)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
