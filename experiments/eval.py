r"""Loss and perplexity of a trained or published model on text or chat files.

    python experiments/eval.py --workdir=runs/lora --data=configs/data/chat_small.jsonl
    python experiments/eval.py --hf_dir=path/to/gemma-3-1b-it --data='my_chats/*.jsonl'

Every example of --data is read (no split): text files and JSONL text as in training,
chat JSONL through the chat template with the loss on the model's turns only. Prints a
progress bar, then a table; writes the figures as JSON (--json; default WORKDIR/eval.json
with --workdir, WORKDIR/eval_<mode>.json with --quant, none with --hf_dir, whose
directory is the published model's). The loss per token is the training loop's
evaluation of the same batches; the table and the JSON name the model's quant mode.
"""

import json
import os
import sys

from absl import app
from absl import flags

from gemma_jax import apps
from gemma_jax import config as config_lib
from gemma_jax.training import data, evaluate

_MODEL = apps.define_model_flags()
_DATA = flags.DEFINE_string("data", None, "Comma-separated globs of .txt/.jsonl files.")
_FORMAT = flags.DEFINE_enum("format", "auto", config_lib.DATA_FORMATS,
                            "text, chat, or auto (chat where a JSONL line holds messages).")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Key of a JSONL line's text.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per row; default: the run's "
                                "data.seq_len (--hf_dir: 1024).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Rows per batch.")
_JSON = flags.DEFINE_string("json", None, "Where to write the figures as JSON.")
flags.mark_flag_as_required("data")


# The config fields this app sets from its flags: an error in one names the flag.
_FLAG_OF_FIELD = {"data.path": "--data", "data.format": "--format",
                  "data.text_field": "--text_field", "data.seq_len": "--seq_len"}


def table(model: str, data_path: str, figures: dict) -> str:
  """The figures as a markdown table."""
  return "\n".join([
      "| model | data | rows x tokens | tokens scored | loss (nats/token) | perplexity |",
      "|---|---|---|---|---|---|",
      f"| {model} | {data_path} | {figures['rows']} x {figures['seq_len']} | "
      f"{figures['tokens']:.0f} | {figures['loss']:.4f} | {figures['perplexity']:.3f} |"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # A quantized evaluation is kept beside the float one, not over it.
  name = f"eval_{_MODEL.quant.value}.json" if _MODEL.quant.value else "eval.json"
  out = _JSON.value or (_MODEL.workdir.value and os.path.join(_MODEL.workdir.value, name))
  try:
    if _BATCH_SIZE.value < 1:
      raise ValueError(f"--batch_size must be >= 1, got {_BATCH_SIZE.value}")
    config, params, tokenizer = _MODEL.load()   # first: it names a workdir that is none
    if out and not os.access(os.path.dirname(os.path.abspath(out)), os.W_OK):
      raise ValueError(f"--json: cannot write {out} (no such folder, or not writable)")
    data_config = config.data
    with data_config.unlocked():
      data_config.update(dict(path=_DATA.value, format=_FORMAT.value,
                              text_field=_TEXT_FIELD.value))
      run_seq_len = data_config.seq_len if _MODEL.workdir.value else 1024
      data_config.seq_len = run_seq_len if _SEQ_LEN.value is None else _SEQ_LEN.value
    config_lib.validate(config)
    figures = evaluate.evaluate(config, params, data.load_all(data_config, tokenizer),
                                _BATCH_SIZE.value)
  except config_lib.ConfigError as error:   # DataError too: named by the flag that set it
    flag = _FLAG_OF_FIELD.get(error.field)
    sys.exit(f"eval.py: error: {flag}: {str(error)[len(f'config.{error.field}: '):]}" if flag
             else f"eval.py: error: {error}")
  except (ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"eval.py: error: {error}")
  model = _MODEL.workdir.value or _MODEL.hf_dir.value
  figures = dict(figures, model=model, data=_DATA.value, seq_len=data_config.seq_len,
                 quant=config.model.quant)
  if config.model.quant != "none":
    model = f"{model} ({config.model.quant})"
  print(table(model, _DATA.value, figures))
  if out:
    with open(out, "w") as f:
      json.dump(figures, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
  apps.run(main)
