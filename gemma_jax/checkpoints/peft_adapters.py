"""gemma_jax LoRA adapters <-> peft LoRA directories (adapter_config.json and
adapter_model.safetensors), for transformers' Gemma 3 and Gemma 4 text models.

    peft_adapters.save("out/adapter", config, adapters)    # peft.PeftModel.from_pretrained reads it
    adapters = peft_adapters.load("out/adapter", config)   # a peft save_pretrained directory

peft stores, for each adapted projection (names as in `checkpoints.gemma`),
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] (a linear weight's [out, in] layout); ours are
lora_a [*I, r] and lora_b [r, *O] (`gemma_jax.lora`). The update is
(lora_alpha / r) B A in both. Adapters of the vision tower and GPT-2 are not mapped.
"""

import os
import re
from typing import Dict, Tuple

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import lora
from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints import directory
from gemma_jax.checkpoints import gemma
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.checkpoints.hf import read_json_object
from gemma_jax.decoder import stack_layers, unstack_layers

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."   # peft's wrapper around the causal LM
_HF_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}
# adapter_config.json keys whose other values change the function or the layout:
# {key: the values this mapping implements (a missing key reads as the first)}.
_REQUIRED = {
    "peft_type": ("LORA",), "use_rslora": (False,), "use_dora": (False,),
    "fan_in_fan_out": (False,), "bias": ("none",), "lora_bias": (False,),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "modules_to_save": (None, []),
    "layer_replication": (None,), "trainable_token_indices": (None,),
    "target_parameters": (None, []),
}


def _check_family(config: config_dict.ConfigDict) -> None:
  if config.model.block_type not in ("gemma3", "gemma4"):
    raise CheckpointError(f"config.model.block_type: no peft mapping for "
                          f"{config.model.block_type!r} (Gemma 3 and Gemma 4 only)")


def _hf_module(path: Tuple[str, ...]) -> Tuple[str, int]:
  """Our unrolled adapter path -> (transformers' module name below the text model,
  e.g. "layers.0.self_attn.q_proj"; the kernel's contracted dims)."""
  kernel = path[:-1] + ("kernel",)
  try:
    tensor = gemma.stored_tensor(kernel)
  except KeyError:
    tensor = None
  if tensor is None or tensor.in_dims is None or tensor.lead or tensor.part != (0, 1):
    raise CheckpointError(f"config.lora.targets: {'/'.join(kernel)} has no transformers "
                          f"linear module to carry a peft adapter")
  return tensor.name[:-len(".weight")], tensor.in_dims


def _key(path: Tuple[str, ...]) -> str:
  """Our unrolled adapter path -> its tensor name in adapter_model.safetensors."""
  module, _ = _hf_module(path)
  return f"{_PREFIX}model.{module}.{_HF_NAMES[path[-1]]}.weight"


def _target_modules(modules, num_layers: int):
  """peft's target_modules for exactly `modules` (names below the text model): the
  projection names when every layer has the same ones and nothing outside the layers is
  adapted, else a regex of the full names."""
  kinds = {m.split(".", 2)[2] for m in modules if m.startswith("layers.")}
  if set(modules) == {f"layers.{i}.{kind}" for i in range(num_layers) for kind in kinds}:
    return sorted({kind.rsplit(".", 1)[-1] for kind in kinds})
  return "|".join(re.escape(f"model.{m}") for m in sorted(modules))


