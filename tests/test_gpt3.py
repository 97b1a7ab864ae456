"""GPT-3: LayerNorm and MLP against float64 numpy, logits against transformers' GPT-2,
the save round trip, preset sizes, config errors and a short training run."""

import functools
import importlib.util
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax.layers.layer_norm import LayerNorm
from gemma_jax.layers.mlp import Mlp
from gemma_jax.training import loop, metrics
import torch_reference
from torch_reference import torch_logits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 96

# Each shape exercises one thing; all run 23-token sequences.
SHAPES = {
    "1_layer_2_heads_like_52k": dict(n_layer=1, n_embd=16, n_head=2, n_inner=64),
    "3_layers_4_heads_inner_48": dict(n_layer=3, n_embd=32, n_head=4, n_inner=48),
    "2_layers_8_heads_exact_gelu": dict(n_layer=2, n_embd=64, n_head=8, n_inner=None,
                                        activation_function="gelu"),
    "2_layers_relu_eps_1e-3": dict(n_layer=2, n_embd=24, n_head=3, n_inner=40,
                                   activation_function="relu", layer_norm_epsilon=1e-3),
}


def random_gpt2(seed, **shape):
  """A tiny transformers GPT-2 with every weight random (LayerNorms and biases too), the
  token and position tables at unit scale so that logits reach several units."""
  torch.manual_seed(seed)
  config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=40, bos_token_id=None,
                                   eos_token_id=None, **shape)
  model = transformers.GPT2LMHeadModel(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if ".ln_" in name or name.startswith("transformer.ln_f"):
        p.normal_(1.0 if name.endswith("weight") else 0.0, 0.5)
      elif name.endswith("bias"):
        p.normal_(0.0, 0.3)
      elif name.startswith(("transformer.wte", "transformer.wpe")):
        p.normal_(0.0, 1.0)
  return model.eval()


token_batch = functools.partial(torch_reference.token_batch, VOCAB)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
  model = random_gpt2(len(request.param), **SHAPES[request.param])
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  return model, path


# Layers.

def np_layer_norm(x, scale, bias, eps):
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * (1 + scale) + bias


class LayerNormTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_float64_with_zero_initialised_scale(self):
    x = jax.random.normal(jax.random.key(0), (2, 5, 16)) * 3 + 1
    norm = LayerNorm(eps=1e-5)
    params = jax.tree.map(np.asarray, nn.meta.unbox(norm.init(jax.random.key(1), x)))
    chex.assert_trees_all_equal(params, {"params": {"scale": np.zeros(16, np.float32),
                                                    "bias": np.zeros(16, np.float32)}})
    scale, bias = (np.asarray(jax.random.normal(jax.random.key(i), (16,))) for i in (2, 3))
    y = self.variant(norm.apply)({"params": {"scale": scale, "bias": bias}}, x)
    np.testing.assert_allclose(y, np_layer_norm(x, scale, bias, 1e-5), rtol=1e-5, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_input_with_and_without_float32_reductions(self):
    x = (jax.random.normal(jax.random.key(0), (4, 64)) * 2 + 5).astype(jnp.bfloat16)
    params = {"params": {"scale": np.zeros(64, np.float32), "bias": np.zeros(64, np.float32)}}
    expected = np_layer_norm(np.asarray(x, np.float32), 0.0, 0.0, 1e-5)
    for in_float32, tolerance in ((True, 2e-2), (False, 1e-1)):
      y = self.variant(LayerNorm(reductions_in_float32=in_float32).apply)(params, x)
      self.assertEqual(y.dtype, jnp.bfloat16)
      np.testing.assert_allclose(np.asarray(y, np.float32), expected, atol=tolerance)


def test_mlp_with_biases_matches_float64():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  mlp = Mlp(12, "gelu_tanh", use_bias=True)
  params = nn.meta.unbox(mlp.init(jax.random.key(1), x))["params"]
  params = jax.tree.map(lambda p: np.asarray(p) + 0.1, params)   # biases not zero
  y = mlp.apply({"params": params}, x)
  hidden = np.asarray(x, np.float64) @ params["up"]["kernel"] + params["up"]["bias"]
  hidden = 0.5 * hidden * (1 + np.tanh(np.sqrt(2 / np.pi) * (hidden + 0.044715 * hidden ** 3)))
  expected = hidden @ params["down"]["kernel"] + params["down"]["bias"]
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# transformers' GPT-2.

def test_loaded_logits_match_transformers(checkpoint):
  """Scanned layers here; unrolled ones in the next test."""
  model, path = checkpoint
  config, params = gj.hf.load(path)
  assert config.model.block_type == "gpt3" and config.model.fused_qkv
  tokens = token_batch()
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(tokens)))
  expected = torch_logits(model, tokens)
  assert np.abs(expected).max() > 2.0     # logits large enough for 1e-4 to mean something
  assert np.abs(ours - expected).max() <= 1e-4


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
  model = random_gpt2(3, **SHAPES["3_layers_4_heads_inner_48"])
  path = str(tmp_path_factory.mktemp("three_layers"))
  model.save_pretrained(path)
  return model, path


