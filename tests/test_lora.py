"""LoRA (gemma_jax.lora): the adapted projection against a float64 numpy reference,
scanned and unrolled layouts, merging, gradients against the chain rule through the
merged kernel, target checks, sharding on 8 simulated devices, adapter init memory and
the memory plan."""

import functools
import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax import lora, planning, sharding, transformer
from gemma_jax.decoder import unstack_layers
from gemma_jax.layers.linear import Linear

# One scanned (local, global) block and one unscanned local layer.
MODEL = dict(vocab_size=260, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
             num_layers=3, attention_pattern=("local", "global"), sliding_window=5)
RANK, ALPHA = 4, 8.0


def lora_config(**model):
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(MODEL, **model))
  config.lora.rank, config.lora.alpha = RANK, ALPHA
  return config


def tokens(b=2, t=7, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 260, (b, t)), jnp.int32)


def randomized(params, seed=1, scale=0.3):
  """`params` with every adapter leaf (B included) drawn at random, nonzero."""
  base, adapters = lora.split(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  drawn = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return lora.combine(base, jax.tree.unflatten(tree, drawn))


def test_projection_matches_float64_reference():
  """The q (in_dims 1) and out (in_dims 2) projections of layer 0, run in the model with
  nonzero adapters, against x W + (alpha / r) (x A) B in float64 numpy."""
  config = lora_config(scan_layers=False)
  params = randomized(gj.transform(config).init(jax.random.key(0), tokens()))
  calls = {}

  def record(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    if isinstance(context.module, Linear) and context.method_name == "__call__":
      calls["/".join(context.module.scope.path)] = (np.asarray(args[0]), np.asarray(y))
    return y

  t = tokens()
  positions = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
  with nn.intercept_methods(record):   # outside the adapters' interceptor: sees their sum
    transformer.decoder_module(config).apply({"params": params}, t, positions, jnp.ones_like(t))
  scale = ALPHA / RANK
  for name, in_dims in (("q", 1), ("out", 2)):
    x, y = calls[f"layers_0/attn/{name}"]
    p = {k: np.asarray(v, np.float64) for k, v in params["layers_0"]["attn"][name].items()}
    n_in = math.prod(p["kernel"].shape[:in_dims])
    rows = x.reshape(-1, n_in).astype(np.float64)
    expected = (rows @ p["kernel"].reshape(n_in, -1)
                + scale * (rows @ p["lora_a"].reshape(n_in, RANK)) @ p["lora_b"].reshape(RANK, -1))
    delta = expected - rows @ p["kernel"].reshape(n_in, -1)
    assert np.abs(delta).max() > 0.1           # the adapters matter in this comparison
    np.testing.assert_allclose(y.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    assert p["lora_a"].shape == p["kernel"].shape[:in_dims] + (RANK,)
    assert p["lora_b"].shape == (RANK,) + p["kernel"].shape[in_dims:]


def test_every_default_target_gets_adapters_scanned_and_unrolled():
  """Default targets: 7 projections in each of the 3 layers (scanned: 2 stacked in the
  block's layer_0 and layer_1, and the unscanned layers_2)."""
  for scan in (True, False):
    shapes = flax.traverse_util.flatten_dict(lora.adapter_shapes(lora_config(scan_layers=scan)))
    kernels = {path[:-1] for path in shapes}
    assert len(kernels) == 7 * 3 and len(shapes) == 2 * 7 * 3
  shapes = lora.adapter_shapes(lora_config())
  assert shapes["blocks"]["layer_0"]["mlp"]["down"]["lora_a"].shape == (1, 64, RANK)
  assert shapes["layers_2"]["attn"]["out"]["lora_b"].shape == (RANK, 32)
  assert lora.param_count(lora_config()) == 3 * RANK * (
      (32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32))


def test_scanned_equals_unrolled():
  scanned = lora_config()
  params = randomized(gj.transform(scanned).init(jax.random.key(0), tokens()))
  unrolled = lora_config(scan_layers=False)
  got = gj.transform(scanned).apply(params, tokens())
  want = gj.transform(unrolled).apply(unstack_layers(params, scanned.model), tokens())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fresh_adapters_change_nothing_and_merge_equals_adapters():
  config = lora_config()
  params = gj.transform(config).init(jax.random.key(0), tokens())
  base, _ = lora.split(params)
  plain = gj.transform(lora.disabled(config))
  np.testing.assert_array_equal(gj.transform(config).apply(params, tokens()),
                                plain.apply(base, tokens()))
  params = randomized(params)
  merged = lora.merge(config, params)
  assert jax.tree.structure(merged) == jax.tree.structure(base)
  with_adapters = gj.transform(config).apply(params, tokens())
  without = plain.apply(base, tokens())
  assert np.abs(with_adapters - without).max() > 0.1
  np.testing.assert_allclose(plain.apply(merged, tokens()), with_adapters, rtol=1e-4, atol=1e-4)
  print("merge max-abs diff:", float(np.abs(plain.apply(merged, tokens()) - with_adapters).max()))


@pytest.mark.slow
@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_adapter_gradients_follow_the_merged_kernel(remat_policy):
  """grad wrt the adapters (the base frozen, passed separately) against the chain rule
  through the merged kernel W' = W + s A B, computed by the plain model: dA = s dW' B^T,
  dB = s A^T dW'."""
  config = lora_config(remat_policy=remat_policy)
  params = randomized(gj.transform(config).init(jax.random.key(0), tokens()))
  base, adapters = lora.split(params)
  t = tokens()
  model, plain = gj.transform(config), gj.transform(lora.disabled(config))

  def loss(logits):
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  grads = jax.jit(jax.grad(lambda a, b: loss(model.apply(lora.combine(b, a), t))))(adapters, base)
  merged_grads = jax.grad(lambda p: loss(plain.apply(p, t)))(lora.merge(config, params))
  s = ALPHA / RANK
  for path in (("blocks", "layer_1", "attn", "out"), ("layers_2", "mlp", "up")):
    g, m, a = grads, merged_grads, adapters
    for name in path:
      g, m, a = g[name], m[name], a[name]
    dw = np.asarray(m["kernel"], np.float64)
    lead = dw.shape[:1] if path[0] == "blocks" else ()
    k = a["lora_a"].ndim - len(lead) - 1
    dw = dw.reshape(lead + (math.prod(dw.shape[len(lead):len(lead) + k]), -1))
    a_, b_ = (np.asarray(a[n], np.float64) for n in ("lora_a", "lora_b"))
    a_, b_ = a_.reshape(dw.shape[:-1] + (RANK,)), b_.reshape(lead + (RANK, dw.shape[-1]))
    want_a = s * dw @ np.swapaxes(b_, -1, -2)
    want_b = s * np.swapaxes(a_, -1, -2) @ dw
    assert np.abs(want_a).max() > 1e-4 and np.abs(want_b).max() > 1e-4
    np.testing.assert_allclose(np.asarray(g["lora_a"]).reshape(want_a.shape), want_a,
                               rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g["lora_b"]).reshape(want_b.shape), want_b,
                               rtol=1e-3, atol=1e-6)


def test_dropout_acts_on_the_adapter_input_only():
  config = lora_config()
  config.lora.dropout = 0.5
  model = gj.transform(config)
  params = model.init(jax.random.key(0), tokens())
  deterministic = model.apply(params, tokens())
  # Fresh adapters (B = 0): dropping their input changes nothing.
  np.testing.assert_array_equal(model.apply(params, tokens(), rng=jax.random.key(3)),
                                deterministic)
  params = randomized(params)
  deterministic = model.apply(params, tokens())
  dropped = model.apply(params, tokens(), rng=jax.random.key(3))
  assert np.abs(dropped - deterministic).max() > 1e-3
  np.testing.assert_array_equal(model.apply(params, tokens(), rng=jax.random.key(3)), dropped)
  np.testing.assert_array_equal(model.apply(params, tokens()), deterministic)


def test_target_matching_nothing_is_a_config_error():
  config = lora_config()
  config.lora.targets = (r"attn/q/kernel$", r"attn/query/kernel$")
  for check in (lora.check_targets,
                lambda c: gj.transform(c).init(jax.random.key(0), tokens()),
                lambda c: sharding.param_specs(c, dict(data=1, fsdp=1, tensor=1, expert=1))):
    with pytest.raises(gj.ConfigError, match=r"lora\.targets.*attn/query/kernel") as error:
      check(config)
    assert error.value.field == "lora.targets"
  config.lora.targets = (r"attn/q/kernel$",)
  lora.check_targets(config)


def test_a_target_in_one_layer_adapts_that_layer_only():
  """Layers 0 and 2 are alike (both local), but only layer 0's q is targeted: it alone
  gets adapters, and the model runs as the plain one on the merged weights."""
  config = lora_config(scan_layers=False)
  config.lora.targets = (r"layers_0/attn/q/kernel$",)
  shapes = flax.traverse_util.flatten_dict(lora.adapter_shapes(config))
  assert {path[:-1] for path in shapes} == {("layers_0", "attn", "q")}
  params = randomized(gj.transform(config).init(jax.random.key(0), tokens()))
  base, _ = lora.split(params)
  plain = gj.transform(lora.disabled(config))
  got = gj.transform(config).apply(params, tokens())
  assert np.abs(got - plain.apply(base, tokens())).max() > 0.1
  np.testing.assert_allclose(got, plain.apply(lora.merge(config, params), tokens()),
                             rtol=1e-4, atol=1e-4)


def test_targets_select_projections():
  config = lora_config()
  config.lora.targets = (r"attn/(q|v)/kernel$",)
  shapes = flax.traverse_util.flatten_dict(lora.adapter_shapes(config))
  assert {path[-2] for path in shapes} == {"q", "v"}


@pytest.mark.slow
def test_sharded_forward_and_gradients_on_8_devices():
  """param_specs name the adapters' axes; on a fsdp 4 x tensor 2 mesh the forward and the
  adapters' gradients equal one device's."""
  assert jax.device_count() == 8
  config = lora_config()
  config.mesh.update(dict(data=1, fsdp=4, tensor=2, expert=1))
  specs = sharding.param_specs(config, dict(data=1, fsdp=4, tensor=2, expert=1))
  P = jax.sharding.PartitionSpec
  q = specs["blocks"]["layer_0"]["attn"]["q"]
  assert q["lora_a"] == P(None, "fsdp", None)
  assert q["lora_b"] == P(None, None, "tensor", None)
  assert specs["layers_2"]["mlp"]["down"]["lora_a"] == P("tensor", None)
  assert specs["layers_2"]["mlp"]["down"]["lora_b"] == P(None, "fsdp")

  model = gj.transform(config)
  params = randomized(model.init(jax.random.key(0), tokens(b=4)))
  base, adapters = lora.split(params)
  loss = lambda a, b: jnp.mean(model.apply(lora.combine(b, a), tokens(b=4)) ** 2)
  want_loss, want_grads = jax.value_and_grad(loss)(adapters, base)
  mesh = sharding.make_mesh(config.mesh)
  shardings = sharding.param_shardings(config, mesh)
  base_shardings, adapter_shardings = lora.split(shardings)
  with sharding.activate(mesh):
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss), out_shardings=(
        sharding.replicated(mesh), adapter_shardings))(
            jax.device_put(adapters, adapter_shardings), jax.device_put(base, base_shardings))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6),
               got_grads, want_grads)
  assert got_grads["blocks"]["layer_0"]["attn"]["q"]["lora_a"].sharding.spec == q["lora_a"]


