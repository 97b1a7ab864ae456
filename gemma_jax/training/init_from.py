"""Starting a run from published or trained weights (`config.train.init_from`), and
reading a workdir's weights back (`load_model`: what the apps run).

A run that starts from a checkpoint takes its model section from it: a transformers
save_pretrained directory (`gemma_jax.hf`) or a training workdir. The compute options
below may still be set; any other model field set to a value the checkpoint contradicts
is a ConfigError naming it.
"""

import os
from typing import Any, Collection, NamedTuple, Optional, Tuple

import jax
from ml_collections import config_dict

from gemma_jax import hf, lora, quant, sharding, transformer
from gemma_jax.config import ConfigError
from gemma_jax.text import tokenizers
from gemma_jax.training import checkpoints, optimizer, steps
from gemma_jax.training import workdir as workdir_lib

# Model fields that change how the model is computed, not what it computes.
COMPUTE_FIELDS = ("name", "dtype", "param_dtype", "scan_layers", "scan_unroll", "remat_policy",
                  "attention_kernel", "moe_dispatch", "dropout_rate",
                  "record_internal_nn_metrics", "cast_logits_to_float32",
                  "load_balance_loss_weight", "router_z_loss_weight", "quant",
                  "quant_group_size", "quant_logits")


def _kind(path: str) -> str:
  """"workdir" or "hf"; a ConfigError naming train.init_from for anything else."""
  if workdir_lib.is_workdir(path):
    return "workdir"
  if os.path.isfile(os.path.join(path, "config.json")):
    return "hf"
  if not os.path.isdir(path):
    raise ConfigError("train.init_from", f"{path!r}: no such directory")
  if os.path.isfile(os.path.join(path, "adapter_config.json")):
    raise ConfigError("train.init_from", f"{path!r} holds peft adapters, not a model: start "
                      "from their base (adapter_config.json's base_model_name_or_path)")
  raise ConfigError("train.init_from", f"{path!r} is neither a transformers directory "
                    "(config.json and *.safetensors) nor a training workdir (config.json and "
                    "checkpoints/)")


def checkpoint_model(path: str) -> config_dict.ConfigDict:
  """The model section of the checkpoint at `path` (adapters, if any, count as merged)."""
  if _kind(path) == "workdir":
    return workdir_lib.load_config(path).model
  try:
    # The apps feed text and images only: Gemma 4's audio tower is left out.
    return hf.load_config(path, skip_audio=True).model
  except hf.CheckpointError as error:
    raise ConfigError("train.init_from", str(error)) from None


def resolve(config: config_dict.ConfigDict,
            overridden: Collection[str] = ()) -> config_dict.ConfigDict:
  """The config with its model section taken from `config.train.init_from` (when set),
  keeping the config's COMPUTE_FIELDS.

  Args:
    overridden: model field names the user set explicitly (e.g. as
      --config.model.<name> flags); one that is no compute option and differs from the
      checkpoint is a ConfigError naming it.
  """
  path = config.train.init_from
  if not path:
    return config
  source = checkpoint_model(path)
  for field in overridden:
    if field not in COMPUTE_FIELDS and config.model[field] != source[field]:
      raise ConfigError(f"model.{field}", f"{config.model[field]!r} contradicts the checkpoint "
                        f"{path} ({source[field]!r}); from a checkpoint only the compute "
                        f"options may be set: {', '.join(COMPUTE_FIELDS[1:])}")
  resolved = config_dict.ConfigDict(config.to_dict())
  resolved.model = config_dict.ConfigDict(source.to_dict())
  for field in COMPUTE_FIELDS:
    resolved.model[field] = config.model[field]
  resolved.train.init_from = os.path.abspath(path)
  resolved.train.init_from_step = _base_step(path, config.train.init_from_step)
  return workdir_lib.config_from_dict(resolved.to_dict())


def _base_step(path: str, step: Optional[int]) -> Optional[int]:
  """The step of workdir `path` to start from: `step`, which it must hold, else its
  latest; None for a transformers directory, which must not be given one."""
  if _kind(path) != "workdir":
    if step is not None:
      raise ConfigError("train.init_from_step", f"{step} names a step of a workdir's "
                        f"checkpoints; {path} is a transformers directory")
    return None
  checkpointer = checkpoints.Checkpointer(workdir_lib.checkpoint_dir(path), 1)
  try:
    kept = checkpointer.all_steps()
  finally:
    checkpointer.close()
  if not kept:
    raise ConfigError("train.init_from", f"{path} has no checkpoint yet")
  if step is not None and step not in kept:
    raise ConfigError("train.init_from_step", f"{path} holds the checkpoints of steps "
                      f"{', '.join(map(str, kept))}, not of step {step}")
  return kept[-1] if step is None else step


