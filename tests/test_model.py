"""The whole model: pure transforms, scan vs unrolled, remat policies, inputs."""

import re
from unittest import mock

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl.testing import parameterized

import gemma_jax as gj
from gemma_jax import decoder, remat, transformer
from gemma_jax.layers import attention, norms
from gemma_jax.layers.attention import CausalBlocks, CausalMask, LocalBlocks
from gemma_jax.models.families import FAMILIES
from gemma_jax.transformer import positions_from_segments
from jaxpr_shapes import shapes


def tiny(**overrides):
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           mlp_dim=48, num_layers=8, sliding_window=4))
  config.model.update(overrides)
  return config


def tokens(b=2, t=11, vocab=97, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (b, t)), jnp.int32)


def loss_fn(model, toks):
  def loss(params):
    logits = model.apply(params, toks)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(toks.shape[1]))
  return loss


class TransformTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_init_and_apply_shapes(self):
    model = gj.transform(tiny())
    toks = tokens()
    params = self.variant(model.init)(jax.random.key(0), toks)
    logits = self.variant(model.apply)(params, toks)
    chex.assert_shape(logits, (2, 11, 97))
    self.assertEqual(logits.dtype, jnp.float32)
    chex.assert_tree_all_finite(logits)
    # 8 layers, pattern of 6: one scanned block and two unscanned layers.
    self.assertEqual(sorted(params), ["blocks", "embed", "final_norm", "layers_6", "layers_7"])
    chex.assert_shape(params["blocks"]["layer_5"]["attn"]["q"]["kernel"], (1, 32, 4, 8))

  def test_pure_under_grad_and_vmap(self):
    model = gj.transform(tiny())
    toks = tokens()
    params = model.init(jax.random.key(0), toks)
    grads = jax.jit(jax.grad(loss_fn(model, toks)))(params)
    chex.assert_trees_all_equal_shapes(grads, params)
    self.assertGreater(float(jnp.abs(grads["embed"]["embedding"]).sum()), 0.0)
    per_row = jax.vmap(lambda t: model.apply(params, t[None])[0])(toks)
    np.testing.assert_allclose(per_row, model.apply(params, toks), rtol=1e-5, atol=1e-5)

  def test_every_parameter_has_logical_axes(self):
    config = tiny()
    module = decoder.Decoder(ml_collections.FrozenConfigDict(config.model))
    boxed = jax.eval_shape(module.init, jax.random.key(0), tokens(), tokens(),
                           jnp.ones((2, 11), jnp.int32))
    for path, leaf in flax.traverse_util.flatten_dict(boxed["params"]).items():
      assert isinstance(leaf, nn.LogicallyPartitioned), path
      assert len(leaf.names) == leaf.value.ndim, path
      if path[0] == "blocks":
        assert leaf.names[0] == "layers", path


class ScanTest(parameterized.TestCase):

  @parameterized.parameters("full", "none")
  def test_scanned_equals_unrolled_logits_and_grads(self, scan_unroll):
    scanned = tiny(num_layers=13, scan_unroll=scan_unroll)
    unrolled = tiny(num_layers=13, scan_layers=False)
    toks = tokens()
    params = gj.transform(scanned).init(jax.random.key(0), toks)
    flat = decoder.unstack_layers(params, scanned.model)
    self.assertEqual(len([k for k in flat if k.startswith("layers_")]), 13)
    m_scan, m_unroll = gj.transform(scanned), gj.transform(unrolled)
    np.testing.assert_allclose(m_scan.apply(params, toks), m_unroll.apply(flat, toks),
                               rtol=1e-5, atol=1e-5)
    g_scan = decoder.unstack_layers(jax.grad(loss_fn(m_scan, toks))(params), scanned.model)
    g_unroll = jax.grad(loss_fn(m_unroll, toks))(flat)
    chex.assert_trees_all_close(g_scan, g_unroll, rtol=1e-4, atol=1e-4)

  @parameterized.parameters((13, "auto", "none", False), (13, "auto", "full", True),
                            (13, "full", "full", False), (13, "none", "none", True),
                            (6, "auto", "none", False), (6, "none", "none", True))
  def test_scan_unroll_decides_the_loop(self, layers, scan_unroll, policy, loops):
    """Only a rolled scan lowers to a while loop, even of one block (6 layers); "auto"
    rolls it exactly under remat."""
    config = tiny(num_layers=layers, scan_unroll=scan_unroll, remat_policy=policy)
    self.assertEqual(decoder.scan_unrolled(config.model), not loops)
    model, toks = gj.transform(config), tokens()
    params = model.init(jax.random.key(0), toks)
    hlo = jax.jit(jax.grad(loss_fn(model, toks))).lower(params).as_text()
    self.assertEqual("stablehlo.while" in hlo, loops)

  def test_stack_inverts_unstack(self):
    config = tiny(num_layers=13)
    params = gj.transform(config).init(jax.random.key(0), tokens())
    again = decoder.stack_layers(decoder.unstack_layers(params, config.model), config.model)
    chex.assert_trees_all_equal(again, params)