def save(path: str, config: config_dict.ConfigDict, adapters: dict,
         base_model_name_or_path: str = None, *, overwrite: bool = False,
         source: str = None) -> None:
  """Writes `adapters` (`lora.split`'s, in the config's layout) as a peft LoRA directory
  for the model `gemma_jax.hf.save(..., config, ...)` writes, whole or not at all and
  only where it is ours, as `hf.save` writes (`overwrite` and `source` as there)."""
  _check_family(config)
  if config.model.vision.enabled:
    raise CheckpointError("config.model.vision.enabled: peft adapters are mapped for "
                          "text-only models (Gemma3ForCausalLM, Gemma4ForCausalLM)")
  directory.check_destination(path, directory.ADAPTERS, source, overwrite)
  flat = flax.traverse_util.flatten_dict(unstack_layers(adapters, config.model))
  tensors, modules = {}, set()
  for key, value in flat.items():
    value = np.asarray(jax.device_get(value))
    if key[-1] == "lora_a":   # [*I, r] -> [r, in], as the kernel [*I, *O] -> [out, in]
      value = gemma.tensor_to_hf(value, key[:-1] + ("kernel",))[2]
    else:                     # [r, *O] -> [out, r]
      value = value.reshape(value.shape[0], -1).T
    tensors[_key(key)] = value
    modules.add(_hf_module(key)[0])
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora.rank,
      "lora_alpha": config.lora.alpha, "lora_dropout": config.lora.dropout,
      "target_modules": _target_modules(modules, config.model.num_layers),
      "base_model_name_or_path": base_model_name_or_path, "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True}

  def fill(staging):
    safetensors_io.write(os.path.join(staging, WEIGHTS_FILE), tensors)
    directory.write_json(os.path.join(staging, CONFIG_FILE), adapter_config)

  # Whole or not at all: new adapters beside an old adapter_config.json (another alpha)
  # would load as good.
  directory.write(path, fill, kind=directory.ADAPTERS, source=source, overwrite=overwrite)


def _read_config(path: str, config: config_dict.ConfigDict) -> None:
  """Checks adapter_config.json against config.lora and what this mapping implements."""
  file = os.path.join(path, CONFIG_FILE)
  peft_config = read_json_object(file)
  for key, allowed in _REQUIRED.items():
    if peft_config.get(key, allowed[0]) not in allowed:
      raise CheckpointError(f"{file}: {key}={peft_config[key]!r} is not supported "
                            f"(only {allowed[0]!r})")
  for key, field in (("r", "rank"), ("lora_alpha", "alpha")):
    if key not in peft_config:
      raise CheckpointError(f"{file}: {key} is missing")
    if peft_config[key] != config.lora[field]:
      raise CheckpointError(f"{file}: {key}={peft_config[key]!r}, but config.lora.{field}="
                            f"{config.lora[field]!r}; set it to match")


def _text_name(name: str) -> str:
  """A stored adapter tensor name -> its name below the text model (unchanged when it
  has none of the known prefixes)."""
  if not name.startswith(_PREFIX):
    return name
  rest = name[len(_PREFIX):]
  prefix = next((p for p in gemma.TEXT_PREFIXES if rest.startswith(p)), "")
  return rest[len(prefix):]


def load(path: str, config: config_dict.ConfigDict) -> dict:
  """Reads a peft LoRA directory -> adapters in the config's layout and param_dtype,
  for `lora.combine` with the base model's parameters.

  Raises:
    CheckpointError: naming the file and key when the directory's rank, alpha,
      adapted modules or shapes do not fit config.lora, or it uses a peft option this
      mapping does not implement (rsLoRA, DoRA, biases, per-module ranks, ...).
  """
  _check_family(config)
  _read_config(path, config)
  file = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(file):
    raise CheckpointError(f"{file}: missing (only safetensors adapters are read)")
  try:
    stored = {_text_name(k): v for k, v in safetensors_io.read(file).items()}
  except ValueError as error:
    raise CheckpointError(str(error)) from None
  unrolled = config_dict.ConfigDict(config.to_dict())
  unrolled.model.scan_layers = False
  expected = flax.traverse_util.flatten_dict(lora.adapter_shapes(unrolled))
  adapters: Dict[Tuple[str, ...], np.ndarray] = {}
  for path, shape in expected.items():
    module, in_dims = _hf_module(path)
    name = f"{module}.{_HF_NAMES[path[-1]]}.weight"
    if name not in stored:
      raise CheckpointError(f"{file}: no tensor for {name}, which config.lora.targets "
                            f"adapts ({'/'.join(path[:-1])})")
    tensor = gemma.Tensor(name, in_dims if path[-1] == "lora_a" else 1)
    value = gemma.tensor_from_hf(stored.pop(name), tensor, shape.shape)
    if isinstance(value, str):
      raise CheckpointError(f"{file}: {name} {value}")
    adapters[path] = np.asarray(value, dtype=np.dtype(config.model.param_dtype))
  if stored:
    raise CheckpointError(f"{file}: {sorted(stored)[0]} (and {len(stored) - 1} more) are "
                          f"adapters config.lora.targets does not give the model")
  return stack_layers(flax.traverse_util.unflatten_dict(adapters), config.model)
