"""transformers' GPT-2 layout <-> the GPT-3 block: the config and every tensor's name.

GPT-2 is the GPT-3 layer (LayerNorm with bias, fused biased QKV, no RoPE, learned
positions, plain GELU MLP, tied logits) with num_heads * head_dim = d_model. Its
Conv1D weights are stored [in, out], so ours ([in..., out...]) are reshapes of them;
a LayerNorm weight w is 1 + our zero-based scale. Names below `transformer.`:

    wte.weight  wpe.weight  ln_f.{weight,bias}
    h.{i}.ln_1.{weight,bias}  h.{i}.attn.c_attn.{weight,bias}  h.{i}.attn.c_proj.{weight,bias}
    h.{i}.ln_2.{weight,bias}  h.{i}.mlp.c_fc.{weight,bias}     h.{i}.mlp.c_proj.{weight,bias}

`gemma_jax.hf.load` / `save` read and write through `FAMILY` for `model_type` "gpt2" and for
`block_type` "gpt3".
"""

import json
import math
import re
from typing import Dict, Optional, Tuple, Union

import numpy as np
from ml_collections import config_dict

from gemma_jax import presets
from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints import config_fields
from gemma_jax.checkpoints.family import Family
from gemma_jax.decoder import layer_types

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu", "silu": "silu"}
_HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
# transformers config fields whose other values this model does not compute.
_UNSUPPORTED = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                ("add_cross_attention", False), ("tie_word_embeddings", True))
# Our model fields GPT2LMHeadModel fixes, with the value it needs.
_FIXED_FIELDS = (("fused_qkv", True), ("use_post_attn_norm", False),
                 ("use_post_ffw_norm", False), ("scale_embeddings", False),
                 ("sinusoidal_position_embedding", False), ("logits_via_embedding", True),
                 ("attn_logit_softcap", None), ("final_logit_softcap", None))

# Our path below one layer -> its name below "h.{i}.".
_LAYER_NAMES = {
    ("pre_attn_norm", "scale"): "ln_1.weight",
    ("pre_attn_norm", "bias"): "ln_1.bias",
    ("attn", "qkv", "kernel"): "attn.c_attn.weight",
    ("attn", "qkv", "bias"): "attn.c_attn.bias",
    ("attn", "out", "kernel"): "attn.c_proj.weight",
    ("attn", "out", "bias"): "attn.c_proj.bias",
    ("pre_mlp_norm", "scale"): "ln_2.weight",
    ("pre_mlp_norm", "bias"): "ln_2.bias",
    ("mlp", "up", "kernel"): "mlp.c_fc.weight",
    ("mlp", "up", "bias"): "mlp.c_fc.bias",
    ("mlp", "down", "kernel"): "mlp.c_proj.weight",
    ("mlp", "down", "bias"): "mlp.c_proj.bias",
}
_TOP_NAMES = {
    ("embed", "embedding"): "wte.weight",
    ("position_embed", "embedding"): "wpe.weight",
    ("final_norm", "scale"): "ln_f.weight",
    ("final_norm", "bias"): "ln_f.bias",
}
_PREFIX = "transformer."
# Tied to wte, or causal-mask buffers of old checkpoints: nothing of ours.
_SKIPPED = re.compile(r"lm_head\.weight|h\.\d+\.attn\.(masked_)?bias")


def config_from_hf(hf: dict, file: str = "config.json") -> config_dict.ConfigDict:
  """A GPT-2 config.json (as a dict) -> our full config (the gpt3 presets' options).
  Raises CheckpointError naming `file` and the first field that is missing, of the wrong
  kind or not supported."""
  fields = config_fields.Section(hf)
  try:
    for field, ok in _UNSUPPORTED:
      if fields.read(field, config_fields.FLAG, ok) != ok:
        raise fields.error(field, f"only {json.dumps(ok)} is supported")
    activation = fields.read("activation_function", config_fields.one_of(_ACTIVATIONS), "gelu_new")
    d, n = (fields.read(key, config_fields.POSITIVE_INT) for key in ("n_embd", "n_head"))
    if d % n:
      raise fields.error("n_head", f"{n} does not divide n_embd={d}")
    positions = fields.read("n_positions", config_fields.POSITIVE_INT)
    config = presets.get_config("gpt3-52k")
    config.model.update(dict(
        name="hf", vocab_size=fields.read("vocab_size", config_fields.POSITIVE_INT), d_model=d,
        num_layers=fields.read("n_layer", config_fields.LAYER_COUNT), num_heads=n,
        num_kv_heads=n, head_dim=d // n,
        mlp_dim=fields.read("n_inner", config_fields.optional(config_fields.POSITIVE_INT),
                            None) or 4 * d,
        activation=_ACTIVATIONS[activation],
        norm_eps=fields.read("layer_norm_epsilon", config_fields.POSITIVE, 1e-5),
        trainable_position_size=positions))
  except config_fields.FieldError as error:
    raise CheckpointError(f"{file}: {error}") from None
  # Training rows must fit the position table.
  config.data.seq_len = min(config.data.seq_len, positions)
  return config


