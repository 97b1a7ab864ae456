"""The parallel block against a float64 numpy layer, and the decoder options every
family has: position embeddings, logits by a separate kernel or in the compute dtype,
activation statistics."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

import gemma_jax as gj
from gemma_jax.decoder import unstack_layers
from gemma_jax.layers.embed import sinusoidal
from gemma_jax.models.parallel import ParallelLayer
from test_layers import np_attention, np_rope   # the float64 references of the shared layers

SMALL = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
             mlp_dim=48)


def small_config(preset="parallel-tiny", **model):
  config = gj.get_config(preset)
  config.model.update(dict(SMALL, **model))
  return config


def np_parallel_layer(x, params, positions, mask, eps, base):
  """x + attention(norm(x)) + gated silu MLP(norm(x)), RMSNorm multiplying by scale."""
  x = np.asarray(x, np.float64)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * p["pre_norm"]["scale"]
  attn = p["attn"]
  q = np_rope(np.einsum("btd,dnh->btnh", y, attn["q"]["kernel"]), positions, base)
  k = np_rope(np.einsum("btd,dkh->btkh", y, attn["k"]["kernel"]), positions, base)
  v = np.einsum("btd,dkh->btkh", y, attn["v"]["kernel"])
  o = np_attention(q * q.shape[-1] ** -0.5, k, v, mask)
  attended = np.einsum("btnh,nhd->btd", o, attn["out"]["kernel"])
  mlp = p["mlp"]
  gate = y @ mlp["gate"]["kernel"]
  hidden = gate / (1 + np.exp(-gate)) * (y @ mlp["up"]["kernel"])
  return x + attended + hidden @ mlp["down"]["kernel"]


class ParallelLayerTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_float64_and_sows_its_statistics(self):
    config = small_config(record_internal_nn_metrics=True)
    layer = ParallelLayer(config_dict.FrozenConfigDict(config.model), "global")
    b, t = 2, 7
    x = jax.random.normal(jax.random.key(0), (b, t, 32))
    positions = jnp.array([np.arange(t), np.arange(t) + 5])
    segments = np.array([[1] * t, [1] * 3 + [2] * 4])
    mask = np.tril(np.ones((t, t), bool))[None] & (segments[:, :, None] == segments[:, None])
    params = nn.meta.unbox(layer.init(jax.random.key(1), x, positions,
                                      {"global": jnp.asarray(mask)}))["params"]
    params["pre_norm"]["scale"] = 1 + 0.5 * jax.random.normal(jax.random.key(2), (32,))
    y, state = self.variant(lambda p: layer.apply({"params": p}, x, positions,
                                                  {"global": jnp.asarray(mask)},
                                                  mutable=["intermediates"]))(params)
    expected = np_parallel_layer(x, params, np.asarray(positions), mask, config.model.norm_eps,
                                 config.model.rope_global_base)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    stats = {k: v[0] for k, v in state["intermediates"].items()}
    np.testing.assert_allclose(stats["activation_mean"], expected.mean(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["activation_stdev"], expected.std(), rtol=1e-4)
    assert stats["activation_fraction_zero"] == 0.0


def test_parallel_tiny_size_matches_formula():
  m = gj.get_config("parallel-tiny").model
  abstract = jax.eval_shape(gj.transform(gj.get_config("parallel-tiny")).init,
                            jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
  d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  layer = d + d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract)) == (
      m.vocab_size * d + m.num_layers * layer + d)


def test_sinusoidal_matches_float64():
  positions = np.array([[0, 1, 2, 7], [3, 100, 1000, 5]])
  d = 12
  i = np.arange(d // 2)
  angles = positions[..., None] / 10_000.0 ** (i / (d // 2 - 1))
  expected = np.concatenate([np.sin(angles), np.cos(angles)], -1)
  np.testing.assert_allclose(sinusoidal(jnp.asarray(positions), d), expected, atol=2e-5)


def test_sinusoidal_embedding_makes_a_ropeless_model_see_positions():
  """GPT-3 without learned positions is blind to them, until the sinusoid is added."""
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (1, 6)).repeat(2, 0), jnp.int32)
  positions = jnp.arange(6)[None] + jnp.array([[0], [3]])    # the same row, shifted by 3
  configs = [small_config("gpt3-52k", num_kv_heads=4, trainable_position_size=0,
                          sinusoidal_position_embedding=sinusoid) for sinusoid in (False, True)]
  params = gj.transform(configs[0]).init(jax.random.key(0), tokens)   # the sinusoid has none
  blind, seeing = (gj.transform(c).apply(params, tokens, positions=positions) for c in configs)
  np.testing.assert_array_equal(blind[0], blind[1])
  assert np.abs(seeing[0] - seeing[1]).max() > 1e-3


def test_separate_output_kernel_and_logits_dtype():
  tokens = jnp.ones((1, 5), jnp.int32)
  tied = small_config()
  model = gj.transform(tied)
  params = model.init(jax.random.key(0), tokens)
  untied = small_config(logits_via_embedding=False)
  params_untied = dict(params, logits={"kernel": params["embed"]["embedding"].T})
  chex.assert_trees_all_equal_shapes(params_untied, jax.eval_shape(
      gj.transform(untied).init, jax.random.key(0), tokens))
  np.testing.assert_allclose(gj.transform(untied).apply(params_untied, tokens),
                             model.apply(params, tokens), rtol=1e-6)
  in_compute_dtype = small_config(dtype="bfloat16", cast_logits_to_float32=False)
  assert gj.transform(in_compute_dtype).apply(params, tokens).dtype == jnp.bfloat16


def test_activation_statistics_name_layers_alike_scanned_or_not():
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 6)), jnp.int32)
  configs = [small_config("gpt3-52k", num_layers=3, num_kv_heads=4, scan_layers=scan,
                          record_internal_nn_metrics=True) for scan in (True, False)]
  scanned = gj.transform(configs[0]).init(jax.random.key(0), tokens)
  stats = [gj.transform(config).apply(params, tokens, return_aux=True)[1]["activation_stats"]
           for config, params in zip(configs, (scanned, unstack_layers(scanned, configs[0].model)))]
  assert sorted(stats[0]) == sorted(f"{name}/layer_{i}" for i in range(3) for name in (
      "activation_mean", "activation_stdev", "activation_fraction_zero"))
  chex.assert_trees_all_close(stats[0], stats[1], rtol=1e-5, atol=1e-6)
