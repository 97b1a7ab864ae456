"""A grouped matmul (`jax.lax.ragged_dot`'s semantics) that does only the grouped work.

XLA's CPU backend lowers `ragged_dot` to a masked product of every row with every
group's weights (E times the work). `grouped_matmul` instead loops: over the groups
(weights read once each) and, within a group, over blocks of rows in tiers: as many
whole blocks of the largest size as fit, then of the next size, and the rest in blocks
of the smallest (the last one partial). Large blocks keep the matmuls efficient; the
small ones bound the wasted work to less than one small block per group.
Reverse-mode differentiable through a custom VJP (the loops have data-dependent trip
counts).

Dims: A rows (sorted by group), D input width, F output width, E groups.
"""

import functools
from typing import Iterator, Sequence, Tuple

import jax
import jax.numpy as jnp

BLOCK_ROWS = (128, 32)   # row tiers, largest first; benchmarks/moe_dispatch.py times choices


def _tiers(size: jax.Array, blocks: Sequence[int],
           rows: int) -> Iterator[Tuple[int, jax.Array, jax.Array]]:
  """(block, first row within the group, number of blocks) per tier for a group of
  `size` rows: whole blocks of every tier but the last, which also takes the remainder.
  Tiers longer than all `rows` (which no group can fill) are left out."""
  blocks = [b for b in blocks[:-1] if b <= rows] + [blocks[-1]]
  done = jnp.zeros_like(size)
  for i, block in enumerate(blocks):
    rest = size - done
    count = rest // block if i < len(blocks) - 1 else (rest + block - 1) // block
    yield block, done, count
    done = done + count * block


def computed_rows(group_sizes: jax.Array, blocks: Sequence[int] = BLOCK_ROWS) -> jax.Array:
  """Rows `grouped_matmul` multiplies for `group_sizes` [E] (summing to A): every
  group's blocks in full, its last one padded. Over A, the work done per work needed."""
  rows = int(jnp.sum(group_sizes))
  return sum(jnp.sum(count * block) for block, _, count in _tiers(group_sizes, blocks, rows))


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """Appends zero rows, so that a block starting at any row stays in bounds."""
  return jnp.concatenate([x, jnp.zeros((rows, x.shape[1]), x.dtype)])


def _forward(rows, weights, group_sizes, blocks, transposed=False):
  """rows [A, D] -> [A, F] with weights [E, D, F], or [E, F, D] used transposed.

  A group's last, partial block also writes rows of the groups after it; they write
  their own rows later (the scan goes in group order), so no masking is needed.
  """
  a, d = rows.shape
  f = weights.shape[1 if transposed else 2]
  contract = (((1,), (1 if transposed else 0,)), ((), ()))
  rows = _pad_rows(rows, blocks[-1])
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(out, inputs):
    w, start, size = inputs
    for block, offset, count in _tiers(size, blocks, a):
      def step(i, out, block=block, first=start + offset):
        row = first + i * block
        x = jax.lax.dynamic_slice(rows, (row, 0), (block, d))
        return jax.lax.dynamic_update_slice(out, jax.lax.dot_general(x, w, contract), (row, 0))
      out = jax.lax.fori_loop(0, count, step, out)
    return out, None

  out, _ = jax.lax.scan(group, jnp.zeros((a + blocks[-1], f), rows.dtype),
                        (weights, starts, group_sizes))
  return out[:a]


def _weight_grad(rows, grad_out, group_sizes, blocks):
  """[E, D, F]: for each group, its rows' transpose times their output gradients."""
  a, d, f = rows.shape + grad_out.shape[1:]
  rows, grad_out = _pad_rows(rows, blocks[-1]), _pad_rows(grad_out, blocks[-1])
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(_, inputs):
    start, size = inputs
    total = jnp.zeros((d, f), jnp.float32)
    for block, offset, count in _tiers(size, blocks, a):
      def step(i, total, block=block, offset=offset):
        row = start + offset + i * block
        own = (jnp.arange(block) < size - offset - i * block)[:, None]   # not the next group's
        x = jnp.where(own, jax.lax.dynamic_slice(rows, (row, 0), (block, d)), 0)
        g = jax.lax.dynamic_slice(grad_out, (row, 0), (block, f))
        return total + jnp.matmul(x.T, g, preferred_element_type=jnp.float32)
      total = jax.lax.fori_loop(0, count, step, total)
    return None, total

  _, grads = jax.lax.scan(group, None, (starts, group_sizes))
  return grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                   blocks: Tuple[int, ...] = BLOCK_ROWS) -> jax.Array:
  """rows [A, D] (group 0's rows first, then group 1's, ...), weights [E, D, F],
  group_sizes [E] int summing to A -> [A, F] in rows' dtype: row r of group e times
  weights[e]. `blocks`: the row tiers, largest first."""
  return _forward(rows, weights, group_sizes, blocks)


def _grouped_matmul_fwd(rows, weights, group_sizes, blocks):
  return _forward(rows, weights, group_sizes, blocks), (rows, weights, group_sizes)


def _grouped_matmul_bwd(blocks, residuals, grad_out):
  rows, weights, group_sizes = residuals
  grad_rows = _forward(grad_out, weights, group_sizes, blocks, transposed=True)
  grad_weights = _weight_grad(rows, grad_out, group_sizes, blocks).astype(weights.dtype)
  return grad_rows.astype(rows.dtype), grad_weights, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
