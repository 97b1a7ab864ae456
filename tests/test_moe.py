"""Mixture of experts: dispatches against a float64 numpy loop and each other (outputs
and gradients), the router and the auxiliary losses against float64 numpy, and the
train step adding and logging them."""

import functools
import os
import subprocess
import sys
from unittest import mock

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import gemma_jax as gj
from gemma_jax import inference
from gemma_jax.layers import expert_dispatch, grouped_mlp, moe
from gemma_jax.training import metrics, steps
from test_training import REPO


def np_gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np_experts(x, expert_ids, weights, gate, up, down):
  """Token by token, slot by slot, in float64."""
  x, weights, gate, up, down = (np.asarray(a, np.float64) for a in (x, weights, gate, up, down))
  out = np.zeros_like(x)
  for m in range(x.shape[0]):
    for slot, e in enumerate(np.asarray(expert_ids)[m]):
      hidden = np_gelu_tanh(x[m] @ gate[e]) * (x[m] @ up[e])
      out[m] += weights[m, slot] * (hidden @ down[e])
  return out


def np_router(x, scale, proj, per_expert_scale, k, eps=1e-6):
  """(probs, logits, ids, weights) in float64: RMSNorm without scale, x scale x D^-0.5,
  projection, softmax, top-k renormalised, x per-expert scale."""
  x = np.asarray(x, np.float64)
  h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale * x.shape[-1] ** -0.5
  logits = h @ np.asarray(proj, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
  top = np.take_along_axis(probs, ids, -1)
  weights = top / top.sum(-1, keepdims=True) * np.asarray(per_expert_scale)[ids]
  return probs, logits, ids, weights


def np_aux(probs, logits, ids, num_experts):
  """(expert load, load-balancing loss, router z-loss) in float64."""
  load = np.bincount(ids.reshape(-1), minlength=num_experts) / ids.size
  balance = num_experts * np.sum(load * probs.mean(0))
  top = logits.max(-1)
  log_z = top + np.log(np.exp(logits - top[:, None]).sum(-1))
  return load, balance, np.mean(log_z ** 2)


def expert_problem(m=24, d=8, f=12, e=6, k=2, seed=0, skew=False):
  """Tokens, routing and expert weights; `skew` routes every token's first slot to
  expert 1 and leaves experts 0 and 5 empty."""
  rng = np.random.RandomState(seed)
  x = rng.normal(size=(m, d)).astype(np.float32)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
  if skew:
    ids = np.stack([np.concatenate([[1], rng.permutation([2, 3, 4])[:k - 1]])
                    for _ in range(m)]).astype(np.int32)
  weights = rng.uniform(0.1, 1.0, size=(m, k)).astype(np.float32)
  gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.4 for _ in range(2))
  down = rng.normal(size=(e, f, d)).astype(np.float32) * 0.4
  return x, ids, weights, gate, up, down


GATED_GELU = lambda gate, up: jax.nn.gelu(gate, approximate=True) * up


class DispatchTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("top1", dict(k=1)), ("top3_skewed", dict(k=3, skew=True)))
  def test_every_dispatch_matches_float64_loop(self, problem):
    x, ids, weights, gate, up, down = expert_problem(**problem)
    expected = np_experts(x, ids, weights, gate, up, down)
    for name, dispatch in expert_dispatch.DISPATCHES.items():
      out = self.variant(lambda *a, dispatch=dispatch: dispatch(*a, GATED_GELU))(
          x, ids, weights, gate, up, down)
      chex.assert_shape(out, x.shape)
      np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, err_msg=name)
    # `switched` takes the experts as one array each (decoding's layout on the CPU).
    split = moe.split_experts({"gate": gate, "up": up, "down": down})
    assert all(len(split[n]) == gate.shape[0] for n in moe.EXPERT_WEIGHTS)
    out = self.variant(lambda x, ids, weights, split: expert_dispatch.switched(
        x, ids, weights, split["gate"], split["up"], split["down"], GATED_GELU))(
            x, ids, weights, split)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, err_msg="switched")

  @parameterized.parameters(("loop", False), ("loop", True), ("ragged", True), ("dense", True))
  def test_float64_under_jax_enable_x64_matches_numpy(self, name, skew):
    # Under x64, JAX's default ints are int64: the loop's block offsets (int32) once met
    # a literal 0 made int64 in one dynamic_slice, which refused the mix.
    x, ids, weights, gate, up, down = expert_problem(k=3, skew=skew)
    with jax.enable_x64(True):
      args = [jnp.asarray(a, jnp.float64) for a in (x, weights, gate, up, down)]
      dispatch = expert_dispatch.DISPATCHES[name]
      run = lambda x, weights, gate, up, down: dispatch(x, jnp.asarray(ids), weights, gate,
                                                        up, down, GATED_GELU)
      out = jax.jit(run)(*args)
      grads = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 2))(*args)
      reference = jax.grad(lambda *a: jnp.sum(jnp.sin(expert_dispatch.dense(
          a[0], jnp.asarray(ids), *a[1:], GATED_GELU))), argnums=(0, 2))(*args)
    self.assertEqual(out.dtype, jnp.float64)
    np.testing.assert_allclose(out, np_experts(x, ids, weights, gate, up, down),
                               rtol=1e-12, atol=1e-12)
    chex.assert_trees_all_close(grads, reference, rtol=1e-12, atol=1e-12)

  def test_ragged_runs_the_ragged_dot_it_is_given(self):
    # How a kernel library's ragged_dot (tokamax's, which benchmarks/moe_dispatch.py
    # times on a GPU) takes the grouped matmuls: each projection through it.
    x, ids, weights, gate, up, down = expert_problem(k=2)
    calls = []

    def counted(lhs, rhs, group_sizes, **kwargs):
      calls.append((lhs.shape, rhs.shape))
      return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kwargs)

    out = expert_dispatch.ragged(x, ids, weights, gate, up, down, GATED_GELU,
                                 ragged_dot=counted)
    a, (e, d, f) = ids.size, gate.shape
    self.assertEqual(calls, [((a, d), (e, d, f))] * 2 + [((a, f), (e, f, d))])
    np.testing.assert_allclose(out, np_experts(x, ids, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("top1", dict(k=1)), ("top2_skewed", dict(k=2, skew=True)))
  def test_sorted_dispatch_gradients_equal_dense_reference(self, problem):
    x, ids, weights, gate, up, down = expert_problem(**problem)
    target = np.random.RandomState(1).normal(size=x.shape).astype(np.float32)

    def grads(dispatch):
      loss = lambda *a: jnp.sum(jnp.sin(dispatch(a[0], ids, *a[1:], GATED_GELU)) * target)
      return self.variant(jax.grad(loss, argnums=range(5)))(x, weights, gate, up, down)

    reference = grads(expert_dispatch.dense)
    for name in ("ragged", "loop", "gather", "sliced"):
      chex.assert_trees_all_close(grads(expert_dispatch.DISPATCHES[name]), reference,
                                  rtol=1e-5, atol=1e-5, custom_message=name)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(((16, 4), 0), ((32,), 0), (grouped_mlp.BLOCK_ROWS, 0),
                            ((16, 4), None), ((32,), 8), ((16, 4), 80),
                            ((32,), 0, (3, 0, 4, 1, 0)), ((16, 4), 8, (5, 0, 30, 1, 9), 40))
  def test_grouped_mlp_and_its_vjp_match_float64(self, blocks, capacity_rows,
                                                 sizes=(5, 0, 70, 1, 33), ungrouped=0):
    """Output and all four gradients against numpy in float64, with tanh(gate) * up as
    the hidden function (its derivative written out below). Capacity 0 runs every row
    through the loop, 80 every row batched; the default (27 here) and 8 split groups
    between the two. The default sizes have an empty group, whole and partial blocks, and
    a last partial block that ends past the rows (moved back); one case has fewer rows
    than one block; the last has `ungrouped` rows past the groups (another device's
    under expert parallelism): zero out, zero gradient."""
    rng = np.random.RandomState(2)
    sizes = np.array(sizes, np.int32)
    e, d, f = 5, 6, 4
    a = sizes.sum() + ungrouped
    rows = rng.normal(size=(a, d)).astype(np.float32)
    gate, up = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.5 for _ in range(2))
    down = rng.normal(size=(e, f, d)).astype(np.float32) * 0.5
    grad_out = rng.normal(size=(a, d)).astype(np.float32)
    group = np.repeat(np.arange(e), sizes)
    rows, grad_out, ungrouped_rows = rows[:sizes.sum()], grad_out[:sizes.sum()], (rows, grad_out)
    x, dy = rows.astype(np.float64), grad_out.astype(np.float64)
    wg, wu, wd = (w.astype(np.float64)[group] for w in (gate, up, down))   # [A, ...]
    g, u = np.einsum("ad,adf->af", x, wg), np.einsum("ad,adf->af", x, wu)
    h = np.tanh(g) * u
    expected = np.einsum("af,afd->ad", h, wd)
    dh = np.einsum("ad,afd->af", dy, wd)
    dg, du = dh * u * (1 - np.tanh(g) ** 2), dh * np.tanh(g)
    expected_rows = np.einsum("af,adf->ad", dg, wg) + np.einsum("af,adf->ad", du, wu)
    per_group = lambda p, q: np.stack([p[group == i].T @ q[group == i] for i in range(e)])
    expected_weights = (per_group(x, dg), per_group(x, du), per_group(h, dy))

    mlp = lambda r, *w: grouped_mlp.grouped_mlp(r, *w, sizes, lambda a, b: jnp.tanh(a) * b,
                                                blocks, capacity_rows)
    out, vjp = self.variant(lambda *a: jax.vjp(mlp, *a))(ungrouped_rows[0], gate, up, down)
    grads = vjp(ungrouped_rows[1])
    chex.assert_shape(out, (a, d))
    np.testing.assert_array_equal(out[sizes.sum():], 0)
    np.testing.assert_array_equal(grads[0][sizes.sum():], 0)
    out, grads = out[:sizes.sum()], (grads[0][:sizes.sum()], *grads[1:])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[0], expected_rows, rtol=1e-5, atol=1e-5)
    for got, want, name in zip(grads[1:], expected_weights, ("gate", "up", "down")):
      chex.assert_shape(got, want.shape)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)

  def test_grouped_mlp_names_a_hidden_function_closing_over_arrays(self):
    x, ids, weights, gate, up, down = expert_problem()
    scale = jnp.float32(2.0)

    def loss(scale):
      hidden = lambda g, u: scale * g * u        # scale would get no gradient
      return jnp.sum(expert_dispatch.loop(x, ids, weights, gate, up, down, hidden))
    with self.assertRaisesRegex(ValueError, r"hidden\(gate, up\) must depend on its inputs"):
      jax.grad(loss)(scale)

  def test_the_loop_backward_runs_an_intercepted_hidden_hook(self):
    """`Experts.hidden` is a hook (int8 training rounds its output through an
    interceptor). The loop's backward pass is traced after the layer's apply has
    returned, yet must run the hook as intercepted in the forward pass: here one that
    doubles the hidden activations, which doubles the down projection's gradient
    contribution. Gradients equal the dense dispatch's under the same interceptor."""
    x, ids, weights, gate, up, down = expert_problem()
    routing = moe.Routing(None, None, jnp.asarray(ids), jnp.asarray(weights))
    target = np.random.RandomState(1).normal(size=x.shape).astype(np.float32)

    def doubled(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      return 2 * out if context.method_name == "hidden" else out

    def grads(dispatch, intercept):
      layer = moe.Experts(gate.shape[0], gate.shape[2], dispatch=dispatch)

      def loss(params, x):   # as the model applies quantization: around the apply only
        with nn.intercept_methods(doubled if intercept else lambda f, a, k, _: f(*a, **k)):
          out = layer.apply({"params": params}, x, routing)
        return jnp.sum(jnp.sin(out) * target)
      return jax.grad(loss, argnums=(0, 1))({"gate": gate, "up": up, "down": down}, x)

    plain = grads("loop", False)
    reference = grads("dense", True)
    chex.assert_trees_all_close(grads("loop", True), reference, rtol=1e-5, atol=1e-5)
    assert not np.allclose(plain[0]["down"], reference[0]["down"], rtol=1e-2)

  @parameterized.parameters(((128, 32), 0), ((32,), 0), ((256, 128, 32), 0),
                            ((128, 32), 40), ((128, 32), None))
  def test_computed_rows_count_each_groups_padded_blocks(self, blocks, capacity_rows):
    """computed_rows counts what is multiplied: C rows per group batched, then past them,
    per group, greedy whole blocks of each larger tier, then the rest in smallest blocks,
    the last one padded; tiers no group can fill (longer than all rows) are skipped."""
    sizes = np.array([0, 1, 31, 32, 33, 127, 128, 129, 300], np.int32)

    def by_hand(size, total, c):
      done, rest = c, max(size - c, 0)
      for block in [b for b in blocks[:-1] if b <= total]:
        done, rest = done + rest // block * block, rest % block
      return done + -(-rest // blocks[-1]) * blocks[-1]

    for group_sizes in (sizes, sizes[:4]):
      total = int(group_sizes.sum())
      mean = total / len(group_sizes)     # the default: mean + sqrt(mean), rounded up
      c = int(np.ceil(mean + np.sqrt(mean))) if capacity_rows is None else capacity_rows
      want = sum(by_hand(int(size), total, c) for size in group_sizes)
      self.assertEqual(int(grouped_mlp.computed_rows(jnp.asarray(group_sizes), blocks,
                                                     capacity_rows)), want)

  def test_auto_picks_the_loop_on_cpu_and_sliced_for_few_rows(self):
    self.assertEqual(jax.default_backend(), "cpu")
    self.assertEqual(expert_dispatch.resolve("auto", assignments=64, num_experts=8), "loop")
    self.assertEqual(expert_dispatch.resolve("auto", assignments=4, num_experts=8), "sliced")
    self.assertEqual(expert_dispatch.resolve("dense", assignments=4, num_experts=8), "dense")

  @parameterized.parameters(("gpu", "loop", "gather"), ("tpu", "ragged", "gather"),
                            ("cpu", "loop", "sliced"))
  def test_auto_runs_ragged_dot_only_where_xla_does_not_expand_it(self, backend, many, few):
    # XLA's CPU and NVIDIA GPU backends rewrite ragged_dot into a product of every row
    # with every expert (E times the routed work); only the TPU's runs it as grouped.
    with mock.patch.object(jax, "default_backend", return_value=backend):
      self.assertEqual(expert_dispatch.resolve("auto", assignments=64, num_experts=8), many)
      self.assertEqual(expert_dispatch.resolve("auto", assignments=4, num_experts=8), few)
      self.assertIs(expert_dispatch.for_rows("auto", 4, 8), expert_dispatch.DISPATCHES[few])


def random_params(module, x, seed):
  """The module's parameters, every one (ones-initialised scales included) random."""
  params = nn.meta.unbox(jax.jit(module.init)(jax.random.key(seed), x)["params"])
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [leaf + 0.5 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)])


class RouterTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_router_matches_float64(self):
    x = jax.random.normal(jax.random.key(0), (20, 16)) * 3
    router = moe.Router(num_experts=8, experts_per_token=3)
    params = random_params(router, x, seed=1)
    routing = self.variant(router.apply)({"params": params}, x)
    probs, logits, ids, weights = np_router(x, params["scale"], params["proj"]["kernel"],
                                            params["per_expert_scale"], k=3)
    np.testing.assert_array_equal(routing.expert_ids, ids)
    np.testing.assert_allclose(routing.probs, probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(routing.weights, weights, rtol=1e-5, atol=1e-6)
    self.assertEqual(routing.weights.dtype, jnp.float32)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aux_losses_match_float64(self):
    rng = np.random.RandomState(3)
    logits = rng.normal(size=(30, 5)).astype(np.float32) * 2
    probs = np.asarray(jax.nn.softmax(logits))
    ids = np.argsort(-probs, axis=-1)[:, :2].astype(np.int32)
    routing = moe.Routing(logits, probs, ids, np.ones((30, 2), np.float32))
    load, balance, z = np_aux(probs.astype(np.float64), logits.astype(np.float64), ids, 5)
    np.testing.assert_allclose(self.variant(moe.expert_load, static_argnums=1)(ids, 5), load,
                               rtol=1e-6)
    np.testing.assert_allclose(self.variant(moe.load_balance_loss)(routing), balance, rtol=1e-5)
    np.testing.assert_allclose(self.variant(moe.router_z_loss)(routing), z, rtol=1e-5)


BLOCK = dict(mlp_dim=20, num_experts=6, experts_per_token=2, expert_mlp_dim=12,
             norm_plus_one=False)


@functools.lru_cache()
def block_and_params():
  """A MoeBlock with both losses on, random parameters and an input [2, 7, 16]."""
  x = jax.random.normal(jax.random.key(4), (2, 7, 16))
  block = moe.MoeBlock(**BLOCK, load_balance_loss_weight=0.1, router_z_loss_weight=0.01)
  return block, random_params(block, x, seed=5), x


class MoeBlockTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_block_matches_float64_and_sows_weighted_losses(self):
    block, params, x = block_and_params()
    out, state = self.variant(lambda p, x: block.apply({"params": p}, x,
                                                       mutable=["intermediates"]))(params, x)
    chex.assert_shape(out, x.shape)

    def norm(v, scale):
      v = np.asarray(v, np.float64)
      return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * np.asarray(scale)

    tokens = np.asarray(x, np.float64).reshape(14, 16)
    shared_p = params["shared"]
    h = norm(tokens, params["pre_shared_norm"]["scale"])
    shared = (np_gelu_tanh(h @ shared_p["gate"]["kernel"]) * (h @ shared_p["up"]["kernel"])
              ) @ shared_p["down"]["kernel"]
    r = params["router"]
    probs, logits, ids, weights = np_router(tokens, r["scale"], r["proj"]["kernel"],
                                            r["per_expert_scale"], k=2)
    experts = params["experts"]
    routed = np_experts(norm(tokens, params["pre_routed_norm"]["scale"]), ids, weights,
                        experts["gate"], experts["up"], experts["down"])
    expected = (norm(shared, params["post_shared_norm"]["scale"])
                + norm(routed, params["post_routed_norm"]["scale"]))
    np.testing.assert_allclose(out.reshape(14, 16), expected, rtol=1e-4, atol=1e-4)

    load, balance, z = np_aux(probs, logits, ids, 6)
    sown = state["intermediates"]
    np.testing.assert_allclose(sown["expert_load"][0], load, rtol=1e-6)
    np.testing.assert_allclose(sown["load_balance_loss"][0], 0.1 * balance, rtol=1e-5)
    np.testing.assert_allclose(sown["router_z_loss"][0], 0.01 * z, rtol=1e-5)

  def test_zero_weights_disable_the_losses(self):
    x = jnp.ones((1, 3, 16))
    block = moe.MoeBlock(**BLOCK)
    params = nn.meta.unbox(block.init(jax.random.key(0), x)["params"])
    _, state = block.apply({"params": params}, x, mutable=["intermediates"])
    self.assertEqual(sorted(state["intermediates"]), ["expert_load"])

  def test_expert_weights_carry_the_expert_axis(self):
    boxed = jax.eval_shape(moe.MoeBlock(**BLOCK).init, jax.random.key(0),
                           jnp.ones((1, 3, 16)))["params"]
    specs = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed))
    self.assertEqual(tuple(specs["experts", "gate"]), ("expert", "embed", "mlp"))
    self.assertEqual(tuple(specs["experts", "up"]), ("expert", "embed", "mlp"))
    self.assertEqual(tuple(specs["experts", "down"]), ("expert", "mlp", "embed"))


