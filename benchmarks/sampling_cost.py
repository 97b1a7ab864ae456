r"""What picking one token costs: `sampling.choose` per call, jitted, at a vocabulary size.

    python benchmarks/sampling_cost.py                      # Gemma's 262144 ids, 1 and 8 rows
    python benchmarks/sampling_cost.py --vocab=262144 --rows=1 --out=/tmp/sampling.json

A decoded token is one forward step and one choice; at Gemma's vocabulary the choice is
a pass or more over 262144 logits per row. Greedy is one argmax; a draw adds the
temperature and a random number per logit (`jax.random.categorical`); top-k a partial
sort; top-p the nucleus, found by bisection over the logits (32 masked sums) rather than
by sorting them. Each row of the table is one kind of options (a compiled program);
"programs" is how many the listed values compiled (every value of a kind shares one).
"""

from absl import app
from absl import flags
import jax
import numpy as np

import common
from gemma_jax.inference import sampling

_VOCAB = flags.DEFINE_integer("vocab", 262_144, "Logits per row.")
_ROWS = flags.DEFINE_list("rows", ["1", "8"], "Batch sizes.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/sampling_cost_<backend>.json.")

KINDS = {   # name -> the option values timed (temperature, top_k, top_p), one program each
    "greedy": [(0.0, 0, 1.0)],
    "temperature": [(0.7, 0, 1.0), (1.0, 0, 1.0)],
    "top_k": [(0.7, 40, 1.0), (1.0, 64, 1.0)],
    "top_p": [(0.7, 0, 0.95), (1.0, 0, 0.9)],
    "top_k + top_p (chat.py's defaults)": [(0.7, 64, 0.95), (1.0, 40, 0.9)],
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = []
  for rows in [int(r) for r in _ROWS.value]:
    logits = np.random.default_rng(0).normal(size=(rows, _VOCAB.value)).astype(np.float32) * 3
    for kind, values in KINDS.items():
      choose = jax.jit(lambda *args: sampling.choose(*args))   # a cache of its own
      times = []
      for temperature, top_k, top_p in values:
        options = sampling.Sampling.of(temperature, top_k, top_p, _VOCAB.value)
        run = lambda: choose(logits, jax.random.key(1), options).block_until_ready()
        times.append(common.median_seconds(run))
      results.append({"rows": rows, "kind": kind, "ms": 1e3 * float(np.median(times)),
                      "programs": choose._cache_size()})   # pylint: disable=protected-access
      print(results[-1], flush=True)
  print(f"\n| rows | options | ms per choice | programs for {len(values)} values |")
  print("|---|---|---|---|")
  for r in results:
    print(f"| {r['rows']} | {r['kind']} | {r['ms']:.2f} | {r['programs']} |")
  common.write_json(common.output_path(_OUT.value, "sampling_cost"),
                    {"vocab": _VOCAB.value, "results": results})


if __name__ == "__main__":
  app.run(main)
