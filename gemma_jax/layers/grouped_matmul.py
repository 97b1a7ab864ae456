"""A grouped matmul (`jax.lax.ragged_dot`'s semantics) that does only the grouped work.

XLA's CPU backend lowers `ragged_dot` to a masked product of every row with every
group's weights (E times the work). `grouped_matmul` instead loops: over the groups
(weights read once each) and, within a group, over blocks of `block` rows, so the
work is the rows' own plus at most one partial block per group. Reverse-mode
differentiable through a custom VJP (the loops have data-dependent trip counts).

Dims: A rows (sorted by group), D input width, F output width, E groups.
"""

import functools

import jax
import jax.numpy as jnp

BLOCK_ROWS = 32   # rows per matmul; benchmarks/moe_dispatch.py measures the choice


def _blocks(size: jax.Array, block: int) -> jax.Array:
  return (size + block - 1) // block


def _pad_rows(x: jax.Array, block: int) -> jax.Array:
  """Appends `block` zero rows, so that a block starting at any row stays in bounds."""
  return jnp.concatenate([x, jnp.zeros((block, x.shape[1]), x.dtype)])


def _forward(rows, weights, group_sizes, block, transposed=False):
  """rows [A, D] -> [A, F] with weights [E, D, F], or [E, F, D] used transposed."""
  a, d = rows.shape
  f = weights.shape[1 if transposed else 2]
  contract = (((1,), (1 if transposed else 0,)), ((), ()))
  rows = _pad_rows(rows, block)
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(out, inputs):
    w, start, size = inputs

    def step(i, out):
      first = start + i * block
      product = jax.lax.dot_general(jax.lax.dynamic_slice(rows, (first, 0), (block, d)), w,
                                    contract)
      own = (jnp.arange(block) < size - i * block)[:, None]     # rows of the next group stay
      kept = jax.lax.dynamic_slice(out, (first, 0), (block, f))
      return jax.lax.dynamic_update_slice(out, jnp.where(own, product, kept), (first, 0))

    return jax.lax.fori_loop(0, _blocks(size, block), step, out), None

  out, _ = jax.lax.scan(group, jnp.zeros((a + block, f), rows.dtype),
                        (weights, starts, group_sizes))
  return out[:a]


def _weight_grad(rows, grad_out, group_sizes, block):
  """[E, D, F]: for each group, its rows' transpose times their output gradients."""
  d, f = rows.shape[1], grad_out.shape[1]
  rows, grad_out = _pad_rows(rows, block), _pad_rows(grad_out, block)
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(_, inputs):
    start, size = inputs

    def step(i, total):
      first = start + i * block
      own = (jnp.arange(block) < size - i * block)[:, None]
      x = jnp.where(own, jax.lax.dynamic_slice(rows, (first, 0), (block, d)), 0)
      g = jax.lax.dynamic_slice(grad_out, (first, 0), (block, f))
      return total + jnp.matmul(x.T, g, preferred_element_type=jnp.float32)

    return None, jax.lax.fori_loop(0, _blocks(size, block), step, jnp.zeros((d, f), jnp.float32))

  _, grads = jax.lax.scan(group, None, (starts, group_sizes))
  return grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                   block: int = BLOCK_ROWS) -> jax.Array:
  """rows [A, D] (group 0's rows first, then group 1's, ...), weights [E, D, F],
  group_sizes [E] int summing to A -> [A, F] in rows' dtype: row r of group e times weights[e]."""
  return _forward(rows, weights, group_sizes, block)


def _grouped_matmul_fwd(rows, weights, group_sizes, block):
  return _forward(rows, weights, group_sizes, block), (rows, weights, group_sizes)


def _grouped_matmul_bwd(block, residuals, grad_out):
  rows, weights, group_sizes = residuals
  grad_rows = _forward(grad_out, weights, group_sizes, block, transposed=True)
  grad_weights = _weight_grad(rows, grad_out, group_sizes, block).astype(weights.dtype)
  return grad_rows.astype(rows.dtype), grad_weights, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
