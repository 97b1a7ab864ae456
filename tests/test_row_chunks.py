"""MLPs over long rows in chunks of positions (`row_chunks`): the same values and
gradients as the whole MLP, for every block type, under remat, with LoRA and stored
quantized weights; parameters, dropout and the choice of chunks."""

import contextlib
from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax import lora
from gemma_jax.layers import row_chunks
from gemma_jax.quant import ptq
from jaxpr_shapes import shapes

B, T = 2, 12      # 24 positions: 3 chunks of [2, 4] under `small_chunks`
MLP_DIM = 48


@contextlib.contextmanager
def chunks(**constants):
  """`row_chunks`' constants patched, with JAX's caches cleared on the way in and out:
  traces (layers' included) are cached by shape, so a model traced before would keep
  its MLPs as they were."""
  jax.clear_caches()
  try:
    with mock.patch.multiple(row_chunks, **constants):
      yield
  finally:
    jax.clear_caches()


@pytest.fixture
def small_chunks():
  """Chunks of 8 positions from 16 positions on, so that small models take them."""
  with chunks(ROWS_PER_CHUNK=8, MIN_ROWS=16):
    yield


def whole_mlps():
  return chunks(MIN_ROWS=10**9)


def tiny(**overrides):
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2,
                           head_dim=8, mlp_dim=MLP_DIM, num_layers=3,
                           attention_pattern=("local", "global"), sliding_window=4))
  config.model.update(overrides)
  return config


def tokens():
  return jnp.asarray(np.random.RandomState(0).randint(0, 97, (B, T)), jnp.int32)


def chunked_hidden(fn, *args) -> bool:
  """Whether fn computes an MLP hidden layer of one chunk, [8, F], and none of all 24
  positions at once."""
  computed = set(shapes(jax.make_jaxpr(fn)(*args).jaxpr))
  return (8, MLP_DIM) in computed and (B * T, MLP_DIM) not in computed


def test_chunk_count():
  assert row_chunks.chunk_count(1, 8192) == 8
  assert row_chunks.chunk_count(2, 2048) == 4
  assert row_chunks.chunk_count(1, 6000) == 5          # 6000 // 1024, a divisor of T
  assert row_chunks.chunk_count(1, 4099) == 1          # a prime length runs whole
  assert row_chunks.chunk_count(4, 512) == 1           # below MIN_ROWS
  with mock.patch.object(jax, "default_backend", return_value="gpu"):
    assert row_chunks.chunk_count(1, 8192) == 1


@pytest.mark.slow
@pytest.mark.parametrize("block_type, overrides", [
    ("gemma3", {}), ("gemma4", {}), ("parallel", {}),
    ("gpt3", dict(num_kv_heads=4, use_post_attn_norm=False, use_post_ffw_norm=False)),
    ("gemma3", dict(remat_policy="full")), ("gemma3", dict(remat_policy="minimal",
                                                           scan_unroll="full"))])
def test_chunked_mlp_keeps_logits_and_gradients(block_type, overrides, small_chunks):
  """The reference is the same model with its MLPs whole (MIN_ROWS out of reach)."""
  config = tiny(block_type=block_type, **overrides)
  toks = tokens()
  params = gj.transform(config).init(jax.random.key(0), toks)

  def value_and_grad(params):
    model = gj.transform(config)
    loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, toks))[..., 0] * jnp.arange(T))
    return jax.value_and_grad(loss)(params)

  assert chunked_hidden(value_and_grad, params)
  value, grads = jax.jit(value_and_grad)(params)
  with whole_mlps():
    assert not chunked_hidden(value_and_grad, params)
    whole_value, whole_grads = jax.jit(value_and_grad)(params)
  np.testing.assert_allclose(value, whole_value, rtol=1e-6)
  chex.assert_trees_all_close(grads, whole_grads, rtol=1e-4, atol=1e-6)


def test_init_runs_whole_and_keeps_parameter_paths(small_chunks):
  config, toks = tiny(), tokens()
  with whole_mlps():
    whole = gj.transform(config).init(jax.random.key(0), toks)
  chunked = gj.transform(config).init(jax.random.key(0), toks)
  chex.assert_trees_all_equal(chunked, whole)


@pytest.mark.slow
def test_lora_adapters_and_their_dropout_in_chunks(small_chunks):
  """LoRA's interceptor adds the adapters inside every chunk: the adapters' gradients
  equal the whole MLPs', and dropout on the adapters' input draws per chunk."""
  config = tiny()
  config.lora.rank, config.lora.alpha = 4, 8.0
  toks = tokens()
  base, adapters = lora.split(gj.transform(config).init(jax.random.key(0), toks))
  adapters = jax.tree.map(lambda a: 0.3 * jax.random.normal(jax.random.key(1), a.shape),
                          adapters)

  def grad(adapters):
    model = gj.transform(config)
    return jax.grad(lambda a: jnp.mean(model.apply(lora.combine(base, a), toks)[..., :3] ** 2))(
        adapters)

  assert chunked_hidden(grad, adapters)
  grads = grad(adapters)
  with whole_mlps():
    assert not chunked_hidden(grad, adapters)
    whole_grads = grad(adapters)
  assert np.abs(grads["layers_2"]["mlp"]["up"]["lora_a"]).max() > 1e-4
  chex.assert_trees_all_close(grads, whole_grads, rtol=1e-4, atol=1e-6)


def test_dropout_draws_a_key_per_chunk(small_chunks):
  """Identical positions in different chunks get different dropout masks."""

  class Dropped(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.5, deterministic=False)(x)

  class Parent(nn.Module):
    @nn.compact
    def __call__(self, x):
      return row_chunks.apply_in_row_chunks(Dropped(), x)

  out = Parent().apply({}, jnp.ones((1, 32, 64)), rngs={"dropout": jax.random.key(0)})
  kept = np.asarray(out != 0).reshape(4, 8, 64)           # 4 chunks of 8 positions
  assert 0.3 < kept.mean() < 0.7
  assert all((kept[i] != kept[0]).any() for i in (1, 2, 3))


@pytest.mark.slow
def test_stored_int8_weights_in_chunks(small_chunks):
  """A quantized model reads its int8 weights and scales inside every chunk (logits as
  with whole MLPs); quantizing in place writes parameters, so it runs whole."""
  config, toks = tiny(), tokens()
  params = gj.transform(config).init(jax.random.key(0), toks)
  quantized_config, quantized = ptq.quantize(config, params, "int8_weights")
  apply = lambda p: gj.transform(quantized_config).apply(p, toks)
  assert chunked_hidden(apply, quantized)
  logits = apply(quantized)
  with whole_mlps():
    assert not chunked_hidden(apply, quantized)
    whole = apply(quantized)
    _, whole_quantized = ptq.quantize(config, params, "int8_weights")
  np.testing.assert_allclose(logits, whole, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_equal(quantized, whole_quantized)
