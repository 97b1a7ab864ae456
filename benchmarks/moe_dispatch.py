r"""Times the MoE dispatches (gemma_jax.layers.expert_dispatch) on the default backend.

    python benchmarks/moe_dispatch.py                       # 8..128 experts, a table + JSON
    python benchmarks/moe_dispatch.py --experts=8,32 --tokens=4096 --out=/tmp/moe.json

For each expert count: the forward, and the forward + backward (gradients of x and
every weight), of each dispatch on the same routing, plus "routed": the same matmuls on
the M * k routed rows with one expert's weights and no routing at all (the work a
perfect grouped matmul would do). The loop dispatch is also timed with other row
blocks: "32" one tier, "128+32" two (`grouped_mlp.BLOCK_ROWS` is the default), and
other capacities (the rows per expert of its batched product: "auto" is
`grouped_mlp.capacity`, "0" runs every row through the loop), and for each the rows it
multiplies per routed row (`work`: the work done over the work needed; padding of its
batched slots and blocks). Times are medians in ms.

`--dispatches=tokamax` adds the ragged dispatch with tokamax's `ragged_dot` (its
Pallas kernels on a GPU or TPU) where tokamax is installed; on a GPU, "ragged" is
XLA's, which expands ragged_dot into every row times every expert. A Gemma 4
26B-A4B layer on a GPU (`benchmarks/gpu_check.sh` runs it):

    python benchmarks/moe_dispatch.py --experts=128 --top_k=8 --tokens=4096 \
        --d_model=2816 --expert_mlp_dim=704 --dtype=bfloat16 \
        --dispatches=loop,tokamax,dense,ragged --loop_blocks=

    python benchmarks/moe_dispatch.py --experts=16 --tokens=1024 --top_k=4 --d_model=512 \
        --expert_mlp_dim=512 --dispatches=loop --loop_blocks=128+32 --loop_capacities=auto,0
"""

import functools
import itertools

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import common
from gemma_jax.layers import expert_dispatch, grouped_mlp
from gemma_jax.layers.mlp import ACTIVATIONS

_EXPERTS = flags.DEFINE_list("experts", ["8", "16", "32", "64", "128"], "Expert counts E.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens M (= batch x length).")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token k.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width D.")
_MLP_DIM = flags.DEFINE_integer("expert_mlp_dim", 256, "Expert hidden width F.")
_BLOCKS = flags.DEFINE_list("loop_blocks", ["32", "128+32"],
                            "Row block tiers to time the loop dispatch with.")
_CAPACITIES = flags.DEFINE_list("loop_capacities", ["auto", "0"],
                                "Capacities to time the loop dispatch with (auto: the default).")
_DISPATCHES = flags.DEFINE_list("dispatches", ["dense", "ragged", "loop"],
                                "Dispatches to time.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Dtype of the tokens and expert weights.")
_SECONDS = flags.DEFINE_float("seconds", 1.0, "Least time spent timing each function.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/moe_dispatch_<backend>.json.")

HIDDEN = lambda gate, up: ACTIVATIONS["gelu_tanh"](gate) * up


def problem(num_experts: int, seed: int = 0):
  """Tokens, a softmax top-k routing of random logits, and expert weights."""
  m, d, f, k = _TOKENS.value, _D_MODEL.value, _MLP_DIM.value, _TOP_K.value
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (m, d))
  weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[1], (m, num_experts))), k)
  gate, up = (jax.random.normal(key, (num_experts, d, f)) * d ** -0.5 for key in keys[2:4])
  down = jax.random.normal(keys[4], (num_experts, f, d)) * f ** -0.5
  cast = lambda a: a.astype(_DTYPE.value)
  return cast(x), ids, weights, cast(gate), cast(up), cast(down)


