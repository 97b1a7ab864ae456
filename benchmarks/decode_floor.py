r"""Greedy decoding against its memory floor: our time per token beside the time of the
matrix-vector products alone that each token needs, over the same weights.

    python benchmarks/decode_floor.py --shapes=gemma3-small,gemma4-moe-16x4

Decoding one token at batch 1 reads every projection weight once (of an MoE layer's
experts, the k a token is routed to) and the tied embedding for the logits; on a CPU that
read is the bulk of the step. The floor is one jitted loop of N steps, each step every
one of those products [1, in] @ [in, out] in a chain (each input taken from the last
output, so that none is hoisted out of the loop), each as the model runs it
(`matmul.vector_product`: on a CPU two half-products, one per core): what XLA takes to
stream those weights from memory, with no attention, norms or cache. Ours is `sampler.generate`'s time per
token: (time of N new tokens - time of 1) / (N - 1), so the prefill drops out. Weights are
float32 as in `side_by_side.py`; `--shapes`, `--prompt_len`, `--new_tokens` and
`--rounds` are that script's flags. A ratio near 1 leaves decoding nothing to gain but
fewer bytes.
"""

import math
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
import gemma_jax as gj
import side_by_side as sbs
from gemma_jax.inference import decoding, sampler
from gemma_jax.layers.matmul import vector_product

FLAGS = flags.FLAGS


def matrices_read_per_token(params: dict, config) -> list:
  """The [in, out] matrices one decoded token multiplies by: every projection kernel, k
  of each MoE layer's experts, and the tied embedding [V, D] (as [D, V])."""
  d, k = config.model.d_model, config.model.experts_per_token
  found = []

  def visit(tree, name=""):
    if not isinstance(tree, dict):
      if name == "kernel" and tree.ndim >= 2:
        rows = tree.shape[0] if tree.shape[0] == d else math.prod(tree.shape[:-1])
        found.append(tree.reshape(rows, -1))
      elif name == "embedding":
        found.append(tree.T)
      return
    if set(tree) == {"gate", "up", "down"} and getattr(tree["gate"], "ndim", 0) == 3:   # Experts
      for w in ("gate", "up", "down"):
        found.extend(tree[w][:k])
      return
    for key, value in tree.items():
      visit(value, key)

  visit(params)
  return found


def floor_seconds_per_token(matrices: list, steps: int, rounds: int) -> float:
  """Median seconds of one step of `matrices`' products in a jitted loop of `steps`."""
  width = max(m.shape[0] for m in matrices)

  def step(_, x):
    for m in matrices:
      y = vector_product(x[:, :m.shape[0]], m)
      x = x + 1e-9 * jnp.pad(y, ((0, 0), (0, max(width - y.shape[1], 0))))[:, :width]
    return x

  run = jax.jit(lambda ms, x: jax.lax.fori_loop(0, steps, step, x))
  x = jnp.ones((1, width), jnp.float32)
  seconds = common.median_seconds(lambda: jax.block_until_ready(run(matrices, x)),
                                  min_runs=rounds)
  return seconds / steps


def ours_seconds_per_token(config, params, prompts, new_tokens: int, rounds: int) -> float:
  dec = decoding.make_decoding(config)
  lengths = jnp.full(prompts.shape[:1], prompts.shape[1], jnp.int32)

  def generate(n):
    return lambda: np.asarray(sampler.generate(
        dec, params, prompts, lengths, jax.random.key(0), jnp.zeros((0,), jnp.int32),
        max_new_tokens=n, cache_length=prompts.shape[1] + new_tokens - 1,
        cache_dtype=decoding.default_cache_dtype(config)))
  one, many = generate(1), generate(new_tokens)
  times = common.alternating_medians({"one": one, "many": many}, rounds)
  return (times["many"] - times["one"]) / (new_tokens - 1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results, rows = [], []
  for name in FLAGS.shapes:
    config = sbs.model_config(name)
    prompts = jnp.asarray(sbs.random_tokens(config.model.vocab_size, (1, FLAGS.prompt_len), 0))
    model = gj.transform(config)
    params = decoding.make_decoding(config).unrolled(model.init(jax.random.key(0), prompts))
    matrices = matrices_read_per_token(params, config)
    megabytes = sum(m.nbytes for m in matrices) / 2**20
    floor = floor_seconds_per_token(matrices, FLAGS.new_tokens, FLAGS.rounds)
    ours = ours_seconds_per_token(config, params, prompts, FLAGS.new_tokens, FLAGS.rounds)
    results.append({"shape": name, "matrices": len(matrices), "weights_mib": megabytes,
                    "floor_ms_per_token": 1e3 * floor, "ours_ms_per_token": 1e3 * ours,
                    "floor_gib_per_s": megabytes / 1024 / floor, "ours_over_floor": ours / floor})
    r = results[-1]
    rows.append([name, r["matrices"], f"{megabytes:.0f}", f"{r['floor_ms_per_token']:.2f}",
                 f"{r['floor_gib_per_s']:.1f}", f"{r['ours_ms_per_token']:.2f}",
                 f"{r['ours_over_floor']:.2f}x"])
    print(r, flush=True)
  common.print_table(
      f"greedy decoding at batch 1 after {FLAGS.prompt_len} prompt tokens, float32",
      ["shape", "products/token", "MiB/token", "floor ms/token", "floor GiB/s",
       "ours ms/token", "ours / floor"], rows)
  common.write_json(common.output_path(FLAGS.out, "decode_floor"),
                    {"prompt_len": FLAGS.prompt_len, "new_tokens": FLAGS.new_tokens,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
