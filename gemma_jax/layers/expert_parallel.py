"""Expert parallelism: each device of the `expert` mesh axis runs only its own experts.

Under a mesh whose `expert` axis has P > 1 devices, the expert weights [E, D, F] are
split into P shards of E / P experts (the `expert` logical axis). Left to the compiler,
a dispatch would all-gather every expert's weights onto every device. `run_sharded`
instead moves the tokens, which are far smaller than the experts of a real MoE:

  1. all-gather the tokens, their expert ids and combine weights over `expert`
     (each device now holds its expert group's M tokens);
  2. run the dispatch on the assignments routed to this device's experts (the others
     are sent to no group and weighted 0: no work, no contribution);
  3. reduce-scatter the partial outputs over `expert`: each device gets the sum over
     all experts for its own M / P tokens.

Communication per layer is 2 x M x D activations instead of E x 3 x D x F weights,
and each device computes 1 / P of the routed work. Dropless, like the dispatches.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gemma_jax.config import BATCH_AXES

AXIS = "expert"


def expert_shards(num_tokens: int) -> int:
  """P, the devices of the active mesh's `expert` axis, when the tokens [M] can be split
  over the batch axes as `run_sharded` needs; 1 (no expert parallelism) otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get(AXIS, 1) == 1:
    return 1
  rows = 1
  for axis in BATCH_AXES:
    rows *= mesh.shape.get(axis, 1)
  return mesh.shape[AXIS] if num_tokens % rows == 0 else 1


def run_sharded(dispatch: Callable[[int, int], Callable], x, expert_ids, weights, gate, up,
                down, hidden: Callable) -> jax.Array:
  """A dispatch's `y = run(x, expert_ids, weights, gate, up, down, hidden)` [M, D],
  each device of the active mesh's `expert` axis running its E / P experts.

  dispatch(assignments, experts) picks the dispatch for the per-device problem (see
  `expert_dispatch.for_rows`): about 1 / P of the gathered assignments, over E / P
  experts.
  """
  mesh = jax.sharding.get_abstract_mesh()
  rows = PartitionSpec(tuple(a for a in BATCH_AXES if a in mesh.shape), None)
  experts = PartitionSpec(AXIS, None, None)

  def local(x, expert_ids, weights, gate, up, down):
    gather = lambda a: jax.lax.all_gather(a, AXIS, axis=0, tiled=True)
    x, expert_ids, weights = gather(x), gather(expert_ids), gather(weights)
    count = gate.shape[0]
    first = jax.lax.axis_index(AXIS) * count
    mine = (expert_ids >= first) & (expert_ids < first + count)
    local_ids = jnp.where(mine, expert_ids - first, count)      # `count`: no group
    run = dispatch(expert_ids.size // mesh.shape[AXIS], count)
    y = run(x, local_ids, jnp.where(mine, weights, 0), gate, up, down, hidden)
    return jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)

  return jax.shard_map(local, in_specs=(rows, rows, rows, experts, experts, experts),
                       out_specs=rows, check_vma=False)(x, expert_ids, weights, gate, up, down)
