r"""Plans per-device memory of a training step without allocating anything.

    python experiments/plan.py --config=configs/gemma3_1b.py --preset=gemma3-27b \
        --devices=256 --mesh=fsdp --config.train.batch_size=256 \
        --config.optimizer.grad_accum_steps=1
    python experiments/plan.py --config=configs/gemma3_1b.py --preset=gemma3-27b \
        --devices=256 --config.mesh.data=1 --config.mesh.fsdp=64 --config.mesh.tensor=4 \
        --config.train.batch_size=512 --config.optimizer.grad_accum_steps=8

--preset swaps in a named model's architecture (e.g. gemma3-27b), keeping the rest of the
config (dtype, remat policy, batch, sequence length) and any --config.model.* flags
given, which apply on top of the preset. The micro-batch (batch_size / grad_accum_steps
rows) must split over the mesh's data, fsdp and expert axes.
With --config.lora.rank=16 (LoRA) the base weights are frozen: gradients and optimizer
state cover the adapters only, and the plan says how many parameters train.
Prints a table and, with --json, writes the figures there. With --cache_length it also
plans the decoding caches (all devices together) against a full-length cache on every
layer:

    python experiments/plan.py --config=configs/gemma3_1b.py --preset=gemma3-27b \
        --cache_length=131072 --cache_batch=1
"""

import json
import sys

from absl import flags
from ml_collections import config_flags

import gemma_jax as gj
from gemma_jax import apps, planning, sharding
from gemma_jax.layers import kv_cache

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_PRESET = flags.DEFINE_string("preset", None, "Model preset replacing config.model.")
_DEVICES = flags.DEFINE_integer("devices", 1, "Devices in the planned mesh.", lower_bound=1)
_MESH = flags.DEFINE_enum("mesh", None, sorted(sharding.MESH_PRESETS),
                          "Named mesh shape replacing config.mesh.")
_JSON = flags.DEFINE_string("json", None, "Also write the plan to this JSON file.")
_CACHE_LENGTH = flags.DEFINE_integer("cache_length", 0, "Also plan decoding caches covering "
                                     "this many positions; 0: do not.", lower_bound=0)
_CACHE_BATCH = flags.DEFINE_integer("cache_batch", 1, "Rows of the planned decoding caches.",
                                    lower_bound=1)
_CACHE_DTYPE = flags.DEFINE_enum("cache_dtype", "bfloat16", list(kv_cache.CACHE_DTYPES),
                                 "Dtype of the planned caches.")
flags.mark_flags_as_required(["config"])

GIB = 2 ** 30
MODEL_FLAG = "config.model."


def model_overrides() -> dict:
  """The --config.model.* flags given: {path under config.model, dotted: value}."""
  return {name[len(MODEL_FLAG):]: flags.FLAGS[name].value for name in flags.FLAGS
          if name.startswith(MODEL_FLAG) and flags.FLAGS[name].present}


def use_preset(model, name: str) -> None:
  """Replaces `model`'s architecture by preset `name`'s, keeping its compute choices and
  the --config.model.* flags given."""
  overrides = model_overrides()
  keep = {k: model[k] for k in ("dtype", "param_dtype", "remat_policy", "scan_layers")}
  for key, value in gj.get_config(name).model.items():
    model[key] = keep.get(key, value)
  for path, value in overrides.items():
    *parents, leaf = path.split(".")
    section = model
    for parent in parents:
      section = section[parent]
    section[leaf] = value


def main(argv):
  del argv
  config = _CONFIG.value
  try:
    if _PRESET.value:
      use_preset(config.model, _PRESET.value)
    if _MESH.value:
      config.mesh.update(sharding.MESH_PRESETS[_MESH.value])
    gj.validate(config)
    result = planning.plan(config, _DEVICES.value, config.train.batch_size, config.data.seq_len)
    if _CACHE_LENGTH.value:
      result["decode_cache"] = planning.cache_bytes(config, _CACHE_BATCH.value,
                                                    _CACHE_LENGTH.value, _CACHE_DTYPE.value)
  except (gj.ConfigError, ValueError) as error:   # ValueError: an unknown --preset
    sys.exit(f"plan.py: error: {error}")
  print(f"{config.model.name} on {_DEVICES.value} devices, mesh {result['mesh']}, "
        f"batch {config.train.batch_size} x {config.data.seq_len} tokens, "
        f"remat {config.model.remat_policy}")
  print(f"{'per device':<18}{'GiB':>10}")
  total = 0
  for name in ("params", "gradients", "optimizer_state", "activations"):
    total += result[name]
    print(f"{name:<18}{result[name] / GIB:>10.3f}")
  print(f"{'total':<18}{total / GIB:>10.3f}")
  if config.lora.rank:
    print(f"LoRA rank {config.lora.rank} (alpha {config.lora.alpha:g}) on "
          f"{', '.join(config.lora.targets)}: {result['trainable_params']:,} trainable of "
          f"{result['total_params']:,} parameters "
          f"({result['trainable_params'] / result['total_params']:.2%}); the base is frozen "
          f"(no gradients, no optimizer state)")
  if "decode_cache" in result:
    cache = result["decode_cache"]
    print(f"decoding cache, {_CACHE_BATCH.value} x {_CACHE_LENGTH.value} positions, "
          f"{_CACHE_DTYPE.value}, all devices: {cache['cache'] / GIB:.3f} GiB "
          f"(local layers hold their window) vs {cache['full_length'] / GIB:.3f} GiB "
          f"full-length on every layer ({cache['cache'] / cache['full_length']:.1%})")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(dict(result, total=total, devices=_DEVICES.value, model=config.model.name), f,
                indent=2)


if __name__ == "__main__":
  apps.run(main)
