"""Statistics of each layer's output (config `record_internal_nn_metrics`).

A layer calls `record(self, x)` on its output; the mean, standard deviation and fraction
of exact zeros are sown into the "intermediates" collection. `summarize` names them by
layer index: {"activation_mean/layer_3": scalar, ...}.
"""

import re
from typing import Dict

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

NAMES = ("activation_mean", "activation_stdev", "activation_fraction_zero")


def record(module: nn.Module, x: jax.Array) -> None:
  """Sows the statistics of x [B, T, D] (float32 scalars) from within `module`."""
  x32 = x.astype(jnp.float32)
  for name, value in zip(NAMES, (jnp.mean(x32), jnp.std(x32), jnp.mean(x == 0))):
    module.sow("intermediates", name, value.astype(jnp.float32))


def summarize(intermediates: dict, period: int,
              segment_starts: Dict[str, int]) -> Dict[str, jax.Array]:
  """Sown statistics -> {f"{name}/layer_{i}": scalar}.

  A scanned segment's (`segment_starts`: its name -> first layer) layer `layer_{j}` holds
  one value per block b (layer start + b * period + j); an unscanned layer `layers_{i}`
  holds one value.
  """
  stats = {}
  for path, (value,) in flax.traverse_util.flatten_dict(intermediates).items():
    name, scope = path[-1], path[-2]
    if name not in NAMES:
      continue
    index = int(re.fullmatch(r"layers?_(\d+)", scope).group(1))
    if path[0] in segment_starts:
      start = segment_starts[path[0]]
      stats.update({f"{name}/layer_{start + b * period + index}": v
                    for b, v in enumerate(value)})
    else:
      stats[f"{name}/layer_{index}"] = value
  return stats
