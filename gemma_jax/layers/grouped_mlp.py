"""The experts' gated MLPs on rows grouped by expert: a batched product over each group's
first C rows, and a loop over groups and blocks for the rows past them.

    out = grouped_mlp(rows, gate, up, down, group_sizes, hidden)
    # out[r] = hidden(rows[r] @ gate[e], rows[r] @ up[e]) @ down[e], e the group of row r

What three `jax.lax.ragged_dot`s would compute, without their cost off a TPU: XLA's CPU
and NVIDIA GPU backends lower ragged_dot to a masked product of every row with every
group's weights (E times the work).

Each group's first C rows (its capacity, `capacity`: the mean group size plus one
standard deviation of a uniform routing's) go through their expert as one batched
product per projection, [E, C, D] x [E, D, F]: XLA's CPU backend runs that at the speed
of one large matmul, twice that of the loop's 128-row products (16 experts of 256 rows,
D = F = 512: 243 against 118 GFLOP/s). A group shorter than C computes rows it does not
own (the next group's, or padding) and ignores them.

The rows past a group's capacity go through a loop over the groups that have such rows
(its expert's weights sliced once each) and, within a group, over blocks of rows in
tiers: as many whole blocks of the largest size as fit, then of the next size, and the
rest in blocks of the smallest (the last one partial, its other rows masked). Large
blocks keep the matmuls efficient; the small ones bound the wasted work to less than
one small block per group. A block goes through the whole MLP in one loop body. A
balanced routing leaves the loop little or nothing to do, and then it costs next to
nothing; however unbalanced the routing, nothing is dropped.

Reverse-mode differentiable through a custom VJP (the loops have data-dependent trip
counts): the batched part's backward is written out, the loop's recomputes its blocks'
gate and up outputs (they are few) and adds its weight gradients into the batched
part's. Rows move between the two layouts by gathers both ways.

Dims: A rows (sorted by group), D model width, F hidden width, E groups, C a group's
capacity, R a block's rows.
"""

import functools
import math
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

BLOCK_ROWS = (128, 32)   # row tiers, largest first; benchmarks/moe_dispatch.py times choices

Hidden = Callable[[jax.Array, jax.Array], jax.Array]   # gate, up outputs [R, F] -> [R, F]


def capacity(rows: int, groups: int) -> int:
  """C, the rows per group of the batched product: the mean group size plus its standard
  deviation under a uniform routing (about the mean's square root), rounded up, at most
  `rows`. Larger wastes batched rows on short groups; smaller sends more rows through
  the loop's slower blocks (16 experts of 256 rows on average: C = 272 and 288 timed
  alike; 264 0-4% and 256 5-10% slower, forward and backward)."""
  mean = rows / groups
  return min(rows, math.ceil(mean + math.sqrt(mean)))


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


def computed_rows(group_sizes: jax.Array, blocks: Sequence[int] = BLOCK_ROWS,
                  capacity_rows: Optional[int] = None) -> jax.Array:
  """Rows `grouped_mlp` multiplies for `group_sizes` [E] (summing to A): C per group,
  then every group's blocks past C in full, its last one padded. Over A, the work done
  per work needed."""
  rows = int(jnp.sum(group_sizes))
  c = capacity(rows, group_sizes.shape[0]) if capacity_rows is None else capacity_rows
  rest = jnp.maximum(group_sizes - c, 0)
  return group_sizes.shape[0] * c + sum(jnp.sum(count * block)
                                        for block, _, count in _tiers(rest, blocks, rows))


class _Layout(NamedTuple):
  """Where each row is computed, for rows of `group_sizes` [E] and capacity c."""
  starts: jax.Array       # [E] a group's first row
  ends: jax.Array         # [E] one past its last
  slots: jax.Array        # [E, c] the row in each batched slot (clipped to A - 1)
  owned: jax.Array        # [E, c] whether that row is the slot's group's
  slot_of_row: jax.Array  # [A] a row's batched slot in [E * c]; rows past c (the loop's)
                          # take their group's last, and the loop overwrites them
  grouped: jax.Array      # [A, 1] whether the row is in a group (the groups may end early)


