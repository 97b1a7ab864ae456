"""The experts' gated MLPs on rows grouped by expert, as one loop over groups and blocks.

    out = grouped_mlp(rows, gate, up, down, group_sizes, hidden)
    # out[r] = hidden(rows[r] @ gate[e], rows[r] @ up[e]) @ down[e], e the group of row r

What three `jax.lax.ragged_dot`s would compute, without their cost on the CPU: XLA's CPU
backend lowers ragged_dot to a masked product of every row with every group's weights
(E times the work). This loops instead: over the groups (weights read once each) and,
within a group, over blocks of rows in tiers: as many whole blocks of the largest size
as fit, then of the next size, and the rest in blocks of the smallest (the last one
partial). Large blocks keep the matmuls efficient; the small ones bound the wasted work
to less than one small block per group. A block goes through its expert's whole MLP in
one loop body, and the backward pass is one more loop over the saved gate and up
outputs, not a loop per projection and per gradient. Reverse-mode differentiable through
a custom VJP (the loops have data-dependent trip counts).

Dims: A rows (sorted by group), D model width, F hidden width, E groups, R a block's rows.
"""

import functools
from typing import Callable, Iterator, Sequence, Tuple

import jax
import jax.numpy as jnp

BLOCK_ROWS = (128, 32)   # row tiers, largest first; benchmarks/moe_dispatch.py times choices

Hidden = Callable[[jax.Array, jax.Array], jax.Array]   # gate, up outputs [R, F] -> [R, F]


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
  """Rows `grouped_mlp` runs for `group_sizes` [E] (summing to A): every group's blocks
  in full, its last one padded. Over A, the work done per work needed."""
  rows = int(jnp.sum(group_sizes))
  return sum(jnp.sum(count * block) for block, _, count in _tiers(group_sizes, blocks, rows))


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """Appends zero rows, so that a block starting at any row stays in bounds."""
  return jnp.concatenate([x, jnp.zeros((rows, x.shape[1]), x.dtype)])


def _pure(hidden: Hidden, blocks: Sequence[int], width: int, dtype) -> Tuple[Hidden, ...]:
  """`hidden` traced into a pure function per block size, here, where a Flax interceptor
  (quantization's hook on `Experts.hidden`) applies: the backward pass, traced after the
  model's apply has returned, then runs the same operations."""
  pure = []
  for block in blocks:
    spec = jax.ShapeDtypeStruct((block, width), dtype)
    fn, consts = jax.closure_convert(hidden, spec, spec)
    if consts:
      raise ValueError(f"an expert's hidden(gate, up) must depend on its inputs alone; it "
                       f"closes over {len(consts)} array(s), which would get no gradient")
    pure.append(fn)
  return tuple(pure)


def _forward(rows, gate, up, down, group_sizes, hiddens, blocks, save: bool):
  """-> (out [A + pad, D],) and with `save` the gate and up outputs [A + pad, F].

  A group's last, partial block also writes rows of the groups after it; they write
  their own rows later (the scan goes in group order), so no masking is needed.
  """
  a, d = rows.shape
  hidden = dict(zip(blocks, hiddens))
  rows = _pad_rows(rows, blocks[-1])
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(outs, inputs):
    w_gate, w_up, w_down, start, size = inputs
    for block, offset, count in _tiers(size, blocks, a):
      def step(i, outs, block=block, first=start + offset):
        row = first + i * block
        x = jax.lax.dynamic_slice(rows, (row, 0), (block, d))
        g, u = x @ w_gate, x @ w_up
        new = (hidden[block](g, u) @ w_down, g, u)
        return tuple(jax.lax.dynamic_update_slice(o, n.astype(o.dtype), (row, 0))
                     for o, n in zip(outs, new))
      outs = jax.lax.fori_loop(0, count, step, outs)
    return outs, None

  widths = (d, gate.shape[2], gate.shape[2])[:3 if save else 1]
  dtype = jnp.result_type(rows, gate)
  outs = tuple(jnp.zeros((rows.shape[0], width), dtype) for width in widths)
  outs, _ = jax.lax.scan(group, outs, (gate, up, down, starts, group_sizes))
  return outs