@pytest.mark.parametrize("dispatch,ragged", [("auto", False), ("ragged", True)])
def test_a_gpu_training_program_holds_ragged_dot_only_when_asked(dispatch, ragged):
  """The gradient of a bfloat16 MoE model lowered for CUDA (here, without a GPU): `auto`
  leaves out ragged_dot, which XLA's GPU backend would expand to every row times every
  expert; asked for by name, it is there."""
  config = gj.get_config("gemma4-moe-tiny")
  config.model.update(num_layers=2, dtype="bfloat16", moe_dispatch=dispatch)
  model = gj.transform(config)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 64)), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
  loss = lambda p: jnp.sum(model.apply(p, tokens).astype(jnp.float32))
  with mock.patch.object(jax, "default_backend", return_value="gpu"):
    lowered = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",))
  assert ("ragged_dot" in lowered.as_text()) == ragged


def test_summarize_averages_scanned_and_unscanned_layers():
  """Two scanned blocks of one MoE layer each (leading block axis), then one unscanned."""
  scanned = {"expert_load": (np.array([[0.5, 0.5], [1.0, 0.0]], np.float32),),
             "load_balance_loss": (np.array([1.0, 2.0], np.float32),)}
  unscanned = {"expert_load": (np.array([0.0, 1.0], np.float32),),
               "load_balance_loss": (np.array(6.0, np.float32),)}
  summary = moe.summarize({"blocks": {"layer_0": {"moe": scanned}},
                           "layers_2": {"moe": unscanned}})
  np.testing.assert_allclose(summary["expert_load"], [0.5, 0.5])
  np.testing.assert_allclose(summary["losses"]["load_balance_loss"], 3.0)
  assert sorted(summary["losses"]) == ["load_balance_loss"]