def restore_params(config: config_dict.ConfigDict, workdir: str,
                   mesh: Optional[jax.sharding.Mesh] = None, step: Optional[int] = None):
  """The parameters of a workdir's checkpoint of `step` (default: the latest) as trained
  (with LoRA, the adapters alone): on the default device, or laid out on `mesh` by the
  sharding rules (each host restoring its own shards)."""
  model = transformer.transform(config)
  tx = optimizer.make_optimizer(
      config.optimizer, optimizer.learning_rate_schedule(config.optimizer, config.train.steps))
  abstract = jax.eval_shape(lambda: steps.init_state(
      model, tx, config.seed, config.data.seq_len, trained=steps.trained_part(config)))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  else:
    shardings = steps.state_shardings(config, tx, abstract, mesh)
  like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)
  directory = workdir_lib.checkpoint_dir(workdir)
  checkpointer = checkpoints.Checkpointer(directory, config.checkpoint.keep)
  try:
    if checkpointer.latest_step() is None:
      raise workdir_lib.WorkdirError(f"{workdir}: no checkpoint in {directory} yet")
    if step is not None and step not in checkpointer.all_steps():
      raise workdir_lib.WorkdirError(
          f"{workdir}: no checkpoint of step {step} in {directory} (kept: "
          f"{', '.join(map(str, checkpointer.all_steps()))}); a run over it needs that step")
    state, _ = checkpointer.restore(like, step)
  finally:
    checkpointer.close()
  return state.params


def base_params(config: config_dict.ConfigDict,
                mesh: Optional[jax.sharding.Mesh] = None) -> dict:
  """The weights `config.train.init_from` names, whole (a LoRA workdir's adapters merged),
  in the config's layout and param_dtype: host arrays, or laid out on `mesh` by the
  sharding rules, each host reading only what its devices hold (from a transformers
  directory's memory-mapped files, or a workdir's checkpoint). With a stored-weight
  `model.quant` (QLoRA's base) they are read in float and quantized."""
  if config.model.quant in quant.STORED_MODES:
    float_config = quant.float_config(config)
    quantized = quant.quantize(float_config, base_params(float_config, mesh),
                               config.model.quant)[1]
    if mesh is None:
      return quantized
    return jax.device_put(quantized, sharding.param_shardings(lora.disabled(config), mesh))
  path = config.train.init_from
  shardings = None if mesh is None else sharding.param_shardings(lora.disabled(config), mesh)
  if _kind(path) == "workdir":
    # A QLoRA workdir's adapters merge into the float weights its base was quantized
    # from, as its export does: the new run quantizes them again if it asks to.
    source = quant.float_config(workdir_lib.load_config(path))
    _, params = merged(source, path, mesh, config.train.init_from_step)
  else:
    try:
      _, params = hf.load(path, param_dtype=config.model.param_dtype,
                          scan_layers=config.model.scan_layers, shardings=shardings,
                          skip_audio=True)
    except hf.CheckpointError as error:
      raise ConfigError("train.init_from", str(error)) from None
  params = jax.tree.map(lambda a: a.astype(config.model.param_dtype), params)
  return params if shardings is None else jax.device_put(params, shardings)


def merged(config: config_dict.ConfigDict, workdir: str,
           mesh: Optional[jax.sharding.Mesh] = None,
           step: Optional[int] = None) -> Tuple[config_dict.ConfigDict, dict]:
  """(config, params) of a workdir's checkpoint of `step` (default: the latest) as one
  model: a LoRA run's adapters merged into the base it started from (its
  train.init_from at train.init_from_step; lora.rank 0 in the config); on the default
  device, or laid out on `mesh`. Over a quantized base (QLoRA) the adapters stay beside
  it, unmerged, as they were trained."""
  trained = restore_params(config, workdir, mesh, step)
  if not config.lora.rank:
    return config, trained
  base = base_params(config, mesh)
  if config.model.quant in quant.STORED_MODES:
    return config, lora.combine(base, trained)
  return lora.disabled(config), lora.merge(config, lora.combine(base, trained))


class Loaded(NamedTuple):
  """What an app needs of a model: its config, parameters and tokenizer."""
  config: config_dict.ConfigDict
  params: Any
  tokenizer: Any


def load_model(*, workdir: Optional[str] = None, hf_dir: Optional[str] = None,
               tokenizer: Optional[str] = None) -> Loaded:
  """A workdir's latest checkpoint (LoRA adapters merged into their base) or a
  transformers directory, with its tokenizer ("byte", a file or a directory; default:
  the workdir config's data.tokenizer, or the transformers directory's own files)."""
  error = workdir_lib.WorkdirError
  if (workdir is None) == (hf_dir is None):
    raise error("give exactly one of a workdir and a transformers directory")
  if hf_dir is not None and workdir_lib.is_workdir(hf_dir):
    raise error(f"{hf_dir} is a training workdir, not a transformers directory: load it as "
                "workdir= (--workdir)")
  if workdir is not None and not workdir_lib.is_workdir(workdir) and os.path.isfile(
      os.path.join(workdir, workdir_lib.CONFIG_FILE)):
    raise error(f"{workdir} is no training workdir (a transformers directory?): load it as "
                "hf_dir= (--hf_dir)")
  if workdir is not None:
    config, params = merged(workdir_lib.load_config(workdir), workdir)
    name = tokenizer or config.data.tokenizer or "byte"
  else:
    config, params = hf.load(hf_dir, skip_audio=True)   # the apps feed no audio
    name = tokenizer or hf_dir
  return Loaded(config, params, tokenizers.get_tokenizer(name, config.model.vocab_size))
