r"""A user's train step with the loss over `apply`'s logits against `Transformed.loss`.

    python benchmarks/loss_memory.py                                   # planned memory
    python benchmarks/loss_memory.py --presets=gemma3-270m --num_layers=2 --batch_size=1 \
        --seq_len=2048 --time --out=/tmp/loss.json                      # and step time

Both sides are `common.user_train_step`: jitted `value_and_grad` + optax AdamW with
parameters and optimizer state donated; "logits": optax's cross-entropy over
`apply`'s [B, T, V] float32 logits; "chunked": `model.loss`, whose tied logits are
formed a chunk of positions at a time (`layers.chunked_loss`). Columns: XLA's planned
temporaries of the compiled step (`memory_analysis`, nothing allocated: any preset
and shape compiles on a CPU), and with `--time` the median step time on this machine
(alternating rounds) and the two losses.
"""

from absl import app
from absl import flags
import jax
import numpy as np

import common
import gemma_jax as gj

_PRESETS = flags.DEFINE_list("presets", ["gemma3-270m", "gemma3-1b"], "Model presets.")
_LAYERS = flags.DEFINE_integer("num_layers", None, "Override the presets' depth.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
_UNROLL = flags.DEFINE_string("scan_unroll", None, "config.model.scan_unroll; default the "
                               "preset's ('auto': unrolled without remat).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype (parameters float32).")
_TIME = flags.DEFINE_bool("time", False, "Also run and time the steps (allocates them).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Timed rounds with --time.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/loss_memory_<backend>.json.")

LOSSES = ("logits", "chunked")


def measure(preset: str) -> list:
  config = gj.get_config(preset)
  config.model.dtype = _DTYPE.value
  if _LAYERS.value:
    config.model.num_layers = _LAYERS.value
  if _UNROLL.value:
    config.model.scan_unroll = _UNROLL.value
  rows = (_BATCH.value, _SEQ.value)
  tokens = jax.ShapeDtypeStruct(rows, np.int32)
  steps, results = {}, []
  for loss in LOSSES:
    step, params, opt_state = common.user_train_step(config, tokens, loss=loss,
                                                     abstract=not _TIME.value)
    compiled = step.lower(params, opt_state, tokens).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    results.append({"preset": preset, "layers": config.model.num_layers, "rows": rows,
                    "scan_unroll": config.model.scan_unroll,
                    "loss": loss, "temp_gib": temp / 2 ** 30})
    steps[loss] = (compiled, params, opt_state)
  if _TIME.value:
    ids = np.random.default_rng(0).integers(3, config.model.vocab_size, rows).astype(np.int32)
    state, values = {}, {}

    def runner(loss):
      def run():
        compiled, params, opt_state = state.get(loss, steps[loss])
        params, opt_state, value = compiled(params, opt_state, ids)
        values[loss] = float(value)
        state[loss] = (compiled, params, opt_state)
      return run

    seconds = common.alternating_medians({loss: runner(loss) for loss in LOSSES},
                                         _ROUNDS.value)
    for r in results:
      r.update(step_s=seconds[r["loss"]], loss_value=values[r["loss"]])
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = [r for preset in _PRESETS.value for r in measure(preset)]
  columns = ["preset", "layers", "scan_unroll", "rows", "loss", "temp_gib"] + (
      ["step_s", "loss_value"] if _TIME.value else [])
  common.print_table(f"Train step memory, {_DTYPE.value} compute ({common.machine()['device']})",
                     columns, [[r[c] for c in columns] for r in results])
  common.write_json(common.output_path(_OUT.value, "loss_memory"),
                    {"dtype": _DTYPE.value, "results": results})


if __name__ == "__main__":
  app.run(main)
