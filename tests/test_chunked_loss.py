"""The chunked tied-logits cross-entropy against a dense float64 computation, and the
model's `loss` against optax over `apply`'s logits."""

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gemma_jax as gj
from gemma_jax.layers import chunked_loss
from gemma_jax.training import data

B, T, D, V = 2, 13, 16, 40


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(B, T, D)).astype(np.float32)
  table = (rng.normal(size=(V, D)) * 0.5).astype(np.float32)
  targets = rng.integers(0, V, (B, T)).astype(np.int32)
  weights = (rng.random((B, T)) > 0.3).astype(np.float32) * rng.uniform(0.5, 2, (B, T))
  return hidden, table, targets, weights.astype(np.float32)


def _objective(sums):
  """A combination that gives every output its own gradient weight."""
  return 0.7 * sums.cross_entropy + 0.2 * sums.z_loss + 0.1 * sums.weight


def _dense_float64(hidden, table, targets, weights, cap):
  """The same sums from whole float64 logits, differentiated by autodiff."""
  def sums(hidden, table, weights):
    logits = hidden @ table.T
    if cap is not None:
      logits = cap * jnp.tanh(logits / cap)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return chunked_loss.TokenLosses(jnp.sum(weights * (log_z - target)),
                                    jnp.sum(weights * log_z ** 2), jnp.sum(weights))
  with jax.enable_x64(True):
    args = [jnp.asarray(a, jnp.float64) for a in (hidden, table, weights)]
    value, grads = jax.value_and_grad(lambda *a: _objective(sums(*a)), argnums=(0, 1, 2))(*args)
    return float(value), [np.asarray(g) for g in grads], [float(s) for s in sums(*args)]


@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("chunk,table_sum", [   # 4 does not divide T: the last chunk padded
    (1, "platform"), (4, "platform"), (T, "platform"), (1, "off_cpu"), (4, "off_cpu")])
def test_chunked_sums_and_gradients_match_float64(cap, chunk, table_sum, monkeypatch):
  """"off_cpu": the chunks as off a CPU, the table gradient summed as [V, D] (a CPU sums
  it transposed) and log_z in one pass; one chunk (T) is the plain computation, with no
  sum to lay out."""
  if table_sum == "off_cpu":
    monkeypatch.setattr(chunked_loss, "_scan_with_table_gradient",
                        lambda *a: chunked_loss._scan_chunks(*a, on_cpu=False))
  hidden, table, targets, weights = _inputs()
  logits_bytes = 4 * B * V * chunk
  assert chunked_loss.chunk_length(B, T, V, logits_bytes) == chunk

  @jax.jit
  def run(hidden, table, weights):
    def objective(hidden, table, weights):
      sums = chunked_loss.token_losses(hidden, table, targets, weights, logit_softcap=cap,
                                       logits_bytes=logits_bytes)
      return _objective(sums), sums
    return jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
        hidden, table, weights)

  (value, sums), grads = run(hidden, table, weights)
  want_value, want_grads, want_sums = _dense_float64(hidden, table, targets, weights, cap)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose([float(s) for s in sums], want_sums, rtol=1e-5)
  for got, want, name in zip(grads, want_grads, ("hidden", "table", "weights")):
    chex.assert_shape(got, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_one_pass_logsumexp_matches_float64(scale):
  """Rows of 50,000 logits at several scales (the larger ones far past exp's float32
  range without a shift), a row with one dominant entry, and a constant row."""
  rng = np.random.default_rng(3)
  x = (rng.normal(size=(3, 4, 50_000)) * scale).astype(np.float32)
  x[0, 0, 123] = 500.0 * scale
  x[0, 1] = -7.0
  got = jax.jit(chunked_loss.one_pass_logsumexp)(x)
  x64 = x.astype(np.float64)
  top = x64.max(-1, keepdims=True)
  want = (np.log(np.exp(x64 - top).sum(-1, keepdims=True)) + top)[..., 0]
  chex.assert_shape(got, (3, 4))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-5)


