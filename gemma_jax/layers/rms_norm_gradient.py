"""RMSNorm's gradient as one Pallas (Triton) kernel, for GPUs.

XLA runs RMSNorm's gradient as two or three kernels per norm (the rows' sums, the
scale's column sums, dx), each reading x and dy again. This kernel reads x and dy once,
a block of rows at a time, and writes dx and each program's column sums of dy * x_hat,
which XLA adds: faster than XLA's on an H100 for every norm of gemma3-1b
(`benchmarks/norm_gradient.py`; docs/performance.md). `norms.RMSNorm` uses it on a
single GPU; the forward pass stays XLA's.

  y = x_hat * w,  x_hat = x * r,  r = rsqrt(mean(x^2) + eps)
  dx = r * (g - x_hat * mean(g * x_hat)),  g = dy * w;  dw = sum over rows of dy * x_hat
"""

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

# Elements of a [rows, width] block a program holds per array (registers, not memory).
_BLOCK_ELEMENTS = 8192
# Programs a backward pass runs: a few waves of an H100's 132 multiprocessors, each
# summing dw over its rows in registers (so the partial sums XLA adds stay small).
_PROGRAMS = 512


def backward(x: jax.Array, weight: jax.Array, dy: jax.Array, eps: float, *,
             block_rows: int = 0, programs: int = _PROGRAMS, num_warps: int = 4,
             num_stages: int = 0):
  """x, dy [M, D], weight [D] float32 -> (dx [M, D] in x's dtype, dw [D] float32).

  Each of `programs` programs takes consecutive blocks of `block_rows` rows (0: the
  largest power of two whose rows hold at most `_BLOCK_ELEMENTS`). Triton's blocks have
  power-of-two widths, so a row is taken as the powers of two that sum to D (1152 as
  1024 + 128): no lane is masked off. Off a GPU it runs in Pallas's interpreter."""
  rows, width = x.shape
  if rows == 0:
    return jnp.zeros_like(x), jnp.zeros((width,), jnp.float32)
  block_rows = block_rows or 1 << max(0, (_BLOCK_ELEMENTS // width).bit_length() - 1)
  blocks = pl.cdiv(rows, block_rows * programs)
  programs = pl.cdiv(rows, block_rows * blocks)
  pieces = tuple(1 << b for b in reversed(range(width.bit_length())) if width >> b & 1)
  kernel = functools.partial(_backward_kernel, eps=eps, pieces=pieces,
                             block_rows=block_rows, blocks=blocks)
  dx, partial_dw = pl.pallas_call(
      kernel, grid=(programs,),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((programs * width,), jnp.float32)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages or None),
      interpret=jax.default_backend() != "gpu", name="rms_norm_backward",
  )(x, weight.astype(jnp.float32), dy)
  return dx, partial_dw.reshape(programs, width).sum(axis=0)


def _backward_kernel(x_ref, w_ref, dy_ref, dx_ref, dw_ref, *, eps, pieces, block_rows,
                     blocks):
  """One program: `blocks` blocks of [block_rows, D], each row as `pieces` columns."""
  rows, width = x_ref.shape
  program = pl.program_id(0)
  starts = [sum(pieces[:i]) for i in range(len(pieces))]
  cols = [start + jnp.arange(piece) for start, piece in zip(starts, pieces)]
  w = [w_ref[pl.ds(start, piece)] for start, piece in zip(starts, pieces)]

  def block(i, dw):
    row = (program * blocks + i) * block_rows + jnp.arange(block_rows)
    inside = [jnp.broadcast_to((row < rows)[:, None], (block_rows, p)) for p in pieces]
    at = [(row[:, None], c[None, :]) for c in cols]
    load = lambda ref, j: plgpu.load(ref.at[at[j]], mask=inside[j], other=0.0
                                     ).astype(jnp.float32)
    x = [load(x_ref, j) for j in range(len(pieces))]
    dy = [load(dy_ref, j) for j in range(len(pieces))]
    r = jax.lax.rsqrt(sum(jnp.sum(a * a, axis=1, keepdims=True) for a in x) / width + eps)
    x_hat = [a * r for a in x]
    g = [d * v[None, :] for d, v in zip(dy, w)]
    c = sum(jnp.sum(a * b, axis=1, keepdims=True) for a, b in zip(g, x_hat)) / width
    for j in range(len(pieces)):
      plgpu.store(dx_ref.at[at[j]], (r * (g[j] - x_hat[j] * c)).astype(dx_ref.dtype),
                  mask=inside[j])
    return tuple(s + d * a for s, d, a in zip(dw, dy, x_hat))

  dw = jax.lax.fori_loop(0, blocks, block, tuple(
      jnp.zeros((block_rows, p), jnp.float32) for p in pieces))
  for start, piece, partial in zip(starts, pieces, dw):
    dw_ref[pl.ds(program * width + start, piece)] = jnp.sum(partial, axis=0)
