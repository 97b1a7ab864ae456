r"""Peak memory of a training step under each remat policy, from XLA's memory analysis.

    python benchmarks/remat_memory.py                       # every policy in gemma_jax.remat
    python benchmarks/remat_memory.py --preset=gemma3-1b --batch_size=8 --seq_len=2048

Nothing is allocated: the train step (forward, backward, AdamW, state donated) is
compiled for abstract inputs and XLA reports its buffers. "temp" is what the step
allocates beyond its inputs and outputs (the saved activations live there); "total" is
arguments + outputs - donated aliases + temp, what the step needs at once. The policies
that park tensors in pinned host memory read like their non-offloaded counterparts on a
CPU, where host and device memory are one; a backend that cannot compile one gets a row
with its error.
"""

from absl import app
from absl import flags

import common
import gemma_jax as gj
from gemma_jax import remat

_PRESET = flags.DEFINE_string("preset", "gemma3-tiny", "Model preset.")
_SHAPE = flags.DEFINE_string(
    "shape", "num_layers=12,d_model=512,num_heads=8,num_kv_heads=4,head_dim=64,"
    "mlp_dim=2048,vocab_size=4096,sliding_window=128",
    "Comma-separated model field overrides (integers).")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
_POLICIES = flags.DEFINE_list("policies", list(remat.POLICIES), "Remat policies.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/remat_memory_<backend>.json.")

MIB = 2 ** 20


def memory(policy: str) -> dict:
  config = gj.get_config(_PRESET.value)
  config.model.update({k: int(v) for k, v in
                       (item.split("=") for item in _SHAPE.value.split(",") if item)})
  config.model.remat_policy = policy
  step, state, batch = common.abstract_train_step(config, _BATCH.value, _SEQ.value)
  try:
    stats = step.lower(state, batch).compile().memory_analysis()
  except Exception as e:  # pylint: disable=broad-except
    return {"policy": policy, "error": str(e).splitlines()[0][:160]}
  return {"policy": policy, "argument_mib": stats.argument_size_in_bytes / MIB,
          "output_mib": stats.output_size_in_bytes / MIB,
          "alias_mib": stats.alias_size_in_bytes / MIB,
          "temp_mib": stats.temp_size_in_bytes / MIB,
          "total_mib": (stats.argument_size_in_bytes + stats.output_size_in_bytes
                        - stats.alias_size_in_bytes + stats.temp_size_in_bytes) / MIB}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = []
  for policy in _POLICIES.value:
    results.append(memory(policy))
    print(results[-1], flush=True)
  base = results[0].get("temp_mib")
  rows = [[r["policy"], "-", "-", "-", r["error"]] if "error" in r else
          [r["policy"], r["argument_mib"], r["temp_mib"], r["total_mib"],
           f"{r['temp_mib'] / base:.2f}x" if base else ""] for r in results]
  common.print_table(
      f"{_PRESET.value} ({_SHAPE.value}) train step, batch {_BATCH.value} x {_SEQ.value}: MiB",
      ["policy", "arguments", "temp", "total", f"temp vs {results[0]['policy']}"], rows)
  common.write_json(common.output_path(_OUT.value, "remat_memory"),
                    {"preset": _PRESET.value, "shape": _SHAPE.value,
                     "batch_size": _BATCH.value, "seq_len": _SEQ.value,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