def _layout(group_sizes: jax.Array, rows: int, c: int) -> _Layout:
  e = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  within = jnp.arange(c)
  group = jnp.minimum(jnp.sum(jnp.arange(rows)[:, None] >= ends, axis=1), e - 1)
  index = jnp.arange(rows) - starts[group]          # a row's index within its group
  return _Layout(starts, ends, jnp.minimum(starts[:, None] + within, rows - 1),
                 within < group_sizes[:, None], group * c + jnp.minimum(index, c - 1),
                 (jnp.arange(rows) < ends[-1])[:, None])


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  """x [A, D] with zero rows appended up to `rows` (x itself if it has as many): only a
  problem with fewer rows than a block needs them."""
  extra = rows - x.shape[0]
  return jnp.concatenate([x, jnp.zeros((extra, x.shape[1]), x.dtype)]) if extra > 0 else x


def _pure(hidden: Hidden, row_counts: Sequence[int], width: int, dtype) -> Dict[int, Hidden]:
  """`hidden` traced into a pure function per row count, here, where a Flax interceptor
  (quantization's hook on `Experts.hidden`) applies: the backward pass, traced after the
  model's apply has returned, then runs the same operations."""
  pure = {}
  for rows in row_counts:
    spec = jax.ShapeDtypeStruct((rows, width), dtype)
    fn, consts = jax.closure_convert(hidden, spec, spec)
    if consts:
      raise ValueError(f"an expert's hidden(gate, up) must depend on its inputs alone; it "
                       f"closes over {len(consts)} array(s), which would get no gradient")
    pure[rows] = fn
  return pure


def _loop(layout: _Layout, c: int, blocks: Sequence[int], rows: int, weights, carry,
          block_step: Callable, group_state: Callable = lambda: (),
          finish: Callable = lambda carry, state, e: carry):
  """Runs the loop over each group's rows from c on, group by group (only the groups
  with such rows), block by block in tiers -> the final carry. The arrays it indexes
  hold max(rows, smallest block) rows.

  Per group e, its experts' `weights` are sliced once and `state` starts as
  group_state(); per block, (carry, state) = block_step(carry, state, ws (e's weights),
  row (the block's first), block (its rows), own (a [block, 1] mask of the rows that are
  the block's to compute, None where all are)); after the group, carry = finish(carry,
  state, e). Whole blocks lie within their group. A partial one (the last tier's last)
  is its group's rows from its start to the group's end; one that would run past the
  arrays' end is moved back to end there, its mask then also excluding the rows before
  its start, which earlier blocks own.
  """
  length = max(rows, blocks[-1])
  first = layout.starts + c
  sizes = jnp.maximum(layout.ends - first, 0)
  busy = jnp.argsort(sizes == 0, stable=True)          # the groups with rows first

  def group(j, carry):
    e = busy[j]
    ws = tuple(_expert(w, e) for w in weights)
    tiers = list(_tiers(sizes[e], blocks, rows))
    state = group_state()
    for tier, (block, offset, count) in enumerate(tiers):
      def step(i, both, block=block, first=first[e] + offset, partial=tier == len(tiers) - 1):
        start = first + i * block
        row, own = start, None
        if partial:
          row = jnp.minimum(start, length - block)
          index = row + jnp.arange(block)[:, None]
          own = (index >= start) & (index < layout.ends[e])
        return block_step(*both, ws, row, block, own)
      carry, state = jax.lax.fori_loop(0, count, step, (carry, state))
    return finish(carry, state, e)
  return jax.lax.fori_loop(0, jnp.count_nonzero(sizes), group, carry)


def _expert(w: jax.Array, e: jax.Array) -> jax.Array:
  """Expert e's [D, F] or [F, D] of the stack w [E, ...]."""
  return jax.lax.dynamic_index_in_dim(w, e, keepdims=False)


