"""Quantization (gemma_jax.quant): projections against float64 numpy arithmetic, int4
packing, straight-through gradients, post-training quantization of whole models
(scanned, sharded, checkpointed), accuracy on a trained model, and bad input."""

import functools
import types

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from ml_collections import config_dict

import gemma_jax as gj
from gemma_jax import apps, lora, quant, sharding
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.decoder import unstack_layers
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.layers import expert_dispatch
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.moe import Experts, Routing
from gemma_jax.quant import numerics, projections
from gemma_jax.training import init_from, loop, metrics
import test_hf as hf_tests
from test_training import tiny_config

RNG = np.random.default_rng(0)


def model_section(**fields):
  model = gj.get_config("gemma3-tiny").model
  model.update(fields)
  return config_dict.FrozenConfigDict(model)


def np_quantize(w, axis, q_max):
  """Symmetric absmax quantization over `axis` in float64 (Qwix's convention: scale
  m / (q_max + 0.5), round half to even, saturate) -> (int64 values, scale). Each slice's
  largest value is a tie, which float32 division may round either way: see
  `exact_scales` for inputs where it cannot."""
  w = np.asarray(w, np.float64)
  scale = np.abs(w).max(axis=axis, keepdims=True) / (q_max + 0.5)
  return np.clip(np.round(w / scale), -q_max - 1, q_max).astype(np.int64), scale


def exact_scales(a, axis, q_max=127):
  """`a` with each slice's largest magnitude set to q_max + 0.5 times a power of two, so
  that the absmax scale is that power of two and every division by it exact: the
  rounding of the model and of numpy then agree to the last tie."""
  a = np.array(a, np.float32)
  power = np.exp2(np.round(np.log2(np.abs(a).max(axis=axis, keepdims=True) / (q_max + .5))))
  a = np.clip(a, -(q_max + .5) * power, (q_max + .5) * power)
  index = np.expand_dims(np.abs(a).argmax(axis=axis), axis)
  np.put_along_axis(a, index, np.sign(np.take_along_axis(a, index, axis)) * (q_max + .5) * power,
                    axis)
  return a


def run_linear(model, kernel, x, in_dims=1):
  """A Linear with `kernel` under model.quant's interceptor: (output, params after)."""
  out_shape = kernel.shape[in_dims:]
  layer = Linear(out_shape, ("embed",) * kernel.ndim, in_dims=in_dims)
  with nn.intercept_methods(projections.interceptor(model)):
    y, state = layer.apply({"params": {"kernel": jnp.asarray(kernel)}}, jnp.asarray(x),
                           mutable=["params"])
  return np.asarray(y, np.float64), state["params"]


def test_int8_projection_is_an_integer_product_rescaled():
  x = exact_scales(RNG.normal(size=(6, 40)), 1)
  w = exact_scales(RNG.normal(size=(40, 24)), 0)
  y, _ = run_linear(model_section(quant="int8"), w, x)
  qx, sx = np_quantize(x, 1, 127)
  qw, sw = np_quantize(w, 0, 127)
  expected = (qx @ qw) * sx * sw      # int64 accumulation: the int32 product exactly
  np.testing.assert_allclose(y, expected, rtol=1e-6)
  assert np.abs(y - x.astype(np.float64) @ w).max() > 1e-3   # it did round


