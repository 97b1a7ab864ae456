r"""Compile time of the training step against depth, the layer scan rolled, unrolled or off.

    python benchmarks/compile_time.py                       # 6, 12, 24, 48 layers
    python benchmarks/compile_time.py --layers=6,48 --scan=rolled --out=/tmp/compile.json

Three ways to run the layers (`--scan`): "rolled", `scan_layers` with `scan_unroll`
"none": every whole period of the attention pattern (6 layers) is one step of a loop,
so the program should not grow with depth; "unrolled", `scan_layers` with `scan_unroll`
"full" (the default without remat): the same stacked parameters, the scan's steps
repeated in the program; "off", no `scan_layers`: every layer its own. Times are
seconds of `lower` (tracing) and
`compile` (XLA) of the full train step (forward, backward, AdamW), nothing allocated,
after an untimed compile of a 1-layer model pays JAX's and XLA's one-time start-up.

With --cached, JAX's persistent compilation cache is on (`gemma_jax.compilation_cache`,
in a fresh temporary directory) and each step is lowered and compiled a second time
after `jax.clear_caches()`, as the next run of an app would: "cached" is that second
compile, the program loaded from disk.

    python benchmarks/compile_time.py --preset=gemma4-moe-tiny --layers=6 --scan=rolled --cached
"""

import tempfile
import time

from absl import app
from absl import flags
import jax

import common
import gemma_jax as gj

_PRESET = flags.DEFINE_string("preset", "gemma3-tiny", "Model preset whose depth is varied.")
_LAYERS = flags.DEFINE_list("layers", ["6", "12", "24", "48"], "Layer counts.")
SCAN_MODES = {"rolled": dict(scan_layers=True, scan_unroll="none"),
              "unrolled": dict(scan_layers=True, scan_unroll="full"),
              "off": dict(scan_layers=False)}
_SCAN = flags.DEFINE_list("scan", list(SCAN_MODES), f"Ways to run the layers: {list(SCAN_MODES)}.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per row.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Remat policy.")
_CACHED = flags.DEFINE_bool("cached", False, "Also time each compile loaded from JAX's "
                            "persistent compilation cache.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/compile_time_<backend>.json.")


def compile_seconds(num_layers: int, scan: str) -> dict:
  config = gj.get_config(_PRESET.value)
  config.model.num_layers = num_layers
  config.model.update(SCAN_MODES[scan])
  config.model.remat_policy = _REMAT.value
  step, state, batch = common.abstract_train_step(config, _BATCH.value, _SEQ.value)
  start = time.perf_counter()
  lowered = step.lower(state, batch)
  traced = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  result = {"layers": num_layers, "scan": scan, "lower_s": traced - start,
            "compile_s": done - traced, "total_s": done - start}
  if _CACHED.value:
    jax.clear_caches()   # what a new process starts with, but for the disk cache
    lowered = step.lower(state, batch)
    start = time.perf_counter()
    lowered.compile()
    result["cached_compile_s"] = time.perf_counter() - start
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CACHED.value:
    gj.compilation_cache.enable(tempfile.mkdtemp(prefix="compile_time_cache_"))
  compile_seconds(1, "off")   # one-time start-up costs, not part of any depth's time
  results = []
  for scan in _SCAN.value:
    for layers in [int(n) for n in _LAYERS.value]:
      results.append(compile_seconds(layers, scan))
      print(results[-1], flush=True)
  rows = []
  for r in results:
    base = next(x for x in results if x["scan"] == r["scan"])
    rows.append([r["layers"], r["scan"], r["lower_s"], r["compile_s"],
                 r["total_s"], f"{r['total_s'] / base['total_s']:.2f}x"]
                + ([r["cached_compile_s"]] if _CACHED.value else []))
  common.print_table(
      f"{_PRESET.value} train step, batch {_BATCH.value} x {_SEQ.value}, remat "
      f"{_REMAT.value}: seconds",
      ["layers", "scan", "lower", "compile", "total", f"vs {results[0]['layers']} layers"]
      + (["compile, cached"] if _CACHED.value else []), rows)
  common.write_json(common.output_path(_OUT.value, "compile_time"),
                    {"preset": _PRESET.value, "batch_size": _BATCH.value,
                     "seq_len": _SEQ.value, "remat_policy": _REMAT.value,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