def dispatches() -> dict:
  """The library's dispatches, and "tokamax" (ragged with tokamax's ragged_dot) where
  tokamax is installed."""
  found = dict(expert_dispatch.DISPATCHES)
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"tokamax is not installed here ({e}): its dispatch is left out", flush=True)
  else:
    found["tokamax"] = functools.partial(expert_dispatch.ragged,
                                         ragged_dot=tokamax.ragged_dot)
  return found


def timings(dispatch, x, ids, weights, gate, up, down) -> dict:
  """{"forward": ms, "backward": ms (forward + gradients)}."""
  run = lambda x, gate, up, down: dispatch(x, ids, weights, gate, up, down, HIDDEN)
  loss = lambda *args: jnp.sum(jnp.square(run(*args)))
  ms = lambda fn: 1e3 * common.median_seconds(
      lambda: jax.block_until_ready(fn(x, gate, up, down)), min_seconds=_SECONDS.value)
  return {"forward": ms(jax.jit(run)),
          "backward": ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))))}


def routed_baseline(x, ids, weights, gate, up, down):
  """The dispatches' matmuls on M * k rows with expert 0's weights, without routing."""
  rows = jnp.repeat(x, ids.shape[1], axis=0)
  mlp = lambda x, gate, up, down: HIDDEN(rows @ gate[0], rows @ up[0]) @ down[0]
  return timings(lambda x, _, __, gate, up, down, ___: mlp(x, gate, up, down),
                 x, ids, weights, gate, up, down)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  backend = jax.default_backend()
  available = dispatches()
  names = [name for name in _DISPATCHES.value if name in available]
  results = []
  for num_experts in [int(e) for e in _EXPERTS.value]:
    args = problem(num_experts)
    row = {"experts": num_experts, "routed": routed_baseline(*args)}
    sizes = jnp.bincount(args[1].reshape(-1), length=num_experts)
    for name in names:   # each printed as it comes: a dispatch that fails leaves the rest
      row[name] = timings(available[name], *args)
      if name == "loop":
        row[name]["work"] = float(grouped_mlp.computed_rows(sizes) / args[1].size)
      print(f"E={num_experts} {name}: {row[name]}", flush=True)
    for tiers, rows_per_expert in itertools.product(_BLOCKS.value, _CAPACITIES.value):
      blocks = tuple(int(b) for b in tiers.split("+"))
      capacity = None if rows_per_expert == "auto" else int(rows_per_expert)
      loop = lambda *a, blocks=blocks, capacity=capacity: expert_dispatch.loop(
          *a, blocks=blocks, capacity_rows=capacity)
      name = f"loop_blocks_{tiers}_capacity_{rows_per_expert}"
      row[name] = timings(loop, *args)
      row[name]["work"] = float(grouped_mlp.computed_rows(sizes, blocks, capacity)
                                / args[1].size)
    results.append(row)
    print(f"E={num_experts}: " + ", ".join(
        f"{k} {v['forward']:.1f}/{v['backward']:.1f}" + (f" (work {v['work']:.3f}x)"
                                                          if "work" in v else "")
        for k, v in row.items() if k != "experts"),
          flush=True)

  columns = [k for k in results[0] if k != "experts"]
  common.print_table(
      f"backend {backend}, M={_TOKENS.value} tokens, k={_TOP_K.value}, D={_D_MODEL.value}, "
      f"F={_MLP_DIM.value}, {_DTYPE.value}; ms forward / forward+backward", ["E"] + columns,
      [[row["experts"]] + [f"{row[c]['forward']:.1f} / {row[c]['backward']:.1f}" + (
          f" ({row[c]['work']:.3f}x work)" if "work" in row[c] else "") for c in columns]
       for row in results])
  common.write_json(common.output_path(_OUT.value, "moe_dispatch"),
                    {"tokens": _TOKENS.value, "top_k": _TOP_K.value, "d_model": _D_MODEL.value,
                     "expert_mlp_dim": _MLP_DIM.value, "dtype": _DTYPE.value,
                     "results": results})

if __name__ == "__main__":
  app.run(main)