def _batched_forward(rows, gate, up, down, layout: _Layout, hidden: Hidden):
  """Each group's first c rows [E, c, D] through its expert, one batched product per
  projection -> (out [E, c, D], gate and up outputs [E, c, F])."""
  x = rows[layout.slots]
  g, u = jnp.einsum("ecd,edf->ecf", x, gate), jnp.einsum("ecd,edf->ecf", x, up)
  shape = g.shape
  h = hidden(g.reshape(-1, shape[2]), u.reshape(-1, shape[2])).reshape(shape)
  return jnp.einsum("ecf,efd->ecd", h, down), g, u


def _forward(rows, gate, up, down, group_sizes, hiddens, blocks, c: int):
  """-> (out [A, D], the batched part's gate and up outputs [E, c, F])."""
  a, d = rows.shape
  e = gate.shape[0]
  layout = _layout(group_sizes, a, c)
  if c:
    out, g, u = _batched_forward(rows, gate, up, down, layout, hiddens[e * c])
    out = jnp.where(layout.grouped, out.reshape(e * c, d)[layout.slot_of_row], 0)
  else:
    out, g, u = jnp.zeros((a, d), jnp.result_type(rows, gate)), None, None
  out, rows = _pad_rows(out, blocks[-1]), _pad_rows(rows, blocks[-1])   # a < one block

  def step(out, state, ws, row, block, own):
    x = jax.lax.dynamic_slice_in_dim(rows, row, block)
    y = (hiddens[block](x @ ws[0], x @ ws[1]) @ ws[2]).astype(out.dtype)
    if own is not None:
      y = jnp.where(own, y, jax.lax.dynamic_slice_in_dim(out, row, block))
    return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0), state
  out = _loop(layout, c, blocks, a, (gate, up, down), out, step)
  return out[:a], g, u


def _accumulation(weights: jax.Array) -> jnp.dtype:
  """The dtype weight gradients are summed in: float32, or the weights' own if wider."""
  return jnp.promote_types(weights.dtype, jnp.float32)


def _batched_backward(rows, gate, up, down, layout: _Layout, saved_gate, saved_up, grad_out,
                      hidden: Hidden):
  """The batched part's backward -> (grad of its slots' rows [E, c, D], gradients of
  gate, up and down in `_accumulation` dtype). Slots past their group's rows get zero
  cotangents."""
  e, c, f = saved_gate.shape
  summed = functools.partial(jnp.einsum, preferred_element_type=_accumulation(gate))
  x = rows[layout.slots]
  dy = jnp.where(layout.owned[..., None], grad_out[layout.slots], 0)
  h, hidden_vjp = jax.vjp(hidden, saved_gate.reshape(e * c, f), saved_up.reshape(e * c, f))
  dh = jnp.einsum("ecd,efd->ecf", dy, down).reshape(e * c, f)
  dg, du = (t.reshape(e, c, f) for t in hidden_vjp(dh.astype(h.dtype)))
  dx = jnp.einsum("ecf,edf->ecd", dg, gate) + jnp.einsum("ecf,edf->ecd", du, up)
  return dx, (summed("ecd,ecf->edf", x, dg), summed("ecd,ecf->edf", x, du),
              summed("ecf,ecd->efd", h.reshape(e, c, f), dy))


