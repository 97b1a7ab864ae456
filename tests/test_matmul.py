"""`matmul` and `matmul_transposed`: values and gradients against float64 numpy, and on
the CPU the structure they exist for (no matmul contracting its left operand's rows)."""

import re

import chex
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax.layers import matmul as mm

R, I, O = 24, 16, 40


def _inputs(dtype=np.float32, i=I, o=O):
  rng = np.random.default_rng(0)
  x, w, cotangent = (rng.normal(size=s) for s in ((R, i), (i, o), (R, o)))
  return x.astype(dtype), w.astype(dtype), cotangent


class MatmulTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("wider_output", I, O), ("narrower_output", O, 4))
  def test_matmul_and_gradients_match_float64(self, i, o):
    x, w, c = _inputs(i=i, o=o)
    value, grads = self.variant(jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.asarray(c, jnp.float32) * mm.matmul(x, w)), argnums=(0, 1)))(
            x, w)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    np.testing.assert_allclose(value, np.sum(c * (x64 @ w64)), rtol=1e-5)
    np.testing.assert_allclose(grads[0], c @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], x64.T @ c, rtol=1e-5, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_matmul_transposed_and_gradients_match_float64(self):
    x, w, c = _inputs()
    table = np.ascontiguousarray(w.T)                                      # [V=O, D=I]
    value, grads = self.variant(jax.value_and_grad(
        lambda x, t: jnp.sum(jnp.asarray(c, jnp.float32) * mm.matmul_transposed(x, t)),
        argnums=(0, 1)))(x, table)
    x64, t64 = x.astype(np.float64), table.astype(np.float64)
    np.testing.assert_allclose(value, np.sum(c * (x64 @ t64.T)), rtol=1e-5)
    np.testing.assert_allclose(grads[0], c @ t64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], c.T @ x64, rtol=1e-5, atol=1e-5)

  def test_gradients_keep_the_operands_dtypes(self):
    x, w, c = _inputs(jnp.bfloat16)
    for f, b in ((mm.matmul, w), (mm.matmul_transposed, w.T)):
      grads = jax.grad(lambda x, b: jnp.sum(f(x, b).astype(jnp.float32) * c),
                       argnums=(0, 1))(x, b)
      chex.assert_shape(grads, (x.shape, b.shape))
      assert all(g.dtype == jnp.bfloat16 for g in grads)


def _left_rows_contracted(fn, *args) -> int:
  """Dots in fn's compiled program that contract a 2-D left operand over its first dim
  (what XLA's CPU backend leaves to Eigen instead of YNNPACK)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return sum(bool(re.search(r"lhs_contracting_dims=\{0\}", line))
             for line in text.splitlines() if " dot(" in line)


def test_weight_gradients_take_the_rows_transposed_on_cpu():
  # On the CPU device whatever the default backend (JAX always has one), so this runs
  # on an accelerator machine too.
  cpu = jax.devices("cpu")[0]
  x, w, c = (jax.device_put(jnp.asarray(a, jnp.float32), cpu) for a in _inputs())
  grad = lambda f: jax.grad(lambda x, b: jnp.sum(f(x, b) * c), argnums=(0, 1))
  # The check finds the pattern where plain matmuls have it ...
  assert _left_rows_contracted(grad(jnp.matmul), x, w) == 1
  assert _left_rows_contracted(grad(lambda x, t: x @ t.T), x, w.T) == 1
  # ... and neither function leaves one.
  assert _left_rows_contracted(grad(mm.matmul), x, w) == 0
  assert _left_rows_contracted(grad(mm.matmul_transposed), x, w.T) == 0


def _transposed_shapes(fn, *args) -> list:
  """[rows, cols] of every transpose in fn's program as lowered for the CPU, before XLA."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
  return [tuple(int(d) for d in m.split("x")) for m in
          re.findall(r"stablehlo.transpose.*-> tensor<(\d+x\d+)xf32>", text)]


def test_weight_gradients_transpose_the_narrower_operand():
  """A weight gradient over rows x [R, I], dy [R, O] makes whichever of x^T and dy^T is
  smaller: for a LoRA adapter's A (O = r) that is dy^T, never a copy of the input."""
  for i, o, made, not_made in ((I, O, (I, R), (O, R)), (64, 4, (4, R), (64, R))):
    x, w, c = (jnp.asarray(a, jnp.float32) for a in _inputs(i=i, o=o))
    grad = jax.grad(lambda x, w, c=c: jnp.sum(c * mm.matmul(x, w)), argnums=1)
    shapes = _transposed_shapes(grad, x, w)
    assert made in shapes and not_made not in shapes, shapes


def test_only_the_cpu_gets_the_barred_transposes():
  x, w, c = (jnp.asarray(a, jnp.float32) for a in _inputs())
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(c * mm.matmul(x, w))
                          + jnp.sum(c * mm.matmul_transposed(x, w.T)), argnums=(0, 1)))
  barriers = {platform: grad.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
              .count("optimization_barrier") for platform in ("cpu", "cuda", "tpu")}
  assert barriers == {"cpu": 3, "cuda": 0, "tpu": 0}    # x^T twice, x^T d once


class OneRowTest(chex.TestCase, parameterized.TestCase):
  """One row (decoding at batch 1): the CPU's two half-products sum to the product."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("even", 16), ("odd", 15))
  def test_one_row_values_and_gradients_match_float64(self, inner):
    rng = np.random.default_rng(1)
    x, w, table = (rng.normal(size=s) for s in ((1, inner), (inner, O), (O, inner)))
    c = rng.normal(size=(1, O))
    for f, b, reference in ((mm.matmul, w, lambda x, b: x @ b),
                            (mm.matmul_transposed, table, lambda x, b: x @ b.T)):
      value, grads = self.variant(jax.value_and_grad(
          lambda x, b, f=f: jnp.sum(jnp.asarray(c, jnp.float32) * f(x, b)), argnums=(0, 1)))(
              x.astype(np.float32), b.astype(np.float32))
      np.testing.assert_allclose(value, np.sum(c * reference(x, b)), rtol=1e-5)
      expected = jax.grad(lambda x, b, r=reference: jnp.sum(c * r(x, b)), argnums=(0, 1))
      with jax.enable_x64():
        for got, want in zip(grads, expected(x, b)):
          np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_one_row_rounds_once_in_bfloat16(self):
    rng = np.random.default_rng(2)
    x, w = rng.normal(size=(1, 512)), rng.normal(size=(512, 64))
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    got = mm.vector_product(xb, wb)
    exact = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
    assert got.dtype == jnp.bfloat16
    # float32 accumulation rounded once: within one bfloat16 ulp of the exact product
    ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= ulp)

  def test_only_the_cpu_splits_a_row(self):
    x, w = jnp.ones((1, 16)), jnp.ones((16, O))
    one_row = jax.jit(lambda x, w: mm.matmul(x, w) + mm.matmul_transposed(x, w.T))
    batched = {platform: one_row.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
               .count("batching_dims = [0] x [0]") for platform in ("cpu", "cuda", "tpu")}
    assert batched == {"cpu": 2, "cuda": 0, "tpu": 0}
    rows = jax.jit(lambda x, w: mm.matmul(x, w)).trace(jnp.ones((2, 16)), w).lower(
        lowering_platforms=("cpu",)).as_text()
    assert "batching_dims" not in rows