@pytest.fixture(scope="module")
def remat_reference():
  """Loss and grads without remat on 7 layers: one scanned block and one unscanned layer."""
  toks = tokens()
  model = gj.transform(tiny(num_layers=7))
  params = model.init(jax.random.key(0), toks)
  return toks, params, jax.jit(jax.value_and_grad(loss_fn(model, toks)))(params)


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(p for p in remat.POLICIES if p != "none"))
@pytest.mark.parametrize("scan_unroll", ["auto", "full"])
def test_remat_policy_keeps_loss_and_grads(policy, scan_unroll, remat_reference):
  toks, params, (loss, grads) = remat_reference
  model = gj.transform(tiny(num_layers=7, remat_policy=policy, scan_unroll=scan_unroll))
  remat_loss, remat_grads = jax.jit(jax.value_and_grad(loss_fn(model, toks)))(params)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  chex.assert_trees_all_close(remat_grads, grads, rtol=1e-4, atol=1e-5)


# Every other block type: its layers (scanned periods and the layers after them) tag
# the projections a policy names, and a remat run keeps the loss and gradients of the
# same layers without remat. (gemma3-tiny's layers are swept over every policy above.)
OTHER_BLOCKS = {"gemma4-tiny": 7, "gemma4-moe-tiny": 7, "gemma4-e2b-tiny": 10, "gpt3-52k": 3,
                "parallel-tiny": 3}


@pytest.fixture(scope="module", params=sorted(OTHER_BLOCKS))
def block_reference(request):
  """(preset, tokens, params, loss and grads without remat) of a small stack."""
  config = gj.get_config(request.param)
  config.model.num_layers = OTHER_BLOCKS[request.param]
  toks = tokens(vocab=config.model.vocab_size)
  model = gj.transform(config)
  params = model.init(jax.random.key(0), toks)
  return (request.param, toks, params,
          jax.jit(jax.value_and_grad(loss_fn(model, toks)))(params))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "minimal", "save_dot_except_mlp"])
def test_every_block_type_keeps_loss_and_grads_under_remat(policy, block_reference):
  preset, toks, params, (loss, grads) = block_reference
  config = gj.get_config(preset)
  config.model.update(num_layers=OTHER_BLOCKS[preset], remat_policy=policy)
  model = gj.transform(config)
  step = jax.jit(jax.value_and_grad(loss_fn(model, toks)))
  tagged = set(re.findall(r"name=(\w+)", str(jax.make_jaxpr(step)(params))))
  names = set(remat.QKV + ("out_proj",) + remat.MLP)
  if preset == "gpt3-52k":    # one input projection: no gate
    names.remove("mlpwi_1")
  assert names <= tagged, names - tagged
  remat_loss, remat_grads = step(params)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  # Within 1e-4 of each leaf's largest entry: remat recomputes in other fusions, and the
  # MoE's routing and deeper sums carry that float32 reassociation further (up to 5e-5 of
  # a leaf's scale measured; a wrong residual would be off by its whole size). A 1-entry
  # leaf (Gemma 4's layer_scalar) is one sum over every activation of its layer, whose
  # terms cancel: within 1e-3 of it (1.8e-4 measured on one Xeon under the suite's -O0
  # flags, 3e-5 at -O2; today's main failed there at 1e-4).
  jax.tree.map(lambda got, want: np.testing.assert_allclose(
      got, want, rtol=0, atol=(1e-3 if want.size == 1 else 1e-4)
      * max(float(np.abs(want).max()), 1e-2)), remat_grads, grads)