def test_chunks_hold_at_least_2048_rows_and_even_out():
  """Every chunk adds into the float32 [V, D] table gradient: by default a chunk holds
  at least 2048 positions over the batch (256 MiB of logits at the least), and the
  chunks share T evenly."""
  # gemma3-1b, 4 x 2048: 2 GiB of logits hold 512 positions of 4 rows, so 4 chunks of
  # 512, where 256 MiB alone gave 32 chunks of 64.
  assert chunked_loss.chunk_length(4, 2048, 262144) == 512
  assert chunked_loss.chunk_length(4, 2048, 262144, 1 << 28) == 64
  assert chunked_loss.chunk_length(4, 2047, 262144) == 512                        # 1 padded
  assert chunked_loss.chunk_length(4, 2047, 262144, 4 * 4 * 262144 * 300) == 293  # 7 x 293
  assert chunked_loss.chunk_length(8, 2048, 262144) == 256
  assert chunked_loss.chunk_length(1, 4095, 262144) == 2048                       # 2 chunks
  assert chunked_loss.chunk_length(1, 2048, 262144) == 2048                       # whole
  assert chunked_loss.chunk_length(1, 100, 1000) == 100      # 256 MiB: one chunk
  assert chunked_loss.chunk_length(2, 0, 1000) == 0
  for t in range(1, 60):
    for longest in range(1, t + 1):
      c = chunked_loss.chunk_length(1, t, 1, 4 * longest)
      chunks = -(-t // c)
      assert c <= longest and chunks == -(-t // longest) and chunks * c - t < chunks


def _scan_lengths(fn, *args):
  """The lengths of the scans in fn's jaxpr, nested ones included."""
  lengths = []
  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "scan":
        lengths.append(eqn.params["length"])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)
  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return lengths


@pytest.mark.parametrize("frozen", [False, True])
def test_chunks_take_the_row_floor_only_where_the_table_is_trained(frozen, monkeypatch):
  """Small floors stand in for Gemma's: without the table gradient (evaluation, a frozen
  table) chunks hold 3 positions of 2 rows, with it 7 (`MIN_ROWS` 14); either way the
  sums and gradients are float64's."""
  monkeypatch.setattr(chunked_loss, "MIN_LOGITS_BYTES", 4 * B * V * 3)
  monkeypatch.setattr(chunked_loss, "MIN_ROWS", 2 * 7)
  assert chunked_loss.chunk_length(B, T, V, table_gradient=False) == 3    # 5 chunks
  assert chunked_loss.chunk_length(B, T, V) == 7                          # 2 chunks
  hidden, table, targets, weights = _inputs()

  def objective(hidden, table, weights):
    return _objective(chunked_loss.token_losses(hidden, table, targets, weights))

  argnums = (0, 2) if frozen else (0, 1, 2)
  grad = jax.value_and_grad(objective, argnums=argnums)
  assert _scan_lengths(objective, hidden, table, weights) == [5]
  # The forward pass and the z-loss's backward, each traced for the CPU and elsewhere.
  assert _scan_lengths(grad, hidden, table, weights) == [5 if frozen else 2] * 4
  value, grads = jax.jit(grad)(hidden, table, weights)
  want_value, want_grads, _ = _dense_float64(hidden, table, targets, weights, None)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for got, i in zip(grads, argnums):
    np.testing.assert_allclose(got, want_grads[i], rtol=1e-4, atol=1e-5)


def test_chunked_loss_never_forms_the_whole_logits():
  b, t, d, v = 2, 512, 32, 16384      # whole float32 logits: 64 MiB
  hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  table = jax.ShapeDtypeStruct((v, d), jnp.float32)
  targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
  weights = jax.ShapeDtypeStruct((b, t), jnp.float32)

  def temp_bytes(logits_bytes):
    grad = jax.grad(lambda h, e, y, w: chunked_loss.token_losses(
        h, e, y, w, logits_bytes=logits_bytes).cross_entropy, argnums=(0, 1))
    return jax.jit(grad).lower(hidden, table, targets, weights).compile(
        ).memory_analysis().temp_size_in_bytes

  whole = 4 * b * t * v
  assert temp_bytes(whole) >= whole                 # one chunk: the logits are formed
  assert temp_bytes(whole // 16) < whole // 4       # 16 chunks of 4 MiB


@pytest.fixture(scope="module", params=["gemma3-tiny", "gemma4-tiny"])
def model_case(request):
  config = gj.get_config(request.param)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, config.model.vocab_size, (2, 17)), jnp.int32)
  weights = jnp.asarray(rng.random((2, 16)) > 0.2, jnp.float32)
  params = gj.transform(config).init(jax.random.key(0), tokens)
  return config, tokens, weights, params


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [1, 4])
def test_model_loss_matches_optax_over_apply(model_case, chunks, monkeypatch):
  config, tokens, weights, params = model_case
  monkeypatch.setattr(chunked_loss, "LOGITS_BYTES",
                      4 * 2 * config.model.vocab_size * (-(-16 // chunks)))
  model = gj.transform(config)   # traced afresh under the patched chunk budget

  def reference(params):
    logits = model.apply(params, tokens[:, :-1])
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(weights * per_token)

  def ours(params):
    return model.loss(params, tokens[:, :-1], tokens[:, 1:], weights=weights).cross_entropy

  want, want_grads = jax.value_and_grad(reference)(params)
  got, grads = jax.value_and_grad(ours)(params)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
  chex.assert_trees_all_close(grads, want_grads, atol=1e-5 * scale, rtol=0)


def test_negative_targets_count_as_weight_zero(model_case):
  """transformers' -100 labels: positions that do not count."""
  config, tokens, weights, params = model_case
  model = gj.transform(config)
  targets = np.asarray(tokens[:, 1:])
  ignored = np.asarray(weights) == 0
  got = model.loss(params, tokens[:, :-1], jnp.asarray(np.where(ignored, -100, targets)))
  want = model.loss(params, tokens[:, :-1], tokens[:, 1:], weights=weights)
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  assert float(got.weight) == (~ignored).sum()


@pytest.mark.slow
def test_default_targets_are_each_rows_next_tokens(model_case):
  """model.loss(params, tokens): the next-token cross-entropy over the row's own length,
  against optax over `apply`'s logits of the same rows, the last position unscored."""
  config, tokens, _, params = model_case
  model = gj.transform(config)
  logits = model.apply(params, tokens)
  want = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  for ids in (tokens, tokens.astype(jnp.uint32)):      # unsigned ids: -1 stays negative
    got = model.loss(params, ids)
    np.testing.assert_allclose(got.cross_entropy, jnp.sum(want), rtol=1e-6)
    assert float(got.weight) == tokens.shape[0] * (tokens.shape[1] - 1)


def test_default_targets_of_packed_rows_stay_within_documents(model_case):
  """With segment_ids, the default targets are the data pipeline's (numpy, its own code):
  none across a document boundary or onto padding."""
  config, tokens, _, params = model_case
  segment_ids = np.array([[1] * 6 + [2] * 8 + [0] * 3, [1] * 10 + [2] * 7], np.int32)
  batch = data.make_batch(np.asarray(tokens), segment_ids)
  model = gj.transform(config)
  got = model.loss(params, tokens, segment_ids=jnp.asarray(segment_ids))
  want = model.loss(params, tokens, jnp.asarray(batch["targets"]),
                    weights=jnp.asarray(batch["weights"]), segment_ids=jnp.asarray(segment_ids))
  chex.assert_trees_all_close(got, want, rtol=1e-6)
  assert float(got.weight) == batch["weights"].sum() == 5 + 7 + 9 + 6


def test_model_loss_names_bad_targets(model_case):
  config, tokens, _, params = model_case
  model = gj.transform(config)
  with pytest.raises(ValueError, match=r"targets must have the shape of tokens"):
    model.loss(params, tokens[:, :-1], tokens)
  bad = tokens[:, 1:].at[1, 3].set(config.model.vocab_size)
  with pytest.raises(ValueError, match=r"targets\[1, 3\] = .* outside the vocabulary"):
    model.loss(params, tokens[:, :-1], bad)
