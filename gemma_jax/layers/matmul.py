"""Matmuls shaped for XLA's CPU backend: weight gradients on YNNPACK, fusions kept apart.

XLA's CPU backend runs a matmul on YNNPACK only when its left operand is contracted over
its last dim. A weight gradient, x^T dy over rows [R, I] and [R, O], contracts both over
their first dim; XLA folds any transpose of x into the matmul and runs it through Eigen
instead, at 70-85% of the speed even counting the transpose made first
(docs/performance.md). `weight_gradient` therefore makes the narrower
of the two transposed, as an array of its own (`transposed`); other backends keep the
transpose foldable. The narrower: a LoRA adapter's A [I, r] has dy [R, r], and x^T
there was a copy of the whole input, which XLA fused with the input's own producer (the
MLP's activation, recomputed in transposed order at a high cost per layer).

A product of one row by a weight (decoding at batch 1) runs on one core there, bound by
that core's share of memory bandwidth, at about half PyTorch's rate on two cores. Split
into two halves that XLA runs as one batched matmul, one half per core, it streams the
weight at about the rate PyTorch does (`vector_product`).
"""

import jax
import jax.numpy as jnp


def transposed(x: jax.Array) -> jax.Array:
  """x [R, C] -> x^T [C, R], on a CPU as an array of its own that no matmul folds back in
  (an `optimization_barrier`); elsewhere a plain transpose."""
  return jax.lax.platform_dependent(
      x, cpu=lambda x: jax.lax.optimization_barrier(x.T), default=jnp.transpose)


def _halves(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [1, I] @ w [I, O] as two products over halves of I, added: [2, 1, I/2] x
  [2, I/2, O], one batched matmul (both reshapes free), accumulated in float32. An add,
  not a reduction over the halves, so that XLA fuses it into what follows (2-5% of a
  decoded token against a kernel of its own)."""
  partial = jax.lax.dot_general(
      x.reshape(2, 1, -1), w.reshape(2, -1, w.shape[1]), (((2,), (1,)), ((0,), (0,))),
      preferred_element_type=jnp.float32)
  return (partial[0] + partial[1]).astype(jnp.result_type(x, w))


def _halves_transposed(x: jax.Array, table: jax.Array) -> jax.Array:
  """x [1, D] @ table [V, D]^T as two products over halves of V's rows, [2, 1, D] x
  [2, V/2, D], one batched matmul."""
  halves = jax.lax.dot_general(
      jnp.broadcast_to(x, (2, 1, x.shape[1])), table.reshape(2, -1, table.shape[1]),
      (((2,), (2,)), ((0,), (0,))))
  return halves.reshape(1, table.shape[0])


def vector_product(x: jax.Array, w: jax.Array, *, transpose: bool = False) -> jax.Array:
  """x [R, I] @ w [I, O] (w [O, I]^T with `transpose`); one row on a CPU in two halves
  that run side by side (`_halves`, `_halves_transposed`), else `jnp.matmul`."""
  plain = (lambda x, w: jnp.matmul(x, w.T)) if transpose else jnp.matmul
  if x.shape[0] != 1 or w.shape[0] % 2:
    return plain(x, w)
  return jax.lax.platform_dependent(
      x, w, cpu=_halves_transposed if transpose else _halves, default=plain)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [R, I] @ w [I, O] -> [R, O], as `jnp.matmul` (one row: `vector_product`); its
  weight's gradient is a `weight_gradient`."""
  return vector_product(x, w)


def _matmul_fwd(x, w):
  return vector_product(x, w), (x, w)


def weight_gradient(a: jax.Array, b: jax.Array) -> jax.Array:
  """a^T b [M, N] of rows a [R, M], b [R, N]. On a CPU the narrower operand is made
  `transposed`: a^T b for M <= N, else (b^T a)^T, that product barred from the final
  transpose (XLA would turn the pair back into a^T b)."""
  def cpu(a, b):
    if a.shape[1] <= b.shape[1]:
      return jnp.matmul(transposed(a), b)
    return jax.lax.optimization_barrier(jnp.matmul(transposed(b), a)).T
  return jax.lax.platform_dependent(a, b, cpu=cpu, default=lambda a, b: jnp.matmul(a.T, b))


def _matmul_bwd(residuals, dy):
  x, w = residuals
  return (jnp.matmul(dy, w.T).astype(x.dtype), weight_gradient(x, dy).astype(w.dtype))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def matmul_transposed(x: jax.Array, table: jax.Array) -> jax.Array:
  """x [R, D] @ table [V, D]^T -> [R, V] (tied logits); its table gradient d^T x is a
  `weight_gradient`."""
  return vector_product(x, table, transpose=True)


def _matmul_transposed_fwd(x, table):
  return vector_product(x, table, transpose=True), (x, table)


def _matmul_transposed_bwd(residuals, dy):
  x, table = residuals
  return (jnp.matmul(dy, table).astype(x.dtype),
          weight_gradient(dy, x).astype(table.dtype))


matmul_transposed.defvjp(_matmul_transposed_fwd, _matmul_transposed_bwd)


def unfused(x: jax.Array) -> jax.Array:
  """x itself, through an identity op that XLA keeps (rounding to x's own precision).

  Before the logits it keeps XLA's CPU backend from fusing the logits matmul with the
  last layer's matmuls into one YNNPACK subgraph, which from about 4096 rows on ran four
  times slower than its parts.
  """
  info = jnp.finfo(x.dtype)
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