def test_unrolled_unfused_projections_match_transformers(three_layers):
  """The fused [D, 3, N, H] kernel split into q, k and v: the same function."""
  model, path = three_layers
  config, params = gj.hf.load(path, scan_layers=False)
  config.model.fused_qkv = False
  for i in range(config.model.num_layers):
    attn = params[f"layers_{i}"]["attn"]
    qkv = attn.pop("qkv")
    for j, name in enumerate("qkv"):
      attn[name] = {"kernel": qkv["kernel"][:, j], "bias": qkv["bias"][j]}
  chex.assert_trees_all_equal_shapes(params, jax.eval_shape(
      gj.transform(config).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 4), jnp.int32)))
  tokens = token_batch()
  ours = np.asarray(gj.transform(config).apply(params, jnp.asarray(tokens)))
  expected = torch_logits(model, tokens)
  assert np.abs(expected).max() > 2.0     # logits large enough for 1e-4 to mean something
  assert np.abs(ours - expected).max() <= 1e-4


def test_packed_documents_restart_learned_positions(three_layers):
  """A packed row gives each document the logits transformers gives it alone."""
  model, path = three_layers
  assert torch_reference.packed_row_gap(model, path, VOCAB) <= 1e-4


def test_rows_longer_than_the_position_table_are_refused_under_jit():
  """Without positions or segment ids the positions are 0..T-1 whatever the values, so a
  jitted apply refuses T past the table instead of returning NaN logits."""
  config = gj.get_config("gpt3-52k")
  config.model.trainable_position_size = config.data.seq_len = 16
  model = gj.transform(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
  apply = jax.jit(model.apply)
  assert np.isfinite(apply(params, jnp.zeros((1, 16), jnp.int32))).all()
  with pytest.raises(ValueError, match=r"positions span \[0, 16\], outside the learned "
                     r"position table \[0, config.model.trainable_position_size=16\)"):
    apply(params, jnp.zeros((1, 17), jnp.int32))


def test_save_round_trip_through_transformers(checkpoint, tmp_path):
  model, path = checkpoint
  torch_reference.assert_save_round_trip(model, path, str(tmp_path / "saved"),
                                         transformers.GPT2LMHeadModel, VOCAB)


@pytest.mark.parametrize("field,value", [("fused_qkv", False), ("use_post_ffw_norm", True),
                                         ("scale_embeddings", True), ("head_dim", 4),
                                         ("num_heads", 3)])
def test_save_names_a_field_gpt2_cannot_represent(tmp_path, field, value):
  """The config is checked before any parameter is read or anything written. Three heads
  of d_model // 3 do not fill d_model: such a save had written a checkpoint neither
  transformers nor hf.load reads."""
  config = gj.get_config("gpt3-52k")
  config.model[field] = value
  if field == "num_heads":
    config.model.update(num_kv_heads=value, head_dim=config.model.d_model // value)
  with pytest.raises(gj.hf.CheckpointError, match=f"config.model.{field}: GPT2LMHeadModel"):
    gj.hf.save(str(tmp_path / "out"), config, params={})
  assert not os.listdir(tmp_path)


def test_gpt2_model_checkpoint_without_head_and_a_bad_tensor(tmp_path):
  """Names without the `transformer.` prefix load; a wrong shape is named."""
  body = random_gpt2(7, n_layer=1, n_embd=16, n_head=2).transformer
  body.save_pretrained(str(tmp_path / "body"))
  config, params = gj.hf.load(str(tmp_path / "body"))
  np.testing.assert_array_equal(params["final_norm"]["scale"],
                                body.ln_f.weight.detach().numpy() - 1)
  torch.manual_seed(0)
  wrong = transformers.GPT2Model(transformers.GPT2Config(vocab_size=VOCAB, n_positions=41,
                                                         n_layer=1, n_embd=16, n_head=2))
  wrong.save_pretrained(str(tmp_path / "wrong"))
  with open(tmp_path / "wrong" / "config.json") as f:
    text = f.read().replace('"n_positions": 41', '"n_positions": 40')
  with open(tmp_path / "wrong" / "config.json", "w") as f:
    f.write(text)
  with pytest.raises(gj.hf.CheckpointError, match=r"wpe.weight: \(41, 16\) != expected"):
    gj.hf.load(str(tmp_path / "wrong"))


# Presets and config.

def gpt3_params(v, p, d, layers, n, h, f):
  """Parameter count of the GPT-3 block from its shape (LayerNorms with bias, biases)."""
  layer = 2 * 2 * d + 3 * d * n * h + 3 * n * h + n * h * d + d + d * f + f + f * d + d
  return v * d + p * d + layers * layer + 2 * d


@pytest.mark.slow
@pytest.mark.parametrize("name,shape", [
    ("gpt3-52k", (1024, 2048, 16, 1, 2, 8, 64)),
    ("gpt3-6b", (32768, 16384, 3072, 48, 12, 256, 12288)),
    ("gpt3-22b", (32768, 16384, 6144, 48, 24, 256, 24576)),
    ("gpt3-175b", (50304, 16384, 12288, 96, 96, 128, 49152)),
])
def test_preset_sizes_match_formula_and_transformers(name, shape):
  config = gj.get_config(name)
  abstract = jax.eval_shape(gj.transform(config).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 8), jnp.int32))
  ours = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract))
  assert ours == gpt3_params(*shape)
  v, p, d, layers, n, _, f = shape
  with torch.device("meta"):
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=v, n_positions=p, n_embd=d, n_layer=layers, n_head=n, n_inner=f))
  assert ours == sum(t.numel() for t in reference.parameters())