def config_to_hf(config: config_dict.ConfigDict) -> dict:
  """Our GPT-3 config -> a `GPT2LMHeadModel` config.json dict; CheckpointError naming the
  first model field GPT-2 cannot represent."""
  m = config.model
  if m.d_model % m.num_heads:
    raise CheckpointError(f"config.model.num_heads: GPT2LMHeadModel splits d_model="
                          f"{m.d_model} into equal heads, which {m.num_heads} do not")
  needs = _FIXED_FIELDS + (("head_dim", m.d_model // m.num_heads),)
  for field, value in needs:
    if m[field] != value:
      raise CheckpointError(f"config.model.{field}: GPT2LMHeadModel needs {value!r}, got "
                            f"{m[field]!r}")
  if "local" in layer_types(m):
    raise CheckpointError(f"config.model.attention_pattern: GPT2LMHeadModel attends "
                          f"globally on every layer, got {tuple(m.attention_pattern)!r}")
  if not m.trainable_position_size:
    raise CheckpointError("config.model.trainable_position_size: GPT2LMHeadModel needs "
                          "learned positions")
  if m.activation not in _HF_ACTIVATIONS:
    raise CheckpointError(f"config.model.activation: GPT-2 has no {m.activation!r}")
  return {
      "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
      "vocab_size": m.vocab_size, "n_embd": m.d_model, "n_layer": m.num_layers,
      "n_head": m.num_heads, "n_inner": m.mlp_dim, "n_positions": m.trainable_position_size,
      "activation_function": _HF_ACTIVATIONS[m.activation], "layer_norm_epsilon": m.norm_eps,
      "scale_attn_weights": True, "tie_word_embeddings": True, "dtype": m.param_dtype,
  }


def model_tensors(tensors: Dict[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], list]:
  """A file's tensors -> (tensors by name below `transformer.`, names that belong nowhere)."""
  below = {}
  for name, value in tensors.items():
    name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    if not _SKIPPED.fullmatch(name):
      below[name] = value
  return below, []


def tensor_name(path: Tuple[str, ...]) -> str:
  """Our unrolled parameter path -> the GPT-2 name below `transformer.`."""
  match = re.fullmatch(r"layers_(\d+)", path[0])
  if match:
    return f"h.{match.group(1)}.{_LAYER_NAMES[path[1:]]}"
  return _TOP_NAMES[path]


def layer_of(name: str) -> Optional[int]:
  """A tensor name below `transformer.` -> the layer it is in (None outside the layers)."""
  match = re.match(r"h\.(\d+)\.", name)
  return int(match.group(1)) if match else None


def _stored_shape(path: Tuple[str, ...], shape: Tuple[int, ...]) -> Tuple[int, ...]:
  """Our parameter's shape -> GPT-2's: kernels and tables [in, out], vectors flat."""
  if len(shape) == 1 or path[-1] == "bias":
    return (math.prod(shape),)
  in_dims = 2 if path[-2:] == ("out", "kernel") else 1     # [N, H, D] -> [N * H, D]
  return (math.prod(shape[:in_dims]), math.prod(shape[in_dims:]))


def _offset(path: Tuple[str, ...]) -> float:
  """GPT-2 stores a LayerNorm weight as 1 + our scale."""
  return 1.0 if path[-1] == "scale" else 0.0


def from_hf(value: np.ndarray, path: Tuple[str, ...],
            shape: Tuple[int, ...]) -> Union[np.ndarray, str]:
  """A stored tensor -> our parameter of `shape` (a view of it but for LayerNorm
  scales), or why it does not fit."""
  stored = _stored_shape(path, shape)
  if value.shape != stored:
    return f"{value.shape} != expected {stored}"
  ours = value.reshape(shape)
  return ours - np.asarray(_offset(path), value.dtype) if _offset(path) else ours


def to_hf(value: np.ndarray, path: Tuple[str, ...]) -> Tuple[str, int, np.ndarray]:
  """Our parameter -> (its stored name, part 0, the stored tensor)."""
  stored = value.reshape(_stored_shape(path, value.shape))
  return _PREFIX + tensor_name(path), 0, stored + np.asarray(_offset(path), value.dtype)


# The mapping gemma_jax.checkpoints.hf reads and writes GPT-2 checkpoints with; GPT-2's
# checkpoints hold nothing the model leaves unused (the attention biases are buffers).
FAMILY = Family(config_from_hf, config_to_hf, model_tensors, tensor_name, layer_of, from_hf,
                to_hf, unused_tensors=lambda model: set())
