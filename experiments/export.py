r"""Hands a trained workdir to the PyTorch world.

    python experiments/export.py --workdir=runs/lora --out=runs/lora_hf
    python experiments/export.py --workdir=runs/lora --out=runs/lora_peft --peft

Without --peft: a transformers directory (config.json, model.safetensors, the tokenizer's
files, generation_config.json with the stop ids), LoRA adapters merged into their base
(QLoRA's into the float weights its base was quantized from: transformers holds no integer
weights);
`AutoModelForCausalLM.from_pretrained(OUT)` and `sample.py --hf_dir=OUT` read it. With
--peft: the LoRA adapters alone, as a peft directory (adapter_config.json,
adapter_model.safetensors) for `peft.PeftModel.from_pretrained(base, OUT)`, the base being
the transformers directory the run started from (train.init_from). The directory is
written beside OUT and swapped into place, so an existing export is only ever replaced
by a whole one.
"""

import json
import os
import sys

from absl import app
from absl import flags

from gemma_jax import apps, hf, hf_peft, quant
from gemma_jax import workdir as workdir_lib
from gemma_jax.config import ConfigError
from gemma_jax.training import checkpoints, init_from, tokenizers

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to export.")
_OUT = flags.DEFINE_string("out", None, "Directory to write.")
_PEFT = flags.DEFINE_bool("peft", False, "Write the LoRA adapters alone, as a peft directory.")
flags.mark_flags_as_required(["workdir", "out"])


def generation_config(tokenizer) -> dict:
  """transformers' generation_config.json: generation stops at every stop id."""
  return {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids),
          "pad_token_id": tokenizer.pad_id}


def _latest_step(workdir: str, config):
  """The workdir's latest checkpoint step, read once: what is exported and named (None
  without one, which the restore then names)."""
  checkpointer = checkpoints.Checkpointer(workdir_lib.checkpoint_dir(workdir),
                                          config.checkpoint.keep)
  try:
    return checkpointer.latest_step()
  finally:
    checkpointer.close()


def export_model(workdir: str, out: str) -> str:
  """Writes the workdir's model (adapters merged into the float base), tokenizer and
  generation config."""
  config = quant.float_config(workdir_lib.load_config(workdir))
  step = _latest_step(workdir, config)
  config, params = init_from.merged(config, workdir, step=step)
  tokenizer = tokenizers.get_tokenizer(config.data.tokenizer or "byte", config.model.vocab_size)

  def write_extra(directory):
    tokenizer.save(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
      json.dump(generation_config(tokenizer), f, indent=2)

  hf.save(out, config, params, write_extra=write_extra)
  return (f"wrote the {config.model.block_type} model of step {step} "
          f"to {out} (transformers' layout)")


def export_adapters(workdir: str, out: str) -> str:
  """Writes the workdir's LoRA adapters as a peft directory."""
  config = workdir_lib.load_config(workdir)
  if not config.lora.rank:
    raise ConfigError("lora.rank", f"{workdir} trained the whole model (lora.rank=0): it has "
                      "no adapters to write; export it without --peft")
  base, step = config.train.init_from, _latest_step(workdir, config)
  # peft's AutoPeftModel loads the base from here: a transformers directory, not a workdir.
  hf_base = os.path.abspath(base) if base and not workdir_lib.is_workdir(base) else None
  hf_peft.save(out, config, init_from.restore_params(config, workdir, step=step), hf_base)
  return (f"wrote the rank-{config.lora.rank} LoRA adapters of step {step} to {out} "
          f"(base: {base})")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    print((export_adapters if _PEFT.value else export_model)(_WORKDIR.value, _OUT.value))
  except (ConfigError, ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"export.py: error: {error}")


if __name__ == "__main__":
  apps.run(main)
