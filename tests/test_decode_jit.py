"""decode_jit.jit: decoding's programs compiled on a CPU without XLA's tree-reduction
rewrite, with the sums still right, and usable inside other transformations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax.inference import decode_jit, decoding, sampler


def rms(x):
  """x [R, D] -> [R] root mean square (a reduction over D)."""
  return jnp.sqrt(jnp.mean(jnp.square(x), axis=-1))


def reduce_windows(compiled) -> int:
  return compiled.as_text().count("reduce-window(")


def test_cpu_program_has_no_tree_reduction():
  x = jnp.ones((4, 512), jnp.float32)     # a decoded token's norms: rows of D = 512
  assert reduce_windows(jax.jit(rms).lower(x).compile()) >= 1    # the rewrite, unless told
  assert reduce_windows(decode_jit.jit(rms).lower(x).compile()) == 0


def test_long_sums_match_float64():
  x = np.random.default_rng(0).normal(size=(3, 32768)).astype(np.float32) * 10
  got = np.asarray(decode_jit.jit(rms)(jnp.asarray(x)))
  want = np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=-1))
  np.testing.assert_allclose(got, want, rtol=2e-6)


class NestedTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_inside_other_transformations(self):
    """Traced by an outer jit, grad or eval_shape, it is a plain nested jit."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 300)), jnp.float32)
    f = decode_jit.jit(rms)
    total = self.variant(lambda x: jnp.sum(f(x)))
    np.testing.assert_allclose(total(x), jnp.sum(rms(x)), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(f(x)))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(rms(x)))(x), rtol=1e-5)
    chex.assert_shape(jax.eval_shape(f, x), (2,))


@pytest.mark.slow
def test_generate_compiles_without_it_and_decodes_the_same():
  """`sampler.generate` (which `Sampler` compiles) on a CPU: no reduce-windows, and the
  greedy tokens of the same function under a plain jax.jit."""
  config = gj.get_config("gemma3-tiny")
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  dec = decoding.make_decoding(config)
  prompts = jnp.asarray(np.random.default_rng(2).integers(3, 200, (2, 6)), jnp.int32)
  args = (dec, params, prompts, jnp.array([6, 4], jnp.int32), jax.random.key(0),
          jnp.zeros((0,), jnp.int32))
  static = dict(max_new_tokens=12, cache_length=18, cache_dtype="float32")
  ours = sampler.generate.lower(*args, **static).compile()
  plain = jax.jit(sampler.generate.__wrapped__, static_argnames=(
      "decoding", "max_new_tokens", "cache_length", "cache_dtype")).lower(*args, **static)
  plain = plain.compile()
  assert reduce_windows(ours) == 0 < reduce_windows(plain)
  tokens = ours(*args[1:])
  chex.assert_shape(tokens, (2, 12))
  np.testing.assert_array_equal(tokens, plain(*args[1:]))