def _backward(rows, gate, up, down, group_sizes, saved_gate, saved_up, grad_out, hiddens,
              blocks):
  """-> grad_rows [A, D], and float32 gradients of gate, up and down, summed per group."""
  a, d = rows.shape
  hidden = dict(zip(blocks, hiddens))
  rows, grad_out = _pad_rows(rows, blocks[-1]), _pad_rows(grad_out, blocks[-1])
  starts = jnp.cumsum(group_sizes) - group_sizes

  def group(grad_rows, inputs):
    w_gate, w_up, w_down, start, size = inputs
    sums = tuple(jnp.zeros(w.shape, jnp.float32) for w in (w_gate, w_up, w_down))
    for block, offset, count in _tiers(size, blocks, a):
      def step(i, carry, block=block, offset=offset):
        grad_rows, sums = carry
        row = start + offset + i * block
        take = lambda v: jax.lax.dynamic_slice(v, (row, 0), (block, v.shape[1]))
        own = (jnp.arange(block) < size - offset - i * block)[:, None]   # not the next group's
        dy = take(grad_out)
        h, hidden_vjp = jax.vjp(hidden[block], take(saved_gate), take(saved_up))
        dg, du = hidden_vjp((dy @ w_down.T).astype(h.dtype))
        grad_rows = jax.lax.dynamic_update_slice(
            grad_rows, (dg @ w_gate.T + du @ w_up.T).astype(grad_rows.dtype), (row, 0))
        x, h = jnp.where(own, take(rows), 0), jnp.where(own, h, 0)
        products = ((x, dg), (x, du), (h, dy))
        return grad_rows, tuple(s + jnp.matmul(p.T, q, preferred_element_type=jnp.float32)
                                for s, (p, q) in zip(sums, products))
      grad_rows, sums = jax.lax.fori_loop(0, count, step, (grad_rows, sums))
    return grad_rows, sums

  grad_rows, grads = jax.lax.scan(group, jnp.zeros(rows.shape, rows.dtype),
                                  (gate, up, down, starts, group_sizes))
  return grad_rows[:a], grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _grouped_mlp(rows, gate, up, down, group_sizes, hiddens, blocks):
  return _forward(rows, gate, up, down, group_sizes, hiddens, blocks, save=False)[0][
      :rows.shape[0]]


def _grouped_mlp_fwd(rows, gate, up, down, group_sizes, hiddens, blocks):
  out, saved_gate, saved_up = _forward(rows, gate, up, down, group_sizes, hiddens, blocks,
                                       save=True)
  return out[:rows.shape[0]], (rows, gate, up, down, group_sizes, saved_gate, saved_up)


def _grouped_mlp_bwd(hiddens, blocks, residuals, grad_out):
  rows, gate, up, down = residuals[:4]
  grad_rows, grads = _backward(*residuals, grad_out, hiddens, blocks)
  return (grad_rows.astype(rows.dtype),
          *(g.astype(w.dtype) for g, w in zip(grads, (gate, up, down))), None)


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)


def grouped_mlp(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                group_sizes: jax.Array, hidden: Hidden,
                blocks: Sequence[int] = BLOCK_ROWS) -> jax.Array:
  """rows [A, D] (group 0's rows first, then group 1's, ...), gate and up [E, D, F],
  down [E, F, D], group_sizes [E] int summing to A, hidden(gate_out, up_out) a row-wise
  function of two [R, F] arrays (e.g. gelu(gate_out) * up_out) -> [A, D]: row r of
  group e through expert e's MLP. `blocks`: the row tiers, largest first."""
  blocks = tuple(blocks)
  hiddens = _pure(hidden, blocks, gate.shape[2], jnp.result_type(rows, gate))
  return _grouped_mlp(rows, gate, up, down, group_sizes, hiddens, blocks)