@pytest.mark.parametrize("update,field", [
    (dict(block_type="gemma3", fused_qkv=True), "model.fused_qkv"),
    (dict(num_kv_heads=1), "model.num_kv_heads"),
    (dict(trainable_position_size=64), "model.trainable_position_size"),
    (dict(trainable_position_size=-1), "model.trainable_position_size"),
    (dict(sinusoidal_position_embedding=True, d_model=15), "model.sinusoidal_position_embedding"),
    (dict(block_type="gpt4"), "model.block_type"),
])
def test_config_errors_name_the_field(update, field):
  config = gj.get_config("gpt3-52k")
  config.data.seq_len = 128
  config.model.update(update)
  with pytest.raises(gj.ConfigError, match=f"^config.{field}: ") as error:
    gj.validate(config)
  assert error.value.field == field


# Training.

@pytest.mark.slow
def test_gpt3_52k_config_trains_and_logs_activation_statistics(corpus, tmp_path):
  spec = importlib.util.spec_from_file_location("gpt3_52k", os.path.join(REPO, "configs",
                                                                         "gpt3_52k.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.data.path = corpus
  config.data.seq_len = 32
  config.data.eval_fraction = 0.1
  config.train.update(dict(steps=5, batch_size=8, log_every=1, eval_every=0, eval_batches=2,
                           progress_bar=False, peak_flops=1e9))
  config.optimizer.warmup_steps = 2
  config.sample.max_new_tokens = 4
  summary = loop.train(config, str(tmp_path))
  records = metrics.read_records(str(tmp_path))
  assert summary["step"] == 5 and np.isfinite(summary["eval_loss"])
  assert records[-1]["loss"] < records[0]["loss"]
  for name in ("activation_mean", "activation_stdev", "activation_fraction_zero"):
    assert all(np.isfinite(r[f"aux/{name}/layer_0"]) for r in records)
  assert records[0]["aux/activation_stdev/layer_0"] > 0
