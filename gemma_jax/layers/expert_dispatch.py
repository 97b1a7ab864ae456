"""Routed tokens through their experts: three dispatches with one signature.

    y = dispatch(x, expert_ids, weights, gate, up, down, hidden)

x [M, D] tokens (M = B * T), expert_ids / weights [M, k] the k experts each token is
routed to and their combine weights, gate / up [E, D, F] and down [E, F, D] the
experts' gated MLPs, hidden(gate_out, up_out) their hidden activations (e.g.
act(gate_out) * up_out); y [M, D] = sum over the k slots of weight * expert(x). All are
dropless: every assignment is computed, however unbalanced the routing.

  dense    every expert on every token, the unchosen ones weighted 0: E / k times the
           routed work. The reference.
  ragged   the M * k assignments sorted by expert and run as one grouped matmul per
           projection (`jax.lax.ragged_dot`), then unsorted and combined. Native on
           TPU. XLA's CPU and NVIDIA GPU backends expand ragged_dot into a dense
           product of every row with every expert's weights, the rows masked per
           expert (XLA's `RaggedDotRewriter`; on a GPU only an experimental flag with
           cuDNN >= 9.22 routes it elsewhere): E times the work and an [A, E, D]
           temporary.
  loop     sorted the same way, the experts' MLPs as one batched product over each
           expert's first C rows and a loop over experts and blocks of rows for the
           rest (`grouped_mlp`): the routed work plus the padding of short experts' C
           rows and of the loop's blocks. For the CPU and GPUs.
  gather   each assignment's expert weights gathered and applied to its token: the
           routed work exactly, reading M * k expert matrices. For few tokens (decoding),
           where that is fewer than the E every grouped matmul reads.
  sliced   the same work as gather, one assignment at a time in a loop, its expert's
           weights sliced out: for few tokens on the CPU, where XLA runs gather's
           [M, k, D, F] gathers and batched products at a fraction of the memory's speed.
"""

import functools
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from gemma_jax.layers import grouped_mlp
from gemma_jax.layers.matmul import vector_product


def _sort_by_expert(expert_ids: jax.Array, num_experts: int):
  """[M, k] -> (order [A]: assignment indices sorted by expert, group_sizes [E]); A = M * k."""
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _combine(per_assignment: jax.Array, weights: jax.Array) -> jax.Array:
  """[A, D] outputs in assignment order (token-major), weights [M, k] -> [M, D]."""
  m, k = weights.shape
  out = per_assignment.reshape(m, k, -1)
  return jnp.einsum("mkd,mk->md", out, weights.astype(out.dtype))


def dense(x, expert_ids, weights, gate, up, down, hidden: Callable) -> jax.Array:
  """Every expert on every token, combined with zero weight where not routed."""
  m = x.shape[0]
  combine = jnp.zeros((m, gate.shape[0]), x.dtype).at[
      jnp.arange(m)[:, None], expert_ids].add(weights.astype(x.dtype))      # [M, E]
  h = hidden(jnp.einsum("md,edf->emf", x, gate), jnp.einsum("md,edf->emf", x, up))
  out = jnp.einsum("emf,efd->emd", h, down)
  return jnp.einsum("emd,me->md", out, combine)