def test_split_experts_splits_unscanned_experts_only():
  gate, kernel = np.zeros((4, 8, 6), np.float32), np.zeros((8, 6), np.float32)
  scanned = {"gate": np.zeros((2,) + gate.shape, np.float32), "up": np.zeros((2, 4, 8, 6)),
             "down": np.zeros((2, 4, 6, 8))}
  params = {"blocks": {"layer_0": {"moe": {"experts": scanned}}},
            "layers_2": {"moe": {"experts": {"gate": gate, "up": gate, "down": gate}},
                         "mlp": {"gate": {"kernel": kernel}}}}
  split = moe.split_experts(params)
  assert all(split["blocks"]["layer_0"]["moe"]["experts"][n] is scanned[n] for n in scanned)
  experts = split["layers_2"]["moe"]["experts"]
  assert all(isinstance(experts[n], tuple) and len(experts[n]) == 4 for n in experts)
  np.testing.assert_array_equal(experts["gate"][3], gate[3])
  assert split["layers_2"]["mlp"]["gate"]["kernel"] is kernel


def moe_tiny(**overrides):
  """Three layers: one scanned block (local, global), then a global last layer."""
  config = gj.get_config("gemma4-moe-tiny")
  config.model.update(dict(vocab_size=64, d_model=32, num_heads=2, num_kv_heads=1, head_dim=8,
                           global_head_dim=16, mlp_dim=32, num_experts=4, expert_mlp_dim=16,
                           num_layers=3, attention_pattern=("local", "global"),
                           sliding_window=4, load_balance_loss_weight=0.01,
                           router_z_loss_weight=0.001))
  config.model.update(overrides)
  return config


