r"""Compile time of the training step against depth, with the layer scan on and off.

    python benchmarks/compile_time.py                       # 6, 12, 24, 48 layers
    python benchmarks/compile_time.py --layers=6,48 --scan=true --out=/tmp/compile.json

With `scan_layers`, every whole period of the attention pattern (6 layers) is one
`nn.scan` step, so the program, and its compile time, should not grow with depth;
unrolled, it grows with every layer. Times are seconds of `lower` (tracing) and
`compile` (XLA) of the full train step (forward, backward, AdamW), nothing allocated,
after an untimed compile of a 1-layer model pays JAX's and XLA's one-time start-up.
"""

import time

from absl import app
from absl import flags

import common
import gemma_jax as gj

_PRESET = flags.DEFINE_string("preset", "gemma3-tiny", "Model preset whose depth is varied.")
_LAYERS = flags.DEFINE_list("layers", ["6", "12", "24", "48"], "Layer counts.")
_SCAN = flags.DEFINE_list("scan", ["true", "false"], "scan_layers settings to time.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per row.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Remat policy.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/compile_time_<backend>.json.")


def compile_seconds(num_layers: int, scan: bool) -> dict:
  config = gj.get_config(_PRESET.value)
  config.model.num_layers = num_layers
  config.model.scan_layers = scan
  config.model.remat_policy = _REMAT.value
  step, state, batch = common.abstract_train_step(config, _BATCH.value, _SEQ.value)
  start = time.perf_counter()
  lowered = step.lower(state, batch)
  traced = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  return {"layers": num_layers, "scan": scan, "lower_s": traced - start,
          "compile_s": done - traced, "total_s": done - start}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  compile_seconds(1, False)   # one-time start-up costs, not part of any depth's time
  results = []
  for scan in [s.lower() == "true" for s in _SCAN.value]:
    for layers in [int(n) for n in _LAYERS.value]:
      results.append(compile_seconds(layers, scan))
      print(results[-1], flush=True)
  rows = []
  for r in results:
    base = next(x for x in results if x["scan"] == r["scan"])
    rows.append([r["layers"], "on" if r["scan"] else "off", r["lower_s"], r["compile_s"],
                 r["total_s"], f"{r['total_s'] / base['total_s']:.2f}x"])
  common.print_table(
      f"{_PRESET.value} train step, batch {_BATCH.value} x {_SEQ.value}, remat "
      f"{_REMAT.value}: seconds",
      ["layers", "scan", "lower", "compile", "total", f"vs {results[0]['layers']} layers"], rows)
  common.write_json(common.output_path(_OUT.value, "compile_time"),
                    {"preset": _PRESET.value, "batch_size": _BATCH.value,
                     "seq_len": _SEQ.value, "remat_policy": _REMAT.value,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
