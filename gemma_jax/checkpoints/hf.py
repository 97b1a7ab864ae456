"""transformers <-> gemma_jax: configs and weights in the published (safetensors) layout.

    config, params = gemma_jax.hf.load("path/to/save_pretrained_dir")
    gemma_jax.hf.save("out_dir", config, params)   # transformers' from_pretrained reads it

Reads `Gemma3ForCausalLM` and `Gemma4ForCausalLM` checkpoints (Gemma 4 dense,
mixture-of-experts and the small models), and `Gemma3ForConditionalGeneration` and
`Gemma4ForConditionalGeneration` ones whole, vision tower included (a model with
`vision.enabled` saves as one; Gemma 4's audio tower is refused unless `skip_audio`),
transformers 4 and 5 name layouts; GPT-2 checkpoints (`GPT2LMHeadModel`, `GPT2Model`)
load into the GPT-3 block and a GPT-3 model saves as one. Each family's names and config
keys are its module's (`gemma`, `gemma_config`, `gpt2`); this module reads and writes
through them. Parameters come back as host numpy arrays in the config's `param_dtype`,
or straight onto a mesh (`load(..., shardings=...)`, each device's part read alone).
"""

import os
from typing import Callable, Dict, Optional, Tuple

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax import quant
from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints import bounded_json
from gemma_jax.checkpoints import directory
from gemma_jax.checkpoints import config_fields
from gemma_jax.checkpoints import gemma
from gemma_jax.checkpoints import gemma4_tower
from gemma_jax.checkpoints import gemma_config
from gemma_jax.checkpoints import gpt2
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.checkpoints import sharded_read
from gemma_jax.checkpoints.family import Family
from gemma_jax.decoder import scan_segments, stack_layers, unstack_layers
from gemma_jax.transformer import transform


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
      raise CheckpointError(f"{index}: weight_map names {config_fields.shown(name)} for "
                            f"{config_fields.shown(tensor)}, which is not a file inside "
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


def _family(block_type: str, multimodal: bool = False) -> Family:
  """GPT-2's mapping (block type "gpt3") or Gemma's (text only, or with the vision
  tower)."""
  return gpt2.FAMILY if block_type == "gpt3" else gemma.family(block_type, multimodal)


def _unrolled_shapes(config: config_dict.ConfigDict) -> dict:
  """The model's parameter shapes, layers unrolled, without LoRA adapters: traced with
  the layers in a rolled scan (each period traced once, not each layer) and
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
    config = gpt2.config_from_hf(hf_config, file)
  else:
    config = gemma_config.config_from_hf(
        dict(hf_config, audio_config=None) if skip_audio else hf_config, file)
    processor = _image_processor(path)
    if config.model.vision.enabled and config.model.block_type == "gemma4" and processor:
      processor_file, settings = processor
      try:
        config.model.vision.update(gemma4_tower.processor_from_hf(
            settings, config.model.vision.to_dict()))
      except config_fields.FieldError as error:
        raise CheckpointError(f"{processor_file}: {error}") from None
  try:
    return config_lib.validate(config)
  except config_lib.ConfigError as error:
    raise CheckpointError(f"{file}: describes a model gemma_jax does not build: "
                          f"{error}") from None


def _image_processor(path: str) -> Optional[Tuple[str, config_fields.Section]]:
  """(the file, the image processor's settings) in transformers directory `path`, read
  where transformers reads them first: nested in processor_config.json (as transformers
  5 saves a processor), else preprocessor_config.json; None when neither has them."""
  nested = os.path.join(path, "processor_config.json")
  if os.path.exists(nested):
    settings = read_json_object(nested).get("image_processor")
    if isinstance(settings, dict):
      return nested, config_fields.Section(settings, "image_processor.")
  flat = os.path.join(path, "preprocessor_config.json")
  return (flat, config_fields.Section(read_json_object(flat))) if os.path.exists(flat) else None


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
      (`checkpoints.sharded_read`). Default: whole host numpy arrays.
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
  unexpected += sorted(set(tensors) - used - family.unused_tensors(config.model))
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
      processor = gemma4_tower.processor_to_hf(config.model.vision)
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