def gemma3_1b_adapter_count(rank):
  """Adapter parameters of gemma3-1b's 7 default projections, by hand from its shapes."""
  d, heads, kv_heads, head_dim, mlp, layers = 1152, 4, 1, 256, 6912, 26
  per_layer = (d + heads * head_dim) * 2 + (d + kv_heads * head_dim) * 2 + (d + mlp) * 3
  return layers * rank * per_layer


@pytest.mark.slow
def test_init_adapters_materialises_only_the_adapters():
  """gemma3-1b, rank 16: the compiled init holds the adapters and little else, far below
  the 4 GB of the float32 base it never builds."""
  config = gj.get_config("gemma3-1b")
  config.lora.rank = 16
  count = gemma3_1b_adapter_count(16)
  assert lora.param_count(config) == count
  compiled = jax.jit(functools.partial(lora.init_adapters, config)).lower(
      jax.random.key(0)).compile()
  memory = compiled.memory_analysis()
  # The adapters, plus the output tuple's table of 8-byte pointers.
  assert 4 * count <= memory.output_size_in_bytes <= 4 * count + 8 * 2 * 7 * 26
  print("init_adapters, gemma3-1b rank 16: output", memory.output_size_in_bytes,
        "temp", memory.temp_size_in_bytes, "bytes")
  assert memory.temp_size_in_bytes < 4 * count   # the base alone would be ~1e9 x 4 bytes
  adapters = lora.init_adapters(lora_config(), jax.random.key(0))
  assert all(np.all(np.asarray(b) == 0) for path, b in flax.traverse_util.flatten_dict(
      adapters).items() if path[-1] == "lora_b")
  assert all(np.asarray(a).std() > 0.05 for path, a in flax.traverse_util.flatten_dict(
      adapters).items() if path[-1] == "lora_a")


@pytest.mark.slow
def test_plan_counts_adapter_gradients_and_optimizer_state_only():
  """gemma3-1b on one device, rank 16: the base stays in the plan's params (frozen, in
  param_dtype), gradients and Adam's two float32 moments cover the adapters only."""
  full = gj.get_config("gemma3-1b")
  full.train.batch_size, full.optimizer.grad_accum_steps = 1, 1
  tuned = gj.get_config("gemma3-1b")
  tuned.train.batch_size, tuned.optimizer.grad_accum_steps = 1, 1
  tuned.lora.rank = 16
  full_plan, lora_plan = (planning.plan(c, 1, 1, 1024) for c in (full, tuned))
  count = gemma3_1b_adapter_count(16)
  assert lora_plan["gradients"] == 4 * count
  assert lora_plan["optimizer_state"] == 2 * 4 * count
  assert lora_plan["optimizer_state"] < 0.05 * full_plan["optimizer_state"]
  assert lora_plan["params"] == full_plan["params"] + 4 * count
  assert lora_plan["trainable_params"] == count