@pytest.mark.slow
@pytest.mark.parametrize("policy, scan_unroll", [("none", "auto"), ("full", "full")])
def test_norm_gradient_kernel_keeps_loss_and_grads(policy, scan_unroll, remat_reference):
  """Every norm's gradient as the Pallas kernel (a single GPU's path; here in Pallas's
  interpreter), in the layers' scan and under remat, against XLA's gradients."""
  toks, params, (loss, grads) = remat_reference
  model = gj.transform(tiny(num_layers=7, remat_policy=policy, scan_unroll=scan_unroll))
  step = jax.jit(jax.value_and_grad(loss_fn(model, toks)))
  with mock.patch.object(norms, "uses_gradient_kernel", return_value=True):
    assert "pallas_call" in str(jax.make_jaxpr(step)(params))
    kernel_loss, kernel_grads = step(params)
  np.testing.assert_allclose(kernel_loss, loss, rtol=1e-6)
  chex.assert_trees_all_close(kernel_grads, grads, rtol=1e-4, atol=1e-5)


class InputsTest(chex.TestCase):

  def test_positions_restart_per_segment(self):
    segments = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    np.testing.assert_array_equal(positions_from_segments(segments),
                                  [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])

  def test_dropout_needs_rng_and_is_seeded(self):
    model = gj.transform(tiny(dropout_rate=0.5))
    toks = tokens()
    params = model.init(jax.random.key(0), toks)
    a = model.apply(params, toks, rng=jax.random.key(1))
    b = model.apply(params, toks, rng=jax.random.key(1))
    c = model.apply(params, toks, rng=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    self.assertGreater(float(jnp.abs(a - c).max()), 1e-3)
    self.assertGreater(float(jnp.abs(a - model.apply(params, toks)).max()), 1e-3)

  def test_bad_inputs_raise_named_errors(self):
    model = gj.transform(tiny())
    toks = tokens()
    params = model.init(jax.random.key(0), toks)
    with pytest.raises(ValueError, match=r"tokens\[1, 3\] = 97 is outside the vocabulary"):
      model.apply(params, toks.at[1, 3].set(97))
    with pytest.raises(ValueError, match="integer token ids"):
      model.apply(params, toks.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
      model.apply(params, toks[0])
    with pytest.raises(ValueError, match="segment_ids must have the shape"):
      model.apply(params, toks, segment_ids=jnp.ones((2, 5), jnp.int32))
    # Float positions or segment ids are named (they had failed inside an embedding
    # lookup, or been compared as floats); nested lists are read as arrays (they had
    # raised AttributeError).
    for name in ("positions", "segment_ids"):
      with pytest.raises(ValueError, match=f"{name} must hold integers, got dtype float32"):
        model.apply(params, toks, **{name: jnp.ones(toks.shape, jnp.float32)})
    np.testing.assert_array_equal(model.apply(params, np.asarray(toks).tolist()),
                                  model.apply(params, toks))


def test_positions_past_the_learned_table_raise_named_errors():
  """A learned table of 16 positions: 20 tokens in one document (default positions 0..19)
  or explicit positions 16 or -1 raise naming the field; two documents of 10 restart at 0 and
  each gives the logits it gives alone."""
  config = gj.get_config("gpt3-52k")
  config.model.update(vocab_size=97, trainable_position_size=16)
  config.data.seq_len = 16
  model = gj.transform(config)
  toks = tokens(t=20)
  message = r"positions span \[{}, {}\], outside .*config.model.trainable_position_size=16\)"
  with pytest.raises(ValueError, match=message.format(0, 19)):
    model.init(jax.random.key(0), toks)
  params = model.init(jax.random.key(0), toks[:, :16])
  with pytest.raises(ValueError, match=message.format(0, 19)):
    model.apply(params, toks)
  for first in (1, -1):
    with pytest.raises(ValueError, match=message.format(first, first + 15)):
      model.apply(params, toks[:, :16],
                  positions=jnp.broadcast_to(jnp.arange(first, first + 16), (2, 16)))
  packed = model.apply(params, toks, segment_ids=jnp.asarray([[1] * 10 + [2] * 10] * 2))
  np.testing.assert_allclose(packed[:, :10], model.apply(params, toks[:, :10]), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(packed[:, 10:], model.apply(params, toks[:, 10:]), rtol=1e-5,
                             atol=1e-5)


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def _has_matmul(jaxpr) -> bool:
  return any(eqn.primitive.name == "dot_general" or any(map(_has_matmul, _sub_jaxprs(eqn)))
             for eqn in jaxpr.eqns)


def _layer_calls(fn, *args) -> list:
  """The jaxprs of the nested jit calls in fn's trace that hold a matmul but no such
  call (the layers under `nn.jit`; jnp's own jitted helpers hold none), one per call."""
  calls = []

  def walk(jaxpr) -> bool:   # whether jaxpr holds a call counted here
    found = False
    for eqn in jaxpr.eqns:
      inner = [walk(sub) for sub in _sub_jaxprs(eqn)]
      if eqn.primitive.name in ("jit", "pjit") and not any(inner) and _has_matmul(
          eqn.params["jaxpr"].jaxpr):
        calls.append(eqn.params["jaxpr"])
        inner.append(True)
      found = found or any(inner)
    return found
  walk(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr)   # a new function: no cached trace
  return calls


@pytest.mark.slow
def test_layers_of_one_kind_are_traced_once():
  """Lowering traces one layer per attention type: 8 unscanned layers (7 local, 1
  global) are 8 calls of 2 traces. Under a method interceptor, whose effect may depend on
  a layer's path, each layer is traced in place; the compiled logits are the same to
  the bit."""
  config = tiny(scan_layers=False)
  toks = tokens()
  params = gj.transform(config).init(jax.random.key(0), toks)
  positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  module = transformer.decoder_module(config)
  apply = lambda p: module.apply(p, toks, positions, jnp.ones_like(toks))
  calls = _layer_calls(apply, {"params": params})
  assert len(calls) == 8 and len({id(c) for c in calls}) == 2
  with nn.intercept_methods(lambda fun, args, kwargs, context: fun(*args, **kwargs)):
    assert _layer_calls(apply, {"params": params}) == []
    want = jax.jit(lambda p: apply(p))({"params": params})
  np.testing.assert_array_equal(jax.jit(lambda p: apply(p))({"params": params}), want)
  _, state = transformer.decoder_module(config).apply(
      {"params": params}, toks, positions, jnp.ones_like(toks),
      capture_intermediates=lambda module, method: module.name == "layers_3")
  assert list(state["intermediates"]) == ["layers_3"]   # a path-dependent capture too


@pytest.mark.slow
def test_random_draws_do_not_depend_on_trace_sharing():
  """nn.jit forks the keys of the layers it wraps, so layers that draw random numbers
  (init, dropout) never share traces: a seed draws the same parameters and dropout masks
  as with sharing off (under a no-op interceptor), scanned or not. Each call transforms
  afresh: a jitted apply keeps its first trace, interceptor or not."""
  noop = lambda fun, args, kwargs, context: fun(*args, **kwargs)
  for scan_layers in (True, False):
    config = tiny(scan_layers=scan_layers, dropout_rate=0.5)
    init = lambda: gj.transform(config).init(jax.random.key(0), tokens())
    params = init()
    dropped = lambda: gj.transform(config).apply(params, tokens(), rng=jax.random.key(1))
    with nn.intercept_methods(noop):
      chex.assert_trees_all_equal(params, init())
      want = dropped()
    assert np.abs(want - gj.transform(config).apply(params, tokens())).max() > 0.1
    np.testing.assert_array_equal(dropped(), want)


def test_long_rows_run_local_layers_in_window_blocks():
  """Local layers take blocked masks (T x 1.5W work) once T > 2W, and the dense mask for
  shorter rows or image spans; the logits agree with the dense masks given explicitly."""
  config = tiny(num_layers=2, attention_pattern=("local", "global"))
  m = config.model
  segments = jnp.ones((2, 11), jnp.int32)
  assert isinstance(decoder.layer_masks(m, segments, blocked=True)["local"], LocalBlocks)
  assert not isinstance(decoder.layer_masks(m, segments[:, :8], blocked=True)["local"],
                        LocalBlocks)
  assert not isinstance(decoder.layer_masks(m, segments, segments, blocked=True)["local"],
                        LocalBlocks)
  assert_blocked_logits_match_dense(config, tokens(), segments)


def test_fused_kernel_takes_causal_masks_with_their_structure():
  """For cuDNN's fused kernel (the "jax" kernel on a GPU), causal layers take
  `CausalMask`: the dense mask with the window (local layers) or none (global); image
  spans keep the plain mask. Run by the "jax" kernel (XLA's on the CPU), the logits agree
  with the dense masks', packed documents included. For XLA's implementation (float32,
  or off a GPU) the blocks stay."""
  config = tiny(num_layers=2, attention_pattern=("local", "global"), attention_kernel="jax")
  m = config.model
  segments = jnp.asarray([[1] * 6 + [2] * 5, [1] * 11])
  masks = decoder.layer_masks(m, segments, blocked=True, fused=True)
  dense = decoder.layer_masks(m, segments)
  assert isinstance(masks["local"], CausalMask) and masks["local"].window == m.sliding_window
  assert isinstance(masks["global"], CausalMask) and masks["global"].window is None
  for kind in ("local", "global"):
    np.testing.assert_array_equal(masks[kind].mask, dense[kind])
  assert not isinstance(
      decoder.layer_masks(m, segments, segments, blocked=True, fused=True)["local"], CausalMask)
  assert not decoder.fused_attention(m, "local")       # float32: XLA's on any backend
  assert isinstance(decoder.layer_masks(m, segments, blocked=True)["local"], LocalBlocks)
  toks = tokens()
  params = gj.transform(config).init(jax.random.key(0), toks)
  module = decoder.Decoder(m)
  positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  fused = module.apply({"params": params}, toks, positions, segments, masks=masks)
  expected = module.apply({"params": params}, toks, positions, segments, masks=dense)
  np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rows_of_one_document_reach_the_fused_kernel_as_structure_alone():
  """Without segment_ids (one document per row) cuDNN's fused kernel gets each causal
  layer's mask by its structure alone, no [B, T, T] array: `CausalMask(None, window)`.
  Through the public `loss` (odd T, as a train step's inputs are), run by the "jax"
  kernel as on a GPU (XLA's implementation here), the loss and its gradients equal the
  einsum kernel's under the dense masks."""
  config = tiny(num_layers=2, attention_pattern=("local", "global"), attention_kernel="jax")
  m = config.model
  toks = tokens(t=12)
  ones = jnp.ones_like(toks)
  masks = decoder.layer_masks(m, ones, blocked=True, fused=True, packed=False)
  assert masks["local"] == CausalMask(None, m.sliding_window), masks["local"]
  assert masks["global"] == CausalMask(None, None), masks["global"]
  params = gj.transform(config).init(jax.random.key(0), toks)
  handed = []
  fused = jax.nn.dot_product_attention

  def recorded(q, k, v, *args, mask=None, **kwargs):
    handed.append((q.shape[1], mask is None, kwargs["is_causal"]))
    return fused(q, k, v, *args, mask=mask, **kwargs)

  def value_and_grads(model, **kwargs):
    objective = lambda p: (lambda s: s.cross_entropy / s.weight)(
        model.loss(p, toks[:, :-1], toks[:, 1:], **kwargs))
    return jax.value_and_grad(objective)(params)

  with mock.patch.object(decoder, "fused_attention", lambda c, kind: True), \
       mock.patch.object(jax.nn, "dot_product_attention", recorded):
    value, grads = value_and_grads(gj.transform(config))
  t = toks.shape[1] - 1
  assert t % 2 and handed and set(handed) == {(t + 1, True, True)}, handed
  config.model.attention_kernel = "einsum"
  expected, expected_grads = value_and_grads(gj.transform(config),
                                             segment_ids=ones[:, :-1])
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  chex.assert_trees_all_close(grads, expected_grads, rtol=1e-4, atol=1e-5)


def test_heads_too_wide_for_cudnn_take_their_mask_in_blocks():
  """On a GPU whose cuDNN takes the local layers' heads but not the wider global ones
  (Gemma 4's 512 on Hopper; Gemma 3's 256 before it), only the local layers get
  `CausalMask`: the global ones run XLA's attention, which computes every logit it is
  given, so they take `CausalBlocks` and skip the causal mask's upper triangle. The
  decoder's output under that mix equals the dense masks' (einsum kernel)."""
  config = tiny(num_layers=2, attention_pattern=("local", "global"), global_head_dim=16,
                attention_kernel="jax", dtype="bfloat16")
  m = config.model
  toks = tokens(b=1, t=512)
  segments = jnp.ones_like(toks)
  with mock.patch.object(jax, "default_backend", return_value="gpu"), \
      mock.patch.object(attention, "cudnn_head_dim_limit", return_value=8):
    assert decoder.fused_attention(m, "local") and not decoder.fused_attention(m, "global")
    masks = decoder.layer_masks(m, segments, blocked=True, packed=False)
    packed = decoder.layer_masks(m, segments, blocked=True)
  assert masks["local"] == CausalMask(None, m.sliding_window), masks["local"]
  assert isinstance(masks["global"], CausalBlocks) and isinstance(packed["global"], CausalBlocks)
  assert isinstance(packed["local"], CausalMask) and packed["local"].mask is not None
  m.dtype = "float32"
  params = gj.transform(config).init(jax.random.key(0), toks)
  positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  run = lambda model, masks: decoder.Decoder(model).apply(
      {"params": params}, toks, positions, segments, masks=masks)
  mixed = run(m, masks)
  m.attention_kernel = "einsum"
  expected = run(m, decoder.layer_masks(m, segments))
  np.testing.assert_allclose(mixed, expected, rtol=1e-5, atol=1e-5)


def assert_blocked_logits_match_dense(config, toks, segments):
  """The decoder's logits with the masks it builds itself (blocked where that saves
  work) against the dense masks given explicitly."""
  params = gj.transform(config).init(jax.random.key(0), toks)
  module = decoder.Decoder(config.model)
  positions = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  blocked = module.apply({"params": params}, toks, positions, segments)
  dense = module.apply({"params": params}, toks, positions, segments,
                       masks=decoder.layer_masks(config.model, segments))
  np.testing.assert_allclose(blocked, dense, rtol=1e-5, atol=1e-5)


def test_long_rows_run_causal_layers_in_causal_blocks():
  """Causal layers take `CausalBlocks` once T holds two blocks (512 tokens), the dense
  mask for shorter rows or image spans; the logits agree with the dense masks given
  explicitly, packed documents included."""
  config = tiny(num_layers=2, attention_pattern=("local", "global"), sliding_window=300)
  m = config.model
  segments = jnp.asarray(np.repeat([[1] * 300 + [2] * 220], 2, axis=0), jnp.int32)
  masks = decoder.layer_masks(m, segments, blocked=True)
  assert isinstance(masks["global"], CausalBlocks)
  assert isinstance(masks["local"], CausalBlocks)        # T <= 2W: no window blocks
  assert not isinstance(decoder.layer_masks(m, segments[:, :511], blocked=True)["global"],
                        CausalBlocks)
  assert not isinstance(decoder.layer_masks(m, segments, segments, blocked=True)["global"],
                        CausalBlocks)
  assert_blocked_logits_match_dense(config, tokens(t=520), segments)


def test_vision_model_without_images_keeps_blocked_local_attention():
  """A vision model's text-only rows of 11 > 2 x 4 tokens through local layers: no value
  is T x T (the dense mask or its logits), some are blocks of W / 2 queries over 1.5W
  keys, and the logits are the dense masks' given explicitly."""
  config = gj.get_config("gemma3-tiny-vision")
  config.model.update(dict(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
                           num_layers=2, attention_pattern=("local",), sliding_window=4))
  model = gj.transform(config)
  toks = tokens(t=11, vocab=500)   # no image ids (508 to 511)
  params = model.init(jax.random.key(0), toks)
  computed = list(shapes(jax.make_jaxpr(model.apply)(params, toks).jaxpr))
  assert not [s for s in computed if s[-2:] == (11, 11)]
  assert [s for s in computed if s[-2:] == (2, 6)]
  segments = jnp.ones_like(toks)
  dense = decoder.Decoder(config.model).apply(
      {"params": params}, toks, jnp.broadcast_to(jnp.arange(11), (2, 11)), segments,
      masks=decoder.layer_masks(config.model, segments))
  np.testing.assert_allclose(model.apply(params, toks), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_type", ["gemma3", "gpt3"])
def test_dropout_mask_is_shared_along_the_length(block_type):
  """A layer's output dropout drops the same features at every position of a row and
  scales what it keeps by 1 / (1 - rate)."""
  config = tiny(dropout_rate=0.5, block_type=block_type)
  layer = FAMILIES[block_type].layer(config.model, "global", deterministic=False)
  x = jax.random.normal(jax.random.key(0), (2, 7, 32))
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  masks = decoder.layer_masks(config.model, jnp.ones((2, 7), jnp.int32))
  params = layer.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x,
                      positions, masks)
  kept = layer.clone(deterministic=True).apply(params, x, positions, masks)
  dropped = layer.apply(params, x, positions, masks, rngs={"dropout": jax.random.key(3)})
  zero = np.asarray(dropped == 0)
  assert 0.2 < zero.mean() < 0.8
  np.testing.assert_array_equal(zero, np.broadcast_to(zero[:, :1], zero.shape))
  np.testing.assert_allclose(np.where(zero, 0, kept * 2), dropped, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma3-tiny", "gpt3-52k"])
def test_jax_attention_kernel_matches_einsum(preset):
  """attention_kernel="jax" (jax.nn.dot_product_attention; XLA's on the CPU) gives the
  einsum kernel's logits and gradients, blocked local layers and packed rows included."""
  if preset == "gpt3-52k":
    config = gj.get_config(preset)
    config.model.update(vocab_size=97, num_layers=2)
  else:
    config = tiny(num_layers=2, attention_pattern=("local", "global"))
  toks = tokens(t=11)
  segments = jnp.asarray([[1] * 6 + [2] * 5, [1] * 11])
  params = gj.transform(config).init(jax.random.key(0), toks)
  results = {}
  for kernel in ("einsum", "jax"):
    config.model.attention_kernel = kernel
    model = gj.transform(config)
    loss = lambda p, model=model: jnp.mean(model.apply(p, toks, segment_ids=segments) ** 2)
    results[kernel] = jax.value_and_grad(loss)(params)
  chex.assert_trees_all_close(results["jax"], results["einsum"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gemma3-tiny", "gemma4-tiny", "gemma4-moe-tiny",
                                    "gpt3-52k", "parallel-tiny"])
def test_every_family_runs_alike_with_64_bit_types_enabled(preset):
  """A user's process with `jax_enable_x64` on (and so int64 token ids): every family's
  parameters, loss and gradients stay float32 and equal those of a 32-bit process."""
  config = gj.get_config(preset)
  config.model.num_layers = min(2, config.model.num_layers)   # two layers: the same code
  ids = np.random.RandomState(0).randint(0, config.model.vocab_size, (2, 12))

  def run():
    toks = jnp.asarray(ids)
    model = gj.transform(config)
    params = model.init(jax.random.key(0), toks)
    loss = lambda p: model.loss(p, toks).cross_entropy
    return toks.dtype, params, jax.value_and_grad(loss)(params)

  dtype32, params32, expected = run()
  with jax.enable_x64(True):
    dtype64, params64, got = run()
  assert (dtype32, dtype64) == (jnp.int32, jnp.int64)
  assert {x.dtype for x in jax.tree.leaves((params64, got))} == {jnp.dtype(jnp.float32)}
  chex.assert_trees_all_close(params64, params32)
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
