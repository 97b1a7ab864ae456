r"""Times a MoE train step on several meshes: experts replicated (data parallel) against
experts sharded over the `expert` mesh axis, where each device runs its own experts on
tokens all-gathered over the axis and reduce-scatters the outputs
(`gemma_jax.layers.expert_parallel`).

    python benchmarks/expert_parallel.py                    # 8 simulated CPU devices
    python benchmarks/expert_parallel.py --out=/tmp/ep.json

On a CPU it simulates 8 devices (the XLA flag is set before jax is imported); on an
accelerator host it uses the real devices. Times are medians in ms per step.
"""

import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# pylint: disable=wrong-import-position
from absl import app
from absl import flags
import jax
import numpy as np
import optax

import common
import gemma_jax as gj
from gemma_jax import sharding
from gemma_jax.training import data, steps

MESHES = {
    "data8 (experts replicated)": dict(data=8),
    "expert8": dict(data=1, expert=8),
    "expert4 x data2": dict(data=2, expert=4),
    "expert4 x fsdp2": dict(data=1, fsdp=2, expert=4),
}
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per mesh (after one compiling step).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per step.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/expert_parallel_<backend>.json.")


def time_mesh(mesh_sizes: dict) -> float:
  """Median ms of a gemma4-moe-tiny AdamW step on the mesh."""
  config = gj.get_config("gemma4-moe-tiny")
  config.mesh.update(mesh_sizes)
  mesh = sharding.make_mesh(config.mesh)
  model = gj.transform(config)
  tx = optax.adamw(1e-3)
  init = lambda: steps.init_state(model, tx, seed=0, seq_len=_SEQ.value)
  shardings = steps.state_shardings(config, tx, jax.eval_shape(init), mesh)
  rng = np.random.default_rng(0)
  batch = data.make_batch(rng.integers(3, 259, (_BATCH.value, _SEQ.value)).astype(np.int32),
                          np.ones((_BATCH.value, _SEQ.value), np.int32))
  with sharding.activate(mesh):
    state = jax.jit(init, out_shardings=shardings)()
    step = jax.jit(steps.make_train_step(steps.model_forward(model), tx, lambda _: 1e-3),
                   in_shardings=(shardings, sharding.batch_sharding(mesh)),
                   out_shardings=(shardings, sharding.replicated(mesh)), donate_argnums=0)
    batch = sharding.global_batch(batch, mesh)
    state, _ = jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(_STEPS.value):
      start = time.perf_counter()
      state, _ = jax.block_until_ready(step(state, batch))
      times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = {name: time_mesh(sizes) for name, sizes in MESHES.items()}
  base = results["data8 (experts replicated)"]
  common.print_table(
      f"gemma4-moe-tiny train step, batch {_BATCH.value} x {_SEQ.value}, "
      f"{jax.device_count()} {jax.default_backend()} devices",
      ["mesh", "ms / step", "vs data8"],
      [[name, ms, f"{ms / base:.2f}x"] for name, ms in results.items()])
  common.write_json(common.output_path(_OUT.value, "expert_parallel"),
                    {"batch_size": _BATCH.value, "seq_len": _SEQ.value,
                     "ms_per_step": results})

if __name__ == "__main__":
  app.run(main)
