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
the transformers directory the run started from (train.init_from).

OUT is written beside itself and swapped into place whole, and only where it is this
workdir's: a new or empty directory, or this workdir's earlier export of the same kind
holding nothing else (a marker file, .gemma_jax_export.json, says what wrote it).
Anything else is refused with one line; --overwrite replaces it whole (never a mix).
The base the workdir was trained from (train.init_from, and theirs in turn), the workdir
itself and any training run are never written over, --overwrite or not.
"""

import os
import sys

from absl import app
from absl import flags

from gemma_jax import apps, hf, quant
from gemma_jax.checkpoints import CheckpointError, directory, peft_adapters
from gemma_jax.config import ConfigError
from gemma_jax.text import tokenizers
from gemma_jax.training import checkpoints, init_from
from gemma_jax.training import workdir as workdir_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to export.")
_OUT = flags.DEFINE_string("out", None, "Directory to write.")
_PEFT = flags.DEFINE_bool("peft", False, "Write the LoRA adapters alone, as a peft directory.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out whole even if it holds "
                               "what this workdir's exports did not write.")
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


def _runs_and_bases(workdir: str):
  """The workdir and the checkpoints it was trained from: its train.init_from, and that
  one's own if it is a workdir, and so on (real paths)."""
  path, seen = workdir, []
  while path and os.path.realpath(path) not in seen:
    seen.append(os.path.realpath(path))
    path = workdir_lib.load_config(path).train.init_from if workdir_lib.is_workdir(
        path) else None
  return seen


def check_out(workdir: str, out: str, kind: str, overwrite: bool) -> str:
  """The export's source (the workdir's real path), once `out` may take it: a
  CheckpointError when `out` is, or holds, the workdir or a checkpoint it was trained
  from (writing the merged model over its own base would have the run apply its
  adapters twice, silently), or is not ours to write (`directory.check_destination`).
  Checked before any weights are read."""
  out_real = os.path.realpath(out)
  for i, path in enumerate(_runs_and_bases(workdir)):
    if out_real == path or path.startswith(out_real + os.sep):
      what = "is" if out_real == path else "holds"
      whose = (f"the workdir {workdir} itself" if i == 0 else
               f"the checkpoint {workdir} was trained from (train.init_from"
               + (")" if i == 1 else ", through its base workdirs)"))
      raise CheckpointError(f"--out={out} {what} {whose}, which an export never "
                            "replaces: export to another directory")
  source = os.path.realpath(workdir)
  directory.check_destination(out, kind, source, overwrite)
  return source


def export_model(workdir: str, out: str, overwrite: bool = False) -> str:
  """Writes the workdir's model (adapters merged into the float base), tokenizer and
  generation config."""
  config = quant.float_config(workdir_lib.load_config(workdir))
  source = check_out(workdir, out, directory.MODEL, overwrite)
  step = _latest_step(workdir, config)
  config, params = init_from.merged(config, workdir, step=step)
  tokenizer = tokenizers.get_tokenizer(config.data.tokenizer or "byte", config.model.vocab_size)

  def write_extra(staging):
    tokenizer.save(staging)
    directory.write_json(os.path.join(staging, "generation_config.json"),
                         generation_config(tokenizer))

  hf.save(out, config, params, write_extra=write_extra, overwrite=overwrite, source=source)
  return (f"wrote the {config.model.block_type} model of step {step} "
          f"to {out} (transformers' layout)")


def export_adapters(workdir: str, out: str, overwrite: bool = False) -> str:
  """Writes the workdir's LoRA adapters as a peft directory."""
  config = workdir_lib.load_config(workdir)
  if not config.lora.rank:
    raise ConfigError("lora.rank", f"{workdir} trained the whole model (lora.rank=0): it has "
                      "no adapters to write; export it without --peft")
  source = check_out(workdir, out, directory.ADAPTERS, overwrite)
  base, step = config.train.init_from, _latest_step(workdir, config)
  # peft's AutoPeftModel loads the base from here: a transformers directory, not a workdir.
  hf_base = os.path.abspath(base) if base and not workdir_lib.is_workdir(base) else None
  peft_adapters.save(out, config, init_from.restore_params(config, workdir, step=step), hf_base,
               overwrite=overwrite, source=source)
  return (f"wrote the rank-{config.lora.rank} LoRA adapters of step {step} to {out} "
          f"(base: {base})")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    export = export_adapters if _PEFT.value else export_model
    print(export(_WORKDIR.value, _OUT.value, _OVERWRITE.value))
  except (ConfigError, ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"export.py: error: {error}")


if __name__ == "__main__":
  apps.run(main)