def _sorted(x, expert_ids, weights, num_experts: int, mlp: Callable) -> jax.Array:
  """Assignments sorted by expert, `mlp(rows, group_sizes)` on them ([A, D] -> [A, D]),
  then unsorted and combined."""
  k = expert_ids.shape[1]
  order, sizes = _sort_by_expert(expert_ids, num_experts)
  out = mlp(x[order // k], sizes)                                          # [A, D] sorted
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
  return _combine(out[inverse], weights)


def ragged(x, expert_ids, weights, gate, up, down, hidden: Callable,
           ragged_dot: Callable = jax.lax.ragged_dot) -> jax.Array:
  """Grouped matmuls by `ragged_dot` (lhs [A, D], rhs [E, D, F], group_sizes [E],
  preferred_element_type; default `jax.lax.ragged_dot`, or a kernel library's with its
  signature, e.g. tokamax's), one per projection."""
  def mlp(rows, sizes):
    project = lambda a, w: ragged_dot(a, w, sizes, preferred_element_type=x.dtype)
    return project(hidden(project(rows, gate), project(rows, up)), down)
  return _sorted(x, expert_ids, weights, gate.shape[0], mlp)


def loop(x, expert_ids, weights, gate, up, down, hidden: Callable,
         blocks: Tuple[int, ...] = grouped_mlp.BLOCK_ROWS,
         capacity_rows: Optional[int] = None) -> jax.Array:
  """The experts' MLPs by `grouped_mlp.grouped_mlp`: each expert's first `capacity_rows`
  rows batched (default `grouped_mlp.capacity`), the rest in a loop over experts and
  blocks of rows, in the tiers `blocks` (largest first)."""
  mlp = lambda rows, sizes: grouped_mlp.grouped_mlp(rows, gate, up, down, sizes, hidden, blocks,
                                                    capacity_rows)
  return _sorted(x, expert_ids, weights, gate.shape[0], mlp)


def gather(x, expert_ids, weights, gate, up, down, hidden: Callable) -> jax.Array:
  """Each token through its k experts' gathered weights ([M, k, D, F] each)."""
  h = hidden(jnp.einsum("md,mkdf->mkf", x, gate[expert_ids]),
             jnp.einsum("md,mkdf->mkf", x, up[expert_ids]))
  out = jnp.einsum("mkf,mkfd->mkd", h, down[expert_ids])
  return jnp.einsum("mkd,mk->md", out, weights.astype(out.dtype))


def _expert_mlp(row, gate, up, down, hidden: Callable) -> jax.Array:
  """One row [1, D] through one expert's gate, up [D, F] and down [F, D] -> [1, D]."""
  return vector_product(hidden(vector_product(row, gate), vector_product(row, up)), down)


def _one_assignment_at_a_time(x, expert_ids, weights, expert_mlp: Callable) -> jax.Array:
  """`lax.map` over the M * k assignments: expert_mlp(row [1, D], expert) -> [1, D]."""
  k = expert_ids.shape[1]
  flat = expert_ids.reshape(-1)
  tokens = jnp.arange(flat.size, dtype=flat.dtype) // k
  out = jax.lax.map(lambda te: expert_mlp(jax.lax.dynamic_slice_in_dim(x, te[0], 1), te[1])[0],
                    (tokens, flat))
  return _combine(out, weights)


def sliced(x, expert_ids, weights, gate, up, down, hidden: Callable) -> jax.Array:
  """Each assignment's token through its expert's weights, sliced out one assignment at
  a time (`lax.map` over the M * k assignments)."""
  def expert_mlp(row, expert):
    weight = lambda w: jax.lax.dynamic_index_in_dim(w, expert, keepdims=False)
    return _expert_mlp(row, weight(gate), weight(up), weight(down), hidden)
  return _one_assignment_at_a_time(x, expert_ids, weights, expert_mlp)


def switched(x, expert_ids, weights, gate: Sequence[jax.Array], up: Sequence[jax.Array],
             down: Sequence[jax.Array], hidden: Callable) -> jax.Array:
  """As sliced, on the experts' weights as E arrays each (gate[e], up[e] [D, F],
  down[e] [F, D]; `moe.split_experts`): each assignment picks its expert's branch of a
  `lax.switch`, which reads that expert's arrays where they lie. No slice is copied out,
  as `sliced`'s are on the CPU before every product."""
  branches = [lambda row, g=g, u=u, d=d: _expert_mlp(row, g, u, d, hidden)
              for g, u, d in zip(gate, up, down)]
  return _one_assignment_at_a_time(x, expert_ids, weights,
                                   lambda row, expert: jax.lax.switch(expert, branches, row))


DISPATCHES = {"dense": dense, "ragged": ragged, "loop": loop, "gather": gather,
              "sliced": sliced}


def for_rows(name: str, assignments: int, num_experts: int) -> Callable:
  """The dispatch `name` ("auto": `resolve`d) for about `assignments` routed rows over
  `num_experts` experts: the loop with its capacity sized for those rows, not for the
  rows it is given (under expert parallelism, every device's assignments)."""
  resolved = resolve(name, assignments, num_experts)
  if resolved == "loop":
    return functools.partial(loop, capacity_rows=grouped_mlp.capacity(assignments,
                                                                      num_experts))
  return DISPATCHES[resolved]


def resolve(name: str, assignments: int, num_experts: int) -> str:
  """"auto" -> the dispatch that is fast for `assignments` (M * k) routed rows on the
  default backend: when they are fewer than the experts, gather (sliced on the CPU),
  else the grouped matmuls: ragged on a TPU, the loop elsewhere (where XLA would expand
  ragged_dot to E times the work). Other names unchanged."""
  if name != "auto":
    return name
  backend = jax.default_backend()
  if assignments < num_experts:
    return "sliced" if backend == "cpu" else "gather"
  return "ragged" if backend == "tpu" else "loop"