def test_fp8_projection_rounds_to_e4m3_per_row_and_column():
  """The fp8 arithmetic (the config refuses it on the CPU; the projection itself runs
  here): x per row and w per column scaled to e4m3's largest value 448, rounded to
  float8_e4m3fn by ml_dtypes in float64, multiplied and rescaled."""
  x, w = RNG.normal(size=(6, 40)), RNG.normal(size=(40, 24))

  def rounded(a, axis):
    scale = np.abs(a).max(axis=axis, keepdims=True) / 448
    return (a / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale

  y, _ = run_linear(model_section(quant="fp8"), w.astype(np.float32), x.astype(np.float32))
  expected = rounded(x, 1) @ rounded(w, 0)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  assert np.abs(y - x @ w).max() > 1e-2        # it did round (3 mantissa bits)


@pytest.mark.parametrize("mode,group", [("int8_weights", 0), ("int4_weights", 8),
                                        ("int4_weights", 0)])
def test_stored_weights_equal_numpy_quantization(mode, group):
  """Kernel [N, H, D] contracted over (N, H), as the attention output projection."""
  q_max = 127 if mode == "int8_weights" else 7
  w = RNG.normal(size=(3, 16, 10))
  if group:
    w = exact_scales(w.reshape(3, 16 // group, group, 10), 2, q_max).reshape(w.shape)
  else:
    w = exact_scales(w.reshape(48, 10), 0, q_max).reshape(w.shape)
  x = RNG.normal(size=(5, 3, 16)).astype(np.float32)
  y, params = run_linear(model_section(quant=mode, quant_group_size=group), w, x, in_dims=2)
  if group:   # groups of `group` consecutive inputs along H, per head and output
    q, s = np_quantize(w.reshape(3, 16 // group, group, 10), 2, q_max)
    dequantized = (q * s).reshape(w.shape)
    assert params["kernel_scale"].shape == (3, 16 // group, 10)
  else:
    q, s = np_quantize(w, (0, 1), q_max)
    dequantized = q * s
    assert params["kernel_scale"].shape == (1, 1, 10)
  expected = x.reshape(5, -1).astype(np.float64) @ dequantized.reshape(-1, 10)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  stored = params["kernel"]
  if mode == "int4_weights":
    assert stored.dtype == jnp.uint8 and stored.shape == (3, 8, 10)   # two values a byte
    np.testing.assert_array_equal(numerics.unpack_int4(stored, 1), q.reshape(w.shape))
  else:
    assert stored.dtype == jnp.int8
    np.testing.assert_array_equal(stored, q)


def test_int4_packing_round_trips_every_value():
  values = np.array(np.meshgrid(np.arange(-8, 8), np.arange(-8, 8))).reshape(2, -1).T
  values = np.concatenate([values.reshape(-1), values.reshape(-1)[::-1]]).reshape(4, -1, 2)
  for axis in range(3):
    v = np.moveaxis(values, -1, axis)
    packed = numerics.pack_int4(jnp.asarray(v, jnp.int8), axis)
    assert packed.dtype == jnp.uint8 and packed.shape[axis] == v.shape[axis] // 2
    np.testing.assert_array_equal(numerics.unpack_int4(packed, axis), v)
  low_high = numerics.pack_int4(jnp.asarray([[-8, 7], [3, -1]], jnp.int8), 1)
  np.testing.assert_array_equal(low_high[:, 0], [0x78, 0xF3])   # low nibble first


def test_int8_training_gradients_pass_straight_through():
  x = jnp.asarray(RNG.normal(size=(4, 12)), jnp.float32)
  w = jnp.asarray(RNG.normal(size=(12, 7)), jnp.float32)
  g = RNG.normal(size=(4, 7))
  loss = lambda x, w: jnp.sum(numerics.quantized_matmul(x, w, "int8") * g)
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  np.testing.assert_allclose(dx, g @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, np.asarray(x, np.float64).T @ g, rtol=1e-5, atol=1e-5)
  fq = lambda x: jnp.sum(numerics.fake_quantize(x, (-1,), "int8") * g[:, :1])
  np.testing.assert_allclose(jax.grad(fq)(x), np.broadcast_to(g[:, :1], x.shape), rtol=1e-6)


class TestExperts(chex.TestCase):
  """int8 training rounds the experts' inputs, weights and hidden activations the same
  way in every dispatch."""

  def setUp(self):
    super().setUp()
    self.m, self.d, self.f, self.e, self.k = 12, 16, 8, 4, 2
    rng = np.random.default_rng(0)   # its own: the module's RNG depends on the test order
    self.x = jnp.asarray(exact_scales(rng.normal(size=(self.m, self.d)), 1))
    ids = np.stack([rng.permutation(self.e)[:self.k] for _ in range(self.m)])
    weights = rng.uniform(0.1, 1.0, size=(self.m, self.k))
    self.routing = Routing(None, None, jnp.asarray(ids, jnp.int32),
                           jnp.asarray(weights, jnp.float32))

  def run_experts(self, dispatch, params=None):
    layer = Experts(self.e, self.f, dispatch=dispatch)
    with nn.intercept_methods(projections.interceptor(model_section(quant="int8"))):
      if params is None:
        return layer.init(jax.random.key(1), self.x, self.routing)["params"]
      return np.asarray(layer.apply({"params": params}, self.x, self.routing), np.float64)

  def test_every_dispatch_equals_numpy(self):
    """Inputs and weights have exact scales (see `exact_scales`); a hidden row's largest
    value is a tie that may round either way, so each token may differ from numpy by one
    quantum of one hidden value per slot (`slack`), and two dispatches by twice that (the
    loop computes the hidden values in another fusion than dense, and a last-bit
    difference can turn a tie)."""
    params = {name: exact_scales(w, 1) for name, w in
              nn.meta.unbox(self.run_experts("dense")).items()}

    def fq(a, axis):
      q, scale = np_quantize(a, axis, 127)
      return q * scale, scale
    x = fq(self.x, 1)[0]
    gate, up, down = (fq(params[n], 1)[0] for n in ("gate", "up", "down"))
    gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
    expected, unrounded = np.zeros((2, self.m, self.d))
    slack = np.full((self.m, self.d), 1e-5)
    ids, weights = np.asarray(self.routing.expert_ids), np.asarray(self.routing.weights)
    for t in range(self.m):
      for slot in range(self.k):
        e, weight = ids[t, slot], weights[t, slot]
        hidden = gelu(x[t] @ gate[e]) * (x[t] @ up[e])
        rounded, scale = fq(hidden[None], 1)
        expected[t] += weight * (rounded[0] @ down[e])
        unrounded[t] += weight * (hidden @ down[e])
        slack[t] += weight * scale[0, 0] * np.abs(down[e]).max(axis=0)
    outputs = {name: self.run_experts(name, params) for name in expert_dispatch.DISPATCHES}
    for name, out in outputs.items():
      np.testing.assert_array_less(np.abs(out - outputs["dense"]), 2 * slack, err_msg=name)
      assert np.all(np.abs(out - expected) <= slack), name
    assert np.any(np.abs(outputs["dense"] - unrounded) > slack)   # the hidden was rounded


@pytest.fixture(scope="module")
def tiny():
  """A float gemma3-tiny with two layers (one local, one global) and its parameters."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=8)
  tokens = jnp.asarray(RNG.integers(0, 512, (2, 12)), jnp.int32)
  return config, gj.transform(config).init(jax.random.key(0), tokens), tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8_weights", "int4_weights"])
def test_quantized_model_runs_scanned_unrolled_and_decoding(tiny, mode):
  config, params, tokens = tiny
  qconfig, qparams = quant.quantize(config, params, mode)
  assert qconfig.model.quant == mode and config.model.quant == "none"
  unrolled = config_dict.ConfigDict(config.to_dict())
  unrolled.model.scan_layers = False
  _, qunrolled = quant.quantize(unrolled, unstack_layers(params, config.model), mode)
  chex.assert_trees_all_equal(unstack_layers(qparams, config.model), qunrolled)
  logits = gj.transform(qconfig).apply(qparams, tokens)
  unrolled.model.quant = mode
  np.testing.assert_allclose(gj.transform(unrolled).apply(qunrolled, tokens), logits,
                             rtol=1e-5, atol=1e-5)
  # Decoding the prompt token by token gives the full forward's logits.
  decoding = gj.inference.make_decoding(qconfig)
  step_logits, cache = decoding.prefill(qparams, tokens[:, :1], cache_length=16)
  for i in range(1, tokens.shape[1]):
    np.testing.assert_allclose(step_logits, logits[:, i - 1], rtol=1e-4, atol=1e-4)
    step_logits, cache = decoding.decode_step(qparams, tokens[:, i], cache)


def param_bytes(tree):
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def test_quantized_parameters_take_less_memory_and_keep_the_rest(tiny):
  config, params, _ = tiny
  flat = flax.traverse_util.flatten_dict(params)
  kernels = sum(v.nbytes for p, v in flat.items() if p[-1] == "kernel")
  rest = param_bytes(params) - kernels
  for mode, ratio in (("int8_weights", 1 / 4), ("int4_weights", 1 / 8)):
    _, qparams = quant.quantize(config, params, mode)
    qflat = flax.traverse_util.flatten_dict(qparams)
    q_kernels = sum(v.nbytes for p, v in qflat.items() if p[-1] == "kernel")
    assert q_kernels == kernels * ratio, mode
    for path, value in flat.items():
      if path[-1] != "kernel":
        np.testing.assert_array_equal(qflat[path], value)   # embeddings, norms: float


@pytest.mark.slow
def test_quantized_parameters_checkpoint_and_shard(tiny, tmp_path):
  config, params, tokens = tiny
  qconfig, qparams = quant.quantize(config, params, "int4_weights")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "q", qparams)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "q", jax.eval_shape(lambda: qparams))
  chex.assert_trees_all_equal(restored, qparams)
  chex.assert_trees_all_equal_dtypes(restored, qparams)

  qconfig.mesh.update(data=1, fsdp=4, tensor=2)
  mesh = sharding.make_mesh(qconfig.mesh)
  shardings = sharding.param_shardings(qconfig, mesh)
  with sharding.activate(mesh):
    placed = jax.device_put(qparams, shardings)
    q = placed["blocks"]["layer_0"]["attn"]["q"]
    assert len({str(s.index) for s in q["kernel"].addressable_shards}) == 8
    assert len({str(s.index) for s in q["kernel_scale"].addressable_shards}) > 1
    rows = jax.device_put(jnp.tile(tokens, (4, 1)), sharding.batch_sharding(mesh))
    logits = gj.transform(qconfig).apply(placed, rows)
  np.testing.assert_allclose(logits[:2], gj.transform(qconfig).apply(qparams, tokens),
                             rtol=1e-5, atol=1e-5)


def test_int4_scales_the_mesh_does_not_divide_stay_whole_there(tiny):
  """d_model 128 holds 4 groups of 32: fsdp=8 splits the weights and not their scales'
  groups (the model was refused, where its float and int8 weights shard)."""
  config, params, tokens = tiny
  qconfig, qparams = quant.quantize(config, params, "int4_weights")
  qconfig.mesh.update(data=1, fsdp=8, tensor=1)
  mesh = sharding.make_mesh(qconfig.mesh)
  shardings = sharding.param_shardings(qconfig, mesh)
  q = shardings["blocks"]["layer_0"]["attn"]["q"]
  assert "fsdp" in str(q["kernel"].spec) and "fsdp" not in str(q["kernel_scale"].spec)
  with sharding.activate(mesh):
    placed = jax.device_put(qparams, shardings)
    rows = jax.device_put(jnp.tile(tokens, (4, 1)), sharding.batch_sharding(mesh))
    logits = gj.transform(qconfig).apply(placed, rows)
  np.testing.assert_allclose(logits[:2], gj.transform(qconfig).apply(qparams, tokens),
                             rtol=1e-5, atol=1e-5)


# Bad input.

@pytest.mark.slow
@pytest.mark.parametrize("mode, stored", [("int8_weights", "int8"), ("int4_weights", "uint8")])
@pytest.mark.parametrize("preset, where", [("gemma3-tiny", r"attn/q/kernel"),
                                           ("gemma4-moe-tiny", r"experts/gate")])
def test_integer_weights_under_a_float_config_are_refused(preset, where, mode, stored):
  """They read as float weights with their scales ignored (logits off by 1.3, silently);
  int4 (two a byte, uint8) failed in Flax's shape check instead."""
  config = gj.get_config(preset)
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=8)
  tokens = jnp.asarray(RNG.integers(0, 512, (1, 8)), jnp.int32)
  params = gj.transform(config).init(jax.random.key(0), tokens)
  config.model.quant_group_size = 16
  quantized = flax.traverse_util.flatten_dict(quant.quantize(config, params, mode)[1])
  # One weight of the kind `where` names holds its integers, the rest are float.
  flat = flax.traverse_util.flatten_dict(params)
  path = min(p for p in flat if "/".join(p).endswith(where))
  flat[path] = quantized[path]
  qparams = flax.traverse_util.unflatten_dict(flat)
  with pytest.raises(ValueError, match=f"{where} holds {stored} weights, which run only "
                     r"under the model.quant they were stored for"):
    gj.transform(config).apply(qparams, tokens)


def test_an_app_refuses_to_run_integer_weights_as_floats(tiny, monkeypatch):
  """--quant=none on a QLoRA workdir, whose base holds integers."""
  config, params, _ = tiny
  qconfig, qparams = quant.quantize(config, params, "int4_weights")
  monkeypatch.setattr(init_from, "load_model",
                      lambda **_: init_from.Loaded(qconfig, qparams, None))
  holder = lambda value: types.SimpleNamespace(value=value)
  model_flags = apps.ModelFlags(holder("runs/q"), holder(None), holder(None), holder("none"))
  with pytest.raises(gj.ConfigError, match=r"runs/q holds int4_weights integer weights \(a "
                     r"QLoRA run's base\), which --quant=none cannot turn back into floats"):
    model_flags.load()


@pytest.mark.parametrize("fields,message", [
    (dict(quant="int2"), "model.quant.*unknown quantization mode 'int2'"),
    (dict(quant="fp8"), "model.quant.*fp8 needs a GPU or TPU"),
    (dict(quant="int8", quant_logits=True), "model.quant_logits.*tied embedding"),
    (dict(quant="int4_weights", quant_group_size=-1), "model.quant_group_size"),
])
def test_bad_quant_fields_are_named(fields, message):
  config = gj.get_config("gemma3-tiny")
  config.model.update(fields)
  with pytest.raises(gj.ConfigError, match=message):
    gj.validate(config)


def test_group_size_not_dividing_names_the_projection(tiny):
  config, params, _ = tiny
  config = config_dict.ConfigDict(config.to_dict())
  config.model.quant_group_size = 24     # d_model 128 and head_dim 32: not divisible
  with pytest.raises(gj.ConfigError, match=r"quant_group_size.*attn/q/kernel.*group size 24"):
    quant.quantize(config, params, "int4_weights")


def test_quantizing_twice_or_an_unknown_mode_is_refused(tiny):
  config, params, tokens = tiny
  qconfig, qparams = quant.quantize(config, params, "int8_weights")
  with pytest.raises(ValueError, match=r"already quantized: .*kernel holds int8"):
    quant.quantize(qconfig, qparams, "int4_weights")
  with pytest.raises(gj.ConfigError, match="mode must be one of"):
    quant.quantize(config, params, "int8")
  with pytest.raises(ValueError, match=r"attn/q/kernel holds float32 weights.*quantize"):
    gj.transform(qconfig).apply(params, tokens)


def test_training_stored_weights_without_lora_is_refused(tmp_path):
  config = gj.get_config("gemma3-tiny")
  config.model.quant = "int8_weights"
  with pytest.raises(gj.ConfigError, match=r"model.quant.*do not train.*'int8'.*LoRA"):
    loop.train(config, str(tmp_path))


# Accuracy on a trained model.

def byte_rows(corpus_glob, seq_len, offset=3):
  """Every seq_len-byte window of the corpus files, as token ids (byte + offset)."""
  import glob  # pylint: disable=import-outside-toplevel
  text = b"".join(open(f, "rb").read() for f in sorted(glob.glob(corpus_glob)))
  ids = np.frombuffer(text, np.uint8).astype(np.int32) + offset
  n = len(ids) // seq_len
  return ids[:n * seq_len].reshape(n, seq_len)


def train(config, params, rows, steps, lr=3e-3, seed=0):
  model = gj.transform(config)
  tx = optax.adamw(lr)

  def loss(params, batch):
    logits = model.apply(params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = tx.init(params)
  order = np.random.default_rng(seed).integers(0, len(rows), (steps, 8))
  for i in range(steps):
    params, opt_state, _ = step(params, opt_state, jnp.asarray(rows[order[i]]))
  return params, jax.jit(loss)


@pytest.fixture(scope="module")
def trained(corpus):
  """A 2-layer d64 model trained 300 steps on the corpus; held-out rows."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(vocab_size=262, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      mlp_dim=128, num_layers=2, attention_pattern=("local", "global"),
                      sliding_window=16)
  rows = np.random.default_rng(0).permutation(byte_rows(corpus, 64))
  train_rows, held_out = rows[:-32], jnp.asarray(rows[-32:])
  params = gj.transform(config).init(jax.random.key(0), held_out[:1])
  params, _ = train(config, params, train_rows, 300)
  return config, params, train_rows, held_out


def eval_loss(config, params, rows):
  logits = gj.transform(config).apply(params, rows)
  return float(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                               rows[:, 1:]).mean())


@pytest.mark.slow
def test_stored_weights_keep_the_eval_loss_of_a_trained_model(trained):
  config, params, _, held_out = trained
  base = eval_loss(config, params, held_out)
  assert base < 3.6          # trained: log(262) = 5.6 untrained
  for mode, bound in (("int8_weights", 0.01), ("int4_weights", 0.05)):
    qconfig, qparams = quant.quantize(config, params, mode)
    change = abs(eval_loss(qconfig, qparams, held_out) / base - 1)
    print(f"{mode}: eval loss {base:.4f} -> relative change {change:.2%}")
    assert change < bound, (mode, base, change)


@pytest.mark.slow
def test_int8_training_reaches_float_training(trained):
  """Fine-tuning the trained model 100 more steps with int8 rounding ends within 2% of
  the same steps in float."""
  config, params, train_rows, held_out = trained
  qat = config_dict.ConfigDict(config.to_dict())
  qat.model.quant = "int8"
  losses = {}
  for name, c in (("float", config), ("int8", qat)):
    tuned, _ = train(c, params, train_rows, 100, lr=3e-4, seed=1)
    losses[name] = eval_loss(c, tuned, held_out)
  print(f"fine-tuned 100 steps: {losses}")
  assert abs(losses["int8"] / losses["float"] - 1) < 0.02, losses
  assert losses["float"] < eval_loss(config, params, held_out)


@pytest.mark.slow
def test_int8_training_runs_in_the_loop_checkpoints_and_resumes(corpus, tmp_path):
  """train.py's loop with quant="int8": a run resumed from its step-3 checkpoint logs
  the uninterrupted run's losses exactly, and rounding changed them (float differs)."""
  config = tiny_config(corpus)
  config.model.quant = "int8"
  config.optimizer.decay_steps = 6
  full = loop.train(config, str(tmp_path / "full"))
  assert full["step"] == 6 and np.isfinite(full["eval_loss"])
  first = config.copy_and_resolve_references()
  first.train.steps = 3
  loop.train(first, str(tmp_path / "resumed"))
  loop.train(config, str(tmp_path / "resumed"))
  records = lambda name: {r["step"]: r["loss"] for r in metrics.read_records(str(tmp_path / name))}
  assert [records("resumed")[s] for s in (4, 5, 6)] == [records("full")[s] for s in (4, 5, 6)]
  floating = config.copy_and_resolve_references()
  floating.model.quant = "none"
  loop.train(floating, str(tmp_path / "float"))
  assert records("float")[6] != records("full")[6]


@pytest.mark.slow
def test_int8_and_int4_weights_of_a_transformers_checkpoint(tmp_path, corpus):
  """A transformers Gemma 3 (random weights, our float loss checked against torch's):
  quantized weights move the loss on real text by < 1% (int8) and < 5% (int4, g32)."""
  torch.manual_seed(3)
  shape = dict(hf_tests.BASE, hidden_size=64, intermediate_size=96, head_dim=32,
               num_hidden_layers=4, num_key_value_heads=2, sliding_window=16)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**shape)).eval()
  model.save_pretrained(tmp_path)
  config, params = gj.hf.load(str(tmp_path))
  rows = jnp.asarray(byte_rows(corpus, 32, offset=0)[:16] % hf_tests.VOCAB)
  with torch.no_grad():
    ids = torch.as_tensor(np.asarray(rows)).long()
    torch_loss = float(model(ids, labels=ids).loss)
  base = eval_loss(config, params, rows)
  assert abs(base - torch_loss) < 1e-4
  for mode, bound in (("int8_weights", 0.01), ("int4_weights", 0.05)):
    qconfig, qparams = quant.quantize(config, params, mode)
    assert abs(eval_loss(qconfig, qparams, rows) / base - 1) < bound, mode


@pytest.mark.slow
def test_qlora_trains_adapters_over_an_int4_base(corpus, tmp_path):
  """LoRA over a transformers checkpoint quantized at load: the adapters train, the
  base stays int4 (and equals quantizing the float checkpoint), and the run's sample
  decodes through both."""
  torch.manual_seed(0)
  shape = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, num_hidden_layers=3, sliding_window=8)
  transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**shape)).save_pretrained(
      tmp_path / "hf")
  config = tiny_config(corpus)
  config.model.update(quant="int4_weights", quant_group_size=16)
  config.lora.rank = 4
  config.train.update(init_from=str(tmp_path / "hf"), steps=8, eval_every=8)
  config.optimizer.learning_rate = 1e-2
  config.sample.max_new_tokens = 4
  summary = loop.train(config, str(tmp_path / "run"))
  assert summary["eval_loss"] < summary["start_eval_loss"] and summary["sample"] is not None
  saved = workdir_lib.load_config(str(tmp_path / "run"))
  run_config, params = init_from.merged(saved, str(tmp_path / "run"))
  assert run_config.model.quant == "int4_weights" and run_config.lora.rank == 4
  base, adapters = lora.split(params)
  float_config, float_params = gj.hf.load(str(tmp_path / "hf"))
  float_config = config_dict.ConfigDict(dict(config.to_dict(), model=float_config.model.to_dict()))
  float_config.lora.rank = 0
  float_config.model.quant_group_size = 16
  _, expected = quant.quantize(float_config, float_params, "int4_weights")
  chex.assert_trees_all_equal(base, expected)
  assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(adapters))
  # The QLoRA workdir as a later run's start (it raised a device_put tree error): its
  # adapters merged into the float weights, W + (alpha / r) A B, here in float64.
  follow = tiny_config(corpus)
  follow.train.init_from = str(tmp_path / "run")
  start = flax.traverse_util.flatten_dict(init_from.base_params(init_from.resolve(follow)))
  float_flat = flax.traverse_util.flatten_dict(float_params)
  adapter_flat = flax.traverse_util.flatten_dict(adapters)
  assert start.keys() == float_flat.keys()
  merged_kernels = 0
  for path, w in float_flat.items():
    want = np.asarray(w, np.float64)
    a = adapter_flat.get(path[:-1] + ("lora_a",))
    if a is not None:
      b = np.asarray(adapter_flat[path[:-1] + ("lora_b",)], np.float64)
      a = np.asarray(a, np.float64)
      r = a.shape[-1]
      lead = a.shape[:a.ndim + b.ndim - 2 - want.ndim]
      delta = np.matmul(a.reshape(lead + (-1, r)), b.reshape(lead + (r, -1)))
      want = want + config.lora.alpha / r * delta.reshape(want.shape)
      merged_kernels += 1
    np.testing.assert_allclose(start[path], want, atol=1e-6, rtol=0, err_msg=str(path))
  assert merged_kernels == len(adapter_flat) // 2