@pytest.fixture(scope="module")
def moe_model():
  """The tiny MoE model with the dense dispatch, its parameters and a batch."""
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 12)), jnp.int32)
  model = gj.transform(moe_tiny(moe_dispatch="dense"))
  batch = dict(tokens=tokens, targets=jnp.roll(tokens, -1, axis=1),
               weights=jnp.ones((2, 12), jnp.float32), segment_ids=jnp.ones_like(tokens),
               positions=jnp.broadcast_to(jnp.arange(12), (2, 12)))
  return model, model.init(jax.random.key(0), tokens), batch


@pytest.mark.slow
def test_model_logits_do_not_depend_on_dispatch(moe_model):
  model, params, batch = moe_model
  expected = model.apply(params, batch["tokens"])
  for dispatch in ("ragged", "loop", "gather", "sliced"):
    logits = gj.transform(moe_tiny(moe_dispatch=dispatch)).apply(params, batch["tokens"])
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5, err_msg=dispatch)


@pytest.mark.slow
def test_model_and_its_decoding_run_under_jax_enable_x64(moe_model):
  """With x64 on (int64 default ints), the loop-dispatch model's logits, gradient and
  cached decoding equal the same calls without it: the float32 program is the same."""
  _, params, batch = moe_model
  config = moe_tiny(moe_dispatch="loop")
  tokens = batch["tokens"]

  def run():
    model, decoding = gj.transform(config), inference.make_decoding(config)
    logits = model.apply(params, tokens)
    grads = jax.grad(lambda p: model.loss(p, tokens).cross_entropy)(params)
    step_logits, cache = decoding.prefill(params, tokens[:, :8], jnp.array([5, 8]),
                                          cache_length=16)
    step_logits, _ = decoding.extend(params, tokens[:, 8:], cache, jnp.array([2, 4]))
    return logits, grads, step_logits

  expected = run()
  with jax.enable_x64(True):
    got = run()
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_train_step_adds_and_logs_the_aux_losses_and_expert_load(moe_model):
  model, params, batch = moe_model
  tx = optax.sgd(1.0)
  state = steps.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.random.key(0))
  train_step = steps.make_train_step(steps.model_forward(model), tx, lambda _: 1.0)
  new_state, metrics = jax.jit(train_step)(state, batch)
  _, aux = model.apply(params, batch["tokens"], return_aux=True)

  def objective(p):     # mean next-token cross-entropy + the weighted auxiliary losses
    logits, aux = model.apply(p, batch["tokens"], return_aux=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + sum(aux["losses"].values())

  expected = jax.tree.map(lambda p, g: p - g, params, jax.grad(objective)(params))
  chex.assert_trees_all_close(new_state.params, expected, atol=1e-5)
  router = ("blocks", "layer_0", "moe", "router", "proj", "kernel")
  without_aux = jax.grad(lambda p: objective(p) - sum(
      model.apply(p, batch["tokens"], return_aux=True)[1]["losses"].values()))(params)
  assert np.abs(flax.traverse_util.flatten_dict(expected)[router] - flax.traverse_util.flatten_dict(
      jax.tree.map(lambda p, g: p - g, params, without_aux))[router]).max() > 1e-6
  assert sorted(aux["losses"]) == ["load_balance_loss", "router_z_loss"]
  for name, value in aux["losses"].items():
    np.testing.assert_allclose(metrics[f"aux/{name}"], value, rtol=1e-6)
  loads = [float(metrics[f"aux/expert_load/{e}"]) for e in range(4)]
  np.testing.assert_allclose(loads, aux["expert_load"], rtol=1e-6)
  np.testing.assert_allclose(sum(loads), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_moe_config_trains_and_logs_aux_losses_and_expert_load(corpus, tmp_path):
  """configs/gemma3_tiny.py:gemma4-moe-tiny through experiments/train.py, shortened to 3
  steps."""
  workdir = tmp_path / "run"
  process = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"),
       f"--config={os.path.join(REPO, 'configs', 'gemma3_tiny.py')}:gemma4-moe-tiny", f"--workdir={workdir}",
       f"--config.data.path={corpus}", "--config.data.seq_len=32", "--config.train.steps=3",
       "--config.train.batch_size=8", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.train.progress_bar=False", "--config.model.num_layers=2",
       "--config.optimizer.warmup_steps=1", "--config.sample.max_new_tokens=0"],
      cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert process.returncode == 0, process.stderr
  records = metrics.read_records(str(workdir))
  assert [r["step"] for r in records] == [1, 2, 3]
  for record in records:
    assert record["aux/load_balance_loss"] > 0 and record["aux/router_z_loss"] > 0
    loads = [record[f"aux/expert_load/{e}"] for e in range(8)]
    np.testing.assert_allclose(sum(loads), 1.0, rtol=1e-5)
