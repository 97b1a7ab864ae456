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
           projection (`jax.lax.ragged_dot`), then unsorted and combined. Native on GPU
           and TPU; XLA's CPU backend lowers ragged_dot to a masked product over every
           expert, E times the work.
  loop     sorted the same way, the grouped matmuls as loops over experts and blocks
           of rows (`grouped_matmul`): the routed work plus less than one small block
           per expert. For the CPU.
  gather   each assignment's expert weights gathered and applied to its token: the
           routed work exactly, reading M * k expert matrices. For few tokens (decoding),
           where that is fewer than the E every grouped matmul reads.
"""

import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp

from gemma_jax.layers import grouped_matmul


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


def _sorted(x, expert_ids, weights, gate, up, down, hidden, matmul) -> jax.Array:
  """Assignments sorted by expert, the grouped `matmul(rows, w, group_sizes)` per
  projection, then unsorted and combined."""
  k = expert_ids.shape[1]
  order, sizes = _sort_by_expert(expert_ids, gate.shape[0])
  rows = x[order // k]                                                      # [A, D]
  project = lambda a, w: matmul(a, w, sizes)
  out = project(hidden(project(rows, gate), project(rows, up)), down)      # [A, D] sorted
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
  return _combine(out[inverse], weights)


def ragged(x, expert_ids, weights, gate, up, down, hidden: Callable) -> jax.Array:
  """Grouped matmuls by `jax.lax.ragged_dot`."""
  matmul = functools.partial(jax.lax.ragged_dot, preferred_element_type=x.dtype)
  return _sorted(x, expert_ids, weights, gate, up, down, hidden, matmul)


def loop(x, expert_ids, weights, gate, up, down, hidden: Callable,
         blocks: Tuple[int, ...] = grouped_matmul.BLOCK_ROWS) -> jax.Array:
  """Grouped matmuls by `grouped_matmul.grouped_matmul`: loops over experts and blocks
  of rows, in the tiers `blocks` (largest first)."""
  matmul = lambda rows, w, sizes: grouped_matmul.grouped_matmul(rows, w, sizes, blocks)
  return _sorted(x, expert_ids, weights, gate, up, down, hidden, matmul)


def gather(x, expert_ids, weights, gate, up, down, hidden: Callable) -> jax.Array:
  """Each token through its k experts' gathered weights ([M, k, D, F] each)."""
  h = hidden(jnp.einsum("md,mkdf->mkf", x, gate[expert_ids]),
             jnp.einsum("md,mkdf->mkf", x, up[expert_ids]))
  out = jnp.einsum("mkf,mkfd->mkd", h, down[expert_ids])
  return jnp.einsum("mkd,mk->md", out, weights.astype(out.dtype))


DISPATCHES = {"dense": dense, "ragged": ragged, "loop": loop, "gather": gather}


def resolve(name: str, assignments: int, num_experts: int) -> str:
  """"auto" -> the dispatch that is fast for `assignments` (M * k) routed rows on the
  default backend: gather when they are fewer than the experts, else the grouped
  matmuls (ragged on GPU/TPU, the loop on the CPU). Other names unchanged."""
  if name != "auto":
    return name
  if assignments < num_experts:
    return "gather"
  return "loop" if jax.default_backend() == "cpu" else "ragged"