def _backward(rows, gate, up, down, group_sizes, saved_gate, saved_up, grad_out, hiddens,
              blocks, c: int):
  """-> grad_rows [A, D], and gradients of gate, up and down in `_accumulation` dtype."""
  a, d = rows.shape
  e = gate.shape[0]
  acc = _accumulation(gate)
  layout = _layout(group_sizes, a, c)
  if c:
    grad_rows, grads = _batched_backward(rows, gate, up, down, layout, saved_gate, saved_up,
                                         grad_out, hiddens[e * c])
    grad_rows = jnp.where(layout.grouped, grad_rows.reshape(e * c, d)[layout.slot_of_row],
                          0).astype(rows.dtype)
  else:
    grad_rows = jnp.zeros_like(rows)
    grads = tuple(jnp.zeros(w.shape, acc) for w in (gate, up, down))
  # The loop: gate and up recomputed; its weight gradients added to the batched part's.
  grad_rows, rows, grad_out = (_pad_rows(v, blocks[-1]) for v in (grad_rows, rows, grad_out))

  def step(carry, sums, ws, row, block, own):
    (grad_rows, grads), (w_gate, w_up, w_down) = carry, ws
    take = lambda v: jax.lax.dynamic_slice_in_dim(v, row, block)
    x, dy = take(rows), take(grad_out)
    if own is not None:
      dy = jnp.where(own, dy, 0)
    h, hidden_vjp = jax.vjp(hiddens[block], x @ w_gate, x @ w_up)
    dg, du = hidden_vjp((dy @ w_down.T).astype(h.dtype))
    dx = (dg @ w_gate.T + du @ w_up.T).astype(grad_rows.dtype)
    if own is not None:
      dx = jnp.where(own, dx, take(grad_rows))
    products = ((x, dg), (x, du), (h, dy))
    return ((jax.lax.dynamic_update_slice_in_dim(grad_rows, dx, row, 0), grads),
            tuple(s + jnp.matmul(p.T, q, preferred_element_type=acc)
                  for s, (p, q) in zip(sums, products)))

  def finish(carry, sums, e):
    grad_rows, grads = carry
    return grad_rows, tuple(g.at[e].add(s) for g, s in zip(grads, sums))

  sums = lambda: tuple(jnp.zeros(w.shape[1:], acc) for w in (gate, up, down))
  grad_rows, grads = _loop(layout, c, blocks, a, (gate, up, down), (grad_rows, grads),
                           step, sums, finish)
  return grad_rows[:a], grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _grouped_mlp(rows, gate, up, down, group_sizes, hiddens, blocks, c):
  return _forward(rows, gate, up, down, group_sizes, hiddens, blocks, c)[0]


def _grouped_mlp_fwd(rows, gate, up, down, group_sizes, hiddens, blocks, c):
  out, saved_gate, saved_up = _forward(rows, gate, up, down, group_sizes, hiddens, blocks, c)
  return out, (rows, gate, up, down, group_sizes, saved_gate, saved_up)


def _grouped_mlp_bwd(hiddens, blocks, c, residuals, grad_out):
  rows, gate, up, down = residuals[:4]
  grad_rows, grads = _backward(*residuals, grad_out, hiddens, blocks, c)
  return (grad_rows, *(g.astype(w.dtype) for g, w in zip(grads, (gate, up, down))), None)


_grouped_mlp.defvjp(_grouped_mlp_fwd, _grouped_mlp_bwd)


def grouped_mlp(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                group_sizes: jax.Array, hidden: Hidden,
                blocks: Sequence[int] = BLOCK_ROWS,
                capacity_rows: Optional[int] = None) -> jax.Array:
  """rows [A, D] (group 0's rows first, then group 1's, ...), gate and up [E, D, F],
  down [E, F, D], group_sizes [E] int summing to A or less, hidden(gate_out, up_out) a
  row-wise function of two [R, F] arrays (e.g. gelu(gate_out) * up_out) -> [A, D]: row r
  of group e through expert e's MLP; rows past the last group zero, with zero gradients
  (under expert parallelism a device's groups hold only its own experts' rows). `blocks`: the loop's row tiers, largest first;
  `capacity_rows`: C (default `capacity`; 0: every row through the loop)."""
  a, e = rows.shape[0], gate.shape[0]
  c = capacity(a, e) if capacity_rows is None else capacity_rows
  blocks = tuple(blocks)
  hiddens = _pure(hidden, blocks + ((e * c,) if c else ()), gate.shape[2],
                  jnp.result_type(rows, gate))
  return _grouped_mlp(rows, gate, up, down, group_sizes, hiddens, blocks, c)
