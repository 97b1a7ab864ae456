"""RMSNorm's gradient: XLA's own against `rms_norm_gradient`'s Pallas kernel.

  python benchmarks/norm_gradient.py                     # on a GPU: gemma3-1b's norms
  python benchmarks/norm_gradient.py --shapes=64x1152    # a dry run (Pallas interpreter)

Times (x, weight, dy) -> (dx, d weight) for each norm of gemma3-1b at 16 x 2048 tokens
(rows x width: the residual stream's norms, then q_norm and k_norm over heads), in
bfloat16 with a float32 weight, and the kernel in a few block shapes; prints a table and
writes JSON. Bandwidth counts the bytes a single pass must move: x and dy read, dx
written; each figure is the time of ten chained gradients in one program, divided by ten.
"""

import functools
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
from gemma_jax.layers import norms
from gemma_jax.layers import rms_norm_gradient

_SHAPES = flags.DEFINE_list("shapes", ["32768x1152", "131072x256", "32768x256"],
                            "rows x width of each norm")
_CONFIGS = flags.DEFINE_list(
    "configs", ["0/4/512/0", "0/4/512/3", "0/4/2048/0", "0/2/512/0", "1/4/264/0",
                "2/4/1024/0", "4/4/8192/0", "8/8/4096/0", "16/16/2048/0", "8/4/512/0",
                "0/8/512/2"],
    "the kernel's block_rows/num_warps/programs/num_stages (0: its default)")
_OUT = flags.DEFINE_string("out", None, "JSON path (default: benchmarks/results/)")

_EPS = 1e-6


def median_ms(gradient, x, weight, dy, runs: int = 20, chained: int = 10) -> float:
  """Per gradient: `chained` gradients in one program, each dx the next one's dy (so the
  launch and the wait are paid once, as in a step)."""
  def chain(x, weight, dy):
    dw = 0
    for _ in range(chained):
      dy, d = gradient(x, weight, dy)
      dw += d
    return dy, dw
  chain = jax.jit(chain)
  jax.block_until_ready(chain(x, weight, dy))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(chain(x, weight, dy))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3 / chained


def xla_gradient(x, weight, dy):
  """XLA's gradient of the same norm (what RMSNorm runs off a single GPU)."""
  forward = lambda x, w: norms.scale_features(norms.normalise(x, _EPS), w).astype(x.dtype)
  return jax.vjp(forward, x, weight)[1](dy)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rng = np.random.default_rng(0)
  results, rows = [], []
  for shape in _SHAPES.value:
    m, d = (int(n) for n in shape.split("x"))
    x, dy = (jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16) for _ in range(2))
    weight = jnp.asarray(1 + rng.standard_normal(d) / 10, jnp.float32)
    variants = {"xla": xla_gradient}
    for config in _CONFIGS.value:
      block_rows, warps, programs, stages = (int(n) for n in config.split("/"))
      variants[f"kernel {config}"] = functools.partial(
          rms_norm_gradient.backward, eps=_EPS, block_rows=block_rows, num_warps=warps,
          programs=programs, num_stages=stages)
    reference = None
    for name, fn in variants.items():
      try:
        dx, dw = jax.jit(fn)(x, weight, dy)
        reference = reference or (np.asarray(dx, np.float32), np.asarray(dw))
        ms = median_ms(fn, x, weight, dy)
        r = {"shape": shape, "variant": name, "ms": ms,
             "gb_per_s": 3 * m * d * 2 / ms / 1e6,
             "dx_max_difference_vs_xla": float(np.abs(np.asarray(dx, np.float32)
                                                      - reference[0]).max()),
             "dw_max_difference_vs_xla": float(np.abs(np.asarray(dw) - reference[1]).max())}
        rows.append([shape, name, ms, r["gb_per_s"], r["dx_max_difference_vs_xla"],
                     r["dw_max_difference_vs_xla"]])
      except Exception as e:  # pylint: disable=broad-except
        r = {"shape": shape, "variant": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        rows.append([shape, name, "failed", type(e).__name__, "", ""])
      results.append(r)
      print(rows[-1], flush=True)
  common.print_table(
      f"{jax.devices()[0].device_kind}: RMSNorm's gradient, bfloat16 rows, float32 weight",
      ["rows x width", "gradient", "ms", "GB/s", "dx diff vs xla", "dw diff vs xla"], rows)
  common.write_json(common.output_path(_OUT.value, "norm_gradient"), {"results": results})


if __name__ == "__main__":
  app.run(main)
