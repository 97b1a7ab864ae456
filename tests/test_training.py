"""Training: loss, optimizer, steps, FLOPs, and whole runs (resume, signals,
divergence, errors)."""

import errno
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import chex
import flax
import jax
from jax._src import dispatch  # the compile events' names
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gemma_jax as gj
from gemma_jax import transformer
from gemma_jax.layers import loss
from gemma_jax.text import tokenizers
from gemma_jax.training import (checkpoints, data, flops, loop, metrics, optimizer, steps,
                                workdir as workdir_lib)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = dict(vocab_size=262, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16,
                  mlp_dim=64, num_layers=2, attention_pattern=("local", "global"),
                  sliding_window=8)


def tiny_config(corpus_glob=None, **model):
  """A two-layer model on a small corpus: a whole run compiles in seconds."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(dict(TINY_MODEL, **model))
  config.data.path = corpus_glob
  config.data.seq_len = 32
  config.data.eval_fraction = 0.1
  # 8 rows: one per simulated device (tests/conftest.py) under the default data mesh.
  config.train.update(dict(steps=6, batch_size=8, log_every=1, eval_every=3, eval_batches=2,
                           progress_bar=False, peak_flops=1e9))
  config.optimizer.warmup_steps = 2
  config.checkpoint.update(dict(save_every=2, keep=2))
  config.sample.max_new_tokens = 0
  return config


def random_batch(b=4, t=16, seed=0):
  rng = np.random.default_rng(seed)
  segment_ids = np.sort(rng.integers(1, 4, (b, t)), axis=1)
  segment_ids[:, -3:] = 0
  return data.make_batch(rng.integers(3, 259, (b, t)).astype(np.int32), segment_ids)


# Loss.

def test_token_losses_match_optax_with_masking():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 5, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (2, 5)))
  weights = jnp.asarray(rng.integers(0, 2, (2, 5)), jnp.float32)
  sums = loss.token_losses(logits, targets, weights)
  per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  np.testing.assert_allclose(sums.cross_entropy, jnp.sum(per_token * weights), rtol=1e-6)
  log_z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(sums.z_loss, np.sum(log_z ** 2 * weights), rtol=1e-5)
  assert float(sums.weight) == float(weights.sum())


# Optimizer.

def test_schedule_warms_up_then_decays_to_its_end_value():
  config = gj.get_config("gemma3-tiny").optimizer
  config.update(dict(learning_rate=2e-3, warmup_steps=10, end_learning_rate_ratio=0.1))
  schedule = optimizer.learning_rate_schedule(config, total_steps=110)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
                             [0.0, 1e-3, 2e-3, 1.1e-3, 2e-4], rtol=1e-5)
  config.decay_steps = 210
  np.testing.assert_allclose(optimizer.learning_rate_schedule(config, 110)(110), 1.1e-3,
                             rtol=1e-5)


def test_weight_decay_skips_parameters_matching_no_decay():
  config = gj.get_config("gemma3-tiny").optimizer
  config.update(dict(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, no_decay=("norm",)))
  params = {"attn": {"q": {"kernel": jnp.ones(3)}}, "final_norm": {"scale": jnp.ones(3)}}
  tx = optimizer.make_optimizer(config, optimizer.learning_rate_schedule(config, 10))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(updates["attn"]["q"]["kernel"], -0.1 * 0.5)   # -lr * wd * p
  np.testing.assert_array_equal(updates["final_norm"]["scale"], 0.0)


def test_gradients_are_clipped_to_the_global_norm():
  config = gj.get_config("gemma3-tiny").optimizer
  config.update(dict(max_grad_norm=1.0, weight_decay=0.0, warmup_steps=0))
  clip = optimizer.make_optimizer(config, lambda _: 1.0)
  params = {"w": jnp.zeros(4)}
  grads = {"w": jnp.full(4, 10.0)}
  state = clip.init(params)
  _, state = clip.update(grads, state, params)
  mu = state[1][0].mu["w"]   # Adam's first moment saw the clipped gradient
  np.testing.assert_allclose(mu, (1 - config.b1) * grads["w"] / 20.0, rtol=1e-6)


# Steps.

@pytest.fixture(scope="module")
def sgd():
  """Plain SGD (lr 1), so a step changes the parameters by minus the gradient; the
  initial state of the tiny model; a batch; and the compiled plain step."""
  tx = optax.sgd(1.0)
  model = gj.transform(tiny_config())
  state = jax.jit(lambda: steps.init_state(model, tx, seed=0, seq_len=16))()
  make = lambda forward=steps.model_forward(model), **kwargs: jax.jit(
      steps.make_train_step(forward, tx, lambda _: 1.0, **kwargs))
  batch = random_batch(b=8)
  return dict(model=model, state=state, batch=batch, make=make,
              plain_result=make(z_loss=1e-3)(state, batch))


def test_grad_accumulation_equals_one_large_batch(sgd):
  new_one, metrics_one = sgd["plain_result"]
  new_four, metrics_four = sgd["make"](grad_accum_steps=4, z_loss=1e-3)(sgd["state"], sgd["batch"])
  chex.assert_trees_all_close(new_four.params, new_one.params, rtol=1e-5, atol=1e-6)
  for key in ("loss", "grad_norm", "z_loss", "target_tokens"):
    np.testing.assert_allclose(metrics_four[key], metrics_one[key], rtol=1e-5)


@pytest.mark.slow
def test_auxiliary_losses_are_added_to_the_objective(sgd):
  def forward_with_aux(params, batch, rng):
    sums, _, _ = steps.model_forward(sgd["model"])(params, batch, rng)
    return (sums, {"l2": 0.01 * jnp.sum(params["embed"]["embedding"] ** 2)},
            {"observed": jnp.sum(params["embed"]["embedding"])})

  state = sgd["state"]
  base, _ = sgd["plain_result"]
  new, step_metrics = sgd["make"](forward_with_aux, z_loss=1e-3)(state, sgd["batch"])
  embedding = state.params["embed"]["embedding"]
  np.testing.assert_allclose(step_metrics["aux/l2"], 0.01 * jnp.sum(embedding ** 2), rtol=1e-5)
  np.testing.assert_allclose(step_metrics["aux/observed"], jnp.sum(embedding), rtol=1e-5)
  np.testing.assert_allclose(base.params["embed"]["embedding"] - new.params["embed"]["embedding"],
                             0.02 * embedding, atol=1e-6)


def test_bfloat16_compute_keeps_float32_master_weights(sgd):
  bf16 = gj.transform(tiny_config(dtype="bfloat16"))
  new, step_metrics = sgd["make"](steps.model_forward(bf16), z_loss=1e-3)(sgd["state"],
                                                                           sgd["batch"])
  assert {leaf.dtype for leaf in jax.tree.leaves(new.params)} == {jnp.dtype(jnp.float32)}
  np.testing.assert_allclose(step_metrics["loss"], sgd["plain_result"][1]["loss"], rtol=2e-2)


# Reporting.

def test_matmul_flops_count_the_model_kernels():
  config = tiny_config().model
  shapes = jax.eval_shape(gj.transform(tiny_config()).init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, 8), jnp.int32))
  flat = flax.traverse_util.flatten_dict(shapes)
  kernels = sum(int(np.prod(v.shape)) for k, v in flat.items() if k[-1] == "kernel")
  assert flops.matmul_params(config) == kernels + config.vocab_size * config.d_model
  # Two layers: local sees min(window 8, T), global sees T.
  attention = 4 * 2 * 16 * (8 + 32)
  assert flops.training_flops_per_token(config, 32) == 3 * (2 * (kernels + 262 * 32) + attention)
  assert flops.measure_peak_flops(repeats=1) > 1e8


def test_a_lora_run_counts_no_weight_gradients_of_its_frozen_base():
  """Rank 4 on the default targets (q, k, v, out, gate, up, down) of both layers: the
  frozen base's matmuls cost forward and input gradient (4 a parameter), the adapters'
  A [in, 4] and B [4, out] forward and both gradients (6)."""
  config = tiny_config()
  config.lora.rank = 4
  d, nh, kh, f = 32, 2 * 16, 1 * 16, 64
  in_out = [(d, nh), (d, kh), (d, kh), (nh, d), (d, f), (d, f), (f, d)]
  adapters = 2 * 4 * sum(i + o for i, o in in_out)
  assert gj.lora.param_count(config) == adapters
  attention = 4 * 2 * 16 * (8 + 32)
  full = flops.training_flops_per_token(config.model, 32)
  tuned = flops.training_flops_per_token(config.model, 32, adapters)
  assert tuned == 4 * flops.matmul_params(config.model) + 6 * adapters + 3 * attention
  assert tuned < full


def test_unigram_entropy_of_known_distributions():
  batch = {"targets": np.asarray([[1, 2, 3, 4, 9]]), "weights": np.asarray([[1, 1, 1, 1, 0.]])}
  np.testing.assert_allclose(metrics.unigram_entropy([batch]), np.log(4))
  same = {"targets": np.full((2, 3), 7), "weights": np.ones((2, 3))}
  assert metrics.unigram_entropy([same]) == 0.0


# Whole runs.

@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
  """An uninterrupted run with dropout (so the RNG matters) and a sample at the end."""
  config = tiny_config(corpus, dropout_rate=0.1)
  config.sample.max_new_tokens = 8
  workdir = str(tmp_path_factory.mktemp("full"))
  return config, workdir, loop.train(config, workdir)


@pytest.mark.slow
def test_a_run_writes_metrics_events_checkpoints_plot_and_sample(full_run):
  config, workdir, summary = full_run
  records = metrics.read_records(workdir)
  assert [r["step"] for r in records] == list(range(1, 7))
  for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "mfu"):
    assert all(np.isfinite(r[key]) for r in records), key
  assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
  assert records[-1]["eval_loss"] == pytest.approx(summary["eval_loss"])
  assert records[-1]["unigram_entropy"] == pytest.approx(summary["unigram_entropy"])
  assert os.listdir(os.path.join(workdir, "tensorboard"))[0].startswith("events.out.tfevents")
  assert checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), 2).all_steps() == (4, 6)
  assert os.path.getsize(os.path.join(workdir, metrics.PLOT_FILE)) > 0
  with open(os.path.join(workdir, loop.SAMPLE_FILE), encoding="utf-8") as f:
    assert f.read() == summary["sample"]
  assert summary["sample"].startswith(config.sample.prompt)


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(full_run, tmp_path):
  config, full_workdir, _ = full_run
  first_part = config.copy_and_resolve_references()
  first_part.train.steps = 3
  first_part.optimizer.decay_steps = 6      # the schedule of the 6-step run
  first_part.sample.max_new_tokens = 0
  assert loop.train(first_part, str(tmp_path))["step"] == 3
  second_part = config.copy_and_resolve_references()
  second_part.sample.max_new_tokens = 0
  assert loop.train(second_part, str(tmp_path))["step"] == 6
  full = {r["step"]: r for r in metrics.read_records(full_workdir)}
  resumed = {r["step"]: r for r in metrics.read_records(str(tmp_path))}
  for step in range(4, 7):
    for key in ("loss", "grad_norm", "learning_rate"):
      assert resumed[step][key] == full[step][key], (step, key)   # exact equality
  assert resumed[6]["eval_loss"] == full[6]["eval_loss"]


def _session_starts(directory: str) -> list:
  """The steps of the SessionLog START events in the TensorBoard event files under
  `directory` (TFRecords: length, its CRC, an Event proto, its CRC)."""
  from tensorboardX.proto import event_pb2   # pylint: disable=import-outside-toplevel
  starts = []
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      data_ = f.read()
    at = 0
    while at < len(data_):
      length = int.from_bytes(data_[at:at + 8], "little")
      event = event_pb2.Event.FromString(data_[at + 12:at + 12 + length])
      at += 16 + length
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        starts.append(event.step)
  return starts


@pytest.mark.slow
def test_a_run_resumed_behind_its_last_record_logs_each_step_once(full_run, tmp_path):
  """A crash after step 6 was logged but before it was saved: the run resumes from step
  4 and logs 5 and 6 again. metrics.jsonl keeps one record a step, the resumed run's,
  equal to the uninterrupted run's, and TensorBoard is told to purge steps from 5."""
  config, full_workdir, _ = full_run
  workdir = str(tmp_path / "run")
  shutil.copytree(full_workdir, workdir)
  shutil.rmtree(os.path.join(workdir_lib.checkpoint_dir(workdir), "6"))
  assert _session_starts(os.path.join(workdir, "tensorboard")) == []
  config = config.copy_and_resolve_references()
  config.sample.max_new_tokens = 0
  assert loop.train(config, workdir)["step"] == 6
  records = metrics.read_records(workdir)
  assert [r["step"] for r in records] == list(range(1, 7))
  full = {r["step"]: r for r in metrics.read_records(full_workdir)}
  for record in records:
    for key in ("loss", "grad_norm", "eval_loss"):
      assert record.get(key) == full[record["step"]].get(key), (record["step"], key)
  assert _session_starts(os.path.join(workdir, "tensorboard")) == [5]


def test_a_new_run_drops_the_records_of_one_that_saved_nothing(tmp_path):
  """Records left by a run that crashed before its first checkpoint belong to no step a
  new run resumes from: all go."""
  path = os.path.join(str(tmp_path), metrics.METRICS_FILE)
  with open(path, "w", encoding="utf-8") as f:
    f.write('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
  writer = metrics.MetricsWriter(str(tmp_path), 0)
  writer.write(1, {"loss": 3.0})
  writer.close()
  assert writer.dropped == 2
  assert metrics.read_records(str(tmp_path)) == [{"step": 1, "loss": 3.0}]


@pytest.mark.slow
def test_a_log_record_averages_every_step_since_the_last_even_across_saves(full_run, tmp_path,
                                                                          monkeypatch):
  """Logs at 3 and 6, saves at 2 and 4: each record is the mean of the three steps'
  losses that the uninterrupted run logged one by one, and counts their tokens."""
  config, full_workdir, _ = full_run
  config = config.copy_and_resolve_references()
  config.train.log_every, config.checkpoint.save_every = 3, 2
  config.sample.max_new_tokens = 0
  tokens = []
  train_record = metrics.train_record

  def counting_train_record(fetched, seconds, n_tokens, *args):
    tokens.append(n_tokens)
    return train_record(fetched, seconds, n_tokens, *args)

  monkeypatch.setattr(metrics, "train_record", counting_train_record)
  loop.train(config, str(tmp_path))
  each_step = {r["step"]: r for r in metrics.read_records(full_workdir)}
  records = metrics.read_records(str(tmp_path))
  assert [r["step"] for r in records] == [3, 6]
  for record in records:
    for key in ("loss", "grad_norm", "target_tokens"):
      expected = np.mean([each_step[s][key] for s in range(record["step"] - 2, record["step"] + 1)])
      assert record[key] == pytest.approx(expected, rel=1e-6), (record["step"], key)
  assert tokens == [3 * config.train.batch_size * config.data.seq_len] * 2


@pytest.mark.slow
def test_a_stop_logs_the_steps_since_the_last_record(full_run, tmp_path, monkeypatch):
  """SIGTERM during step 3 with records every 4 steps: the stop logs steps 1-3 before it
  saves (a resumed run never runs them again), then the resumed run logs 4 and 5-6."""
  config, full_workdir, _ = full_run
  config = config.copy_and_resolve_references()
  config.train.log_every, config.train.eval_every = 4, 0
  config.sample.max_new_tokens = 0
  fetched = []
  next_batch = data.TrainBatches.__next__

  def signalling_next(self):
    fetched.append(None)
    if len(fetched) == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return next_batch(self)

  with monkeypatch.context() as patch:
    patch.setattr(data.TrainBatches, "__next__", signalling_next)
    assert loop.train(config, str(tmp_path))["stopped_by"] == "SIGTERM"
  loop.train(config, str(tmp_path))
  each_step = {r["step"]: r for r in metrics.read_records(full_workdir)}
  records = metrics.read_records(str(tmp_path))
  assert [r["step"] for r in records] == [3, 4, 6]
  for record, steps_in in zip(records, ([1, 2, 3], [4], [5, 6])):
    for key in ("loss", "grad_norm", "target_tokens"):
      assert record[key] == pytest.approx(np.mean([each_step[s][key] for s in steps_in]),
                                          rel=1e-6), (record["step"], key)


def test_the_saved_config_names_data_and_tokenizer_by_absolute_paths(corpus, tmp_path,
                                                                     monkeypatch):
  """Given relative to the working directory, they are found from any other: the apps
  need only --workdir."""
  tokenizers.ByteTokenizer().save(str(tmp_path / "tok"))
  corpus_dir, pattern = os.path.split(corpus)
  os.symlink(corpus_dir, tmp_path / "corpus")
  config = tiny_config(os.path.join("corpus", pattern))
  config.train.steps, config.optimizer.warmup_steps = 1, 0
  config.data.tokenizer = "tok"
  monkeypatch.chdir(tmp_path)
  loop.train(config, "run")
  saved = workdir_lib.load_config(str(tmp_path / "run")).data
  assert (saved.path, saved.tokenizer) == (str(tmp_path / "corpus" / pattern),
                                           str(tmp_path / "tok"))


@pytest.mark.slow
def test_steps_after_the_first_of_each_kind_trace_and_compile_nothing(corpus, tmp_path,
                                                                     monkeypatch):
  """No recompilation between steps: the train step is traced once, and once a log, an
  evaluation and a save have each happened, later steps lower nothing at all (not even
  an eager op), so every step after that runs compiled code only."""
  config = tiny_config(corpus)   # eval at steps 3 and 6, saves at 2, 4 and 6
  traces, lowered, at_step = [], [], [0]
  make_train_step = steps.make_train_step

  def counting_make_train_step(*args, **kwargs):
    step_fn = make_train_step(*args, **kwargs)

    def traced(state, batch):
      traces.append(at_step[0])
      return step_fn(state, batch)
    return traced

  check_finite = loop._check_finite   # pylint: disable=protected-access

  def note_step(pending, *args):
    at_step[0] = pending[-1][0]
    return check_finite(pending, *args)

  def on_event(event, *_, **__):
    if event in (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT):
      lowered.append(at_step[0])

  monkeypatch.setattr(steps, "make_train_step", counting_make_train_step)
  monkeypatch.setattr(loop, "_check_finite", note_step)
  jax.monitoring.register_event_duration_secs_listener(on_event)
  try:
    assert loop.train(config, str(tmp_path))["step"] == 6
  finally:
    jax.monitoring.unregister_event_duration_listener(on_event)
  assert traces == [0]
  assert lowered and max(lowered) <= 3, lowered   # steps 4, 5, 6: nothing lowered


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
  make_train_step = steps.make_train_step

  def poisoned(*args, **kwargs):
    """From the 4th update on, parameters and loss become NaN."""
    step = make_train_step(*args, **kwargs)

    def train_step(state, batch):
      new, step_metrics = step(state, batch)
      bad = state.step >= 3
      params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), new.params)
      return new._replace(params=params), {**step_metrics,
                                           "loss": jnp.where(bad, jnp.nan, step_metrics["loss"])}
    return train_step

  monkeypatch.setattr(steps, "make_train_step", poisoned)
  config = tiny_config(corpus)
  with pytest.raises(loop.TrainingDiverged, match=r"the loss or gradient norm is not finite "
                     r"\(loss nan, .* at step 4: .* latest checkpoint is step 2"):
    loop.train(config, str(tmp_path))
  assert_only_checkpoint_is_finite_step_2(config, tmp_path)


@pytest.mark.slow
def test_non_finite_parameters_stop_the_run_before_they_are_saved(corpus, tmp_path,
                                                                  monkeypatch):
  """A NaN learning rate for the 4th update: step 4's loss (that of the parameters
  before the update) is finite, but its parameters, due for a save, are not."""
  schedule = optimizer.learning_rate_schedule

  def nan_at_the_4th_update(*args):
    return lambda count: jnp.where(count == 3, jnp.nan, schedule(*args)(count))

  monkeypatch.setattr(optimizer, "learning_rate_schedule", nan_at_the_4th_update)
  config = tiny_config(corpus)
  with pytest.raises(loop.TrainingDiverged, match=r"the updated parameters are not finite "
                     r"\(loss \d.*\) at step 4: .* latest checkpoint is step 2"):
    loop.train(config, str(tmp_path))
  assert_only_checkpoint_is_finite_step_2(config, tmp_path)


def test_a_failed_checkpoint_write_is_one_error_keeping_the_steps_before(sgd, tmp_path):
  """Files capped at 2 KiB (a full disk or quota): orbax's failure, reported at the
  next call, is one error naming the steps kept (the app had ended in ~1000 lines of
  tracebacks). Python ignores SIGXFSZ, so the write fails with EFBIG."""
  checkpointer = checkpoints.Checkpointer(str(tmp_path), 2)
  checkpointer.save(sgd["state"], {"next_row": 0})
  checkpointer.wait()
  # Computed before the cap: JAX would write the program that adds into its cache, cut.
  later = sgd["state"]._replace(step=sgd["state"].step + 1)
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
  try:
    with pytest.raises(checkpoints.CheckpointError, match=re.escape(
        f"writing the checkpoint {tmp_path / '1'} failed: [Errno {errno.EFBIG}] "
        f"{os.strerror(errno.EFBIG)}; the steps saved before are kept: 0") + "$"):
      checkpointer.save(later, {"next_row": 8})
      checkpointer.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
  assert checkpointer.all_steps() == (0,)


def assert_only_checkpoint_is_finite_step_2(config, workdir):
  checkpointer = checkpoints.Checkpointer(str(workdir / "checkpoints"), 2)
  assert checkpointer.all_steps() == (2,)
  model = gj.transform(config)
  tx = optimizer.make_optimizer(config.optimizer, lambda _: 1.0)
  like = jax.eval_shape(lambda: steps.init_state(model, tx, 0, 32))
  restored, data_state = checkpointer.restore(like)
  assert int(restored.step) == 2 and data_state["next_row"] == 2 * config.train.batch_size
  chex.assert_tree_all_finite(restored.params)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["state_removed", "data_not_json", "arrays_emptied"])
def test_a_damaged_latest_checkpoint_is_one_error_naming_the_step(corpus, tmp_path, damage):
  """orbax had ended the resume in a raw KeyError or JSONDecodeError traceback; the error
  now names the step, the file its checksums find damaged, and the step to fall back on,
  which a resume then takes."""
  config = tiny_config(corpus)
  config.train.steps, config.optimizer.warmup_steps = 2, 0
  config.checkpoint.save_every, config.sample.max_new_tokens = 1, 0
  loop.train(config, str(tmp_path))
  step_dir = tmp_path / "checkpoints" / "2"
  if damage == "state_removed":
    shutil.rmtree(step_dir / "state")
  elif damage == "data_not_json":
    (step_dir / "data" / "metadata").write_text('{"ro')
  else:   # tensorstore's arrays, truncated
    for chunk in (step_dir / "state").glob("**/d/*"):
      chunk.write_bytes(b"")
  resumed = config.copy_and_resolve_references()
  resumed.train.steps = 3
  with pytest.raises(checkpoints.CheckpointError, match=re.escape(
      f"the checkpoint of step 2 in {tmp_path / 'checkpoints'} is corrupt: ") + ".*"
      + re.escape(f"move {step_dir} away to use step 1")) as error:
    loop.train(resumed, str(tmp_path))
  assert "bound method" not in str(error.value)   # tensorstore's pointer to its details
  shutil.move(str(step_dir), str(tmp_path / "damaged"))
  assert loop.train(resumed, str(tmp_path))["step"] == 3


@pytest.mark.slow
def test_resuming_under_another_model_or_optimizer_names_what_differs(corpus, tmp_path):
  """The saved shapes are compared with the config's before orbax restores anything;
  the checkpoint stays as it was."""
  config = tiny_config(corpus)
  config.train.steps, config.optimizer.warmup_steps = 1, 0
  loop.train(config, str(tmp_path))
  saved_config = (tmp_path / "config.json").read_text()
  directory = re.escape(str(tmp_path / "checkpoints"))
  for section, field, value, message in [
      ("model", "d_model", 48, r"params/\S+ is \(1, 32, 1, 16\) there, \(1, 48, 1, 16\) here"),
      ("optimizer", "max_grad_norm", 0.0, r"opt_state/0/count is absent there, \(\) here")]:
    changed = config.copy_and_resolve_references()
    changed.train.steps = 2
    changed[section][field] = value
    with pytest.raises(gj.ConfigError, match=f"the checkpoint of step 1 in {directory} does not "
                       f"match this config: {message}; resume with the config") as error:
      loop.train(changed, str(tmp_path))
    assert error.value.field == section
    # The workdir keeps the config its checkpoint was saved with, so the apps still
    # load it (and the advice above still holds).
    assert (tmp_path / "config.json").read_text() == saved_config
  assert checkpoints.Checkpointer(str(tmp_path / "checkpoints"), 2).all_steps() == (1,)


@pytest.mark.slow
def test_a_resume_names_the_settings_changed_since_the_checkpoint(corpus, tmp_path, capsys):
  """The checkpoint checks only shapes: a resume with another learning rate and Adam
  b1 says so, field by field, against the config.json the checkpoint was saved with."""
  config = tiny_config(corpus)
  config.train.steps, config.optimizer.warmup_steps = 1, 0
  config.sample.max_new_tokens = 0
  loop.train(config, str(tmp_path))
  capsys.readouterr()
  changed = config.copy_and_resolve_references()
  changed.train.steps = 2
  changed.optimizer.learning_rate *= 0.5
  changed.optimizer.b1 = 0.8
  loop.train(changed, str(tmp_path))
  lines = [line for line in capsys.readouterr().out.splitlines() if "settings changed" in line]
  assert lines == [
      "settings changed since the checkpoint's run: "
      f"optimizer.b1: {config.optimizer.b1!r} -> 0.8; "
      f"optimizer.learning_rate: {config.optimizer.learning_rate!r} -> "
      f"{changed.optimizer.learning_rate!r}; train.steps: 1 -> 2"]
  # An unreadable saved config (edited by hand) does not stop the resume, which writes
  # its own: the changes are said to be unknown.
  (tmp_path / "config.json").write_text('{"train": {"steps": "2"}}')
  changed.train.steps = 3
  assert loop.train(changed, str(tmp_path))["step"] == 3
  assert "the saved config is unreadable" in capsys.readouterr().out


@pytest.mark.parametrize("section,field,value,name,message", [
    ("optimizer", "learning_rate", -1.0, "optimizer.learning_rate", r"\(0, inf\)"),
    ("optimizer", "grad_accum_steps", 3, "optimizer.grad_accum_steps", "does not divide"),
    ("optimizer", "no_decay", ("(",), "optimizer.no_decay", "not a regex"),
    ("train", "steps", 2, "train.steps", "must exceed optimizer.warmup_steps"),
    ("data", "seq_len", 1, "data.seq_len", ">= 2"),
    ("data", "eval_fraction", 0.0, "data.eval_fraction", r"\(0, 1\)"),
    ("data", "eval_fraction", 1e-6, "data.eval_fraction", "holds out 1 of the"),
    ("data", "path", "/nonexistent/*.txt", "data.path", "no file matches"),
    ("data", "tokenizer", "/nonexistent/tokenizer.model", "data.tokenizer", "no file at"),
    ("model", "vocab_size", 100, "data.tokenizer", "261 ids does not fit"),
    ("checkpoint", "keep", 0, "checkpoint.keep", ">= 1"),
    ("sample", "temperature", -1.0, "sample.temperature", r"\[0, inf\)"),
    ("sample", "top_k", 263, "sample.top_k", "exceeds model.vocab_size=262"),
])
def test_bad_config_or_data_fails_before_building_the_model(corpus, tmp_path, monkeypatch,
                                                            section, field, value, name, message):
  monkeypatch.setattr(transformer, "transform", lambda *_: pytest.fail("model was built"))
  config = tiny_config(corpus)
  config[section][field] = value
  with pytest.raises(gj.ConfigError, match=message) as error:
    loop.train(config, str(tmp_path))
  assert error.value.field == name


@pytest.mark.slow
def test_an_eval_split_with_one_target_token_reports_its_zero_entropy(corpus, tmp_path):
  """Two held-out tokens, [bos] and the first of a document: one target, so the eval
  unigram entropy is 0 and the final report must not divide by it."""
  config = tiny_config(corpus)
  n_tokens = sum(len(text.encode("utf-8")) + 2 for text in data.read_documents(corpus))
  config.data.eval_fraction = 2 / n_tokens
  config.train.steps, config.optimizer.warmup_steps = 1, 0
  summary = loop.train(config, str(tmp_path))
  assert summary["unigram_entropy"] == 0.0 and np.isfinite(summary["eval_loss"])


@pytest.mark.parametrize("eval_loss, entropy, end", [
    (3.0, 4.0, "entropy 4.0000 (25.0% below)"), (6.0, 4.0, "entropy 4.0000 (50.0% above)"),
    (1.0, 0.0, "entropy 0.0000")])
def test_final_report_says_below_or_above_the_unigram_entropy(eval_loss, entropy, end):
  assert metrics.final_report(eval_loss, entropy).endswith(end)


def test_sample_past_the_learned_positions_fails_before_the_data(tmp_path, monkeypatch):
  """The byte-level prompt "def " is 5 ids with BOS: 28 new tokens fit a table of 32
  positions, 29 do not, and training refuses before reading any data."""
  class DataLoaded(Exception):
    pass

  def load_splits(*_):
    raise DataLoaded

  monkeypatch.setattr(loop.data, "load_splits", load_splits)
  config = tiny_config(trainable_position_size=32)
  config.sample.update(prompt="def ", max_new_tokens=29)
  with pytest.raises(gj.ConfigError, match="29 new tokens after the 5-token") as error:
    loop.train(config, str(tmp_path))
  assert error.value.field == "sample.max_new_tokens"
  config.sample.max_new_tokens = 28
  with pytest.raises(DataLoaded):
    loop.train(config, str(tmp_path))


def write_config_file(directory, corpus_glob, steps):
  """tiny_config as a config file for experiments/train.py."""
  path = directory / "tiny_config.py"
  path.write_text(
      "import gemma_jax as gj\n\n"
      "def get_config():\n"
      "  config = gj.get_config('gemma3-tiny')\n"
      f"  config.model.update({TINY_MODEL!r})\n"
      f"  config.data.path = {corpus_glob!r}\n"
      "  config.data.seq_len = 32\n"
      f"  config.train.update(dict(steps={steps}, batch_size=8, log_every=1, eval_every=0,\n"
      "                           progress_bar=False, peak_flops=1e9))\n"
      "  config.optimizer.warmup_steps = 2\n"
      "  config.checkpoint.save_every = 1000000\n"
      "  config.sample.max_new_tokens = 0\n"
      "  return config\n")
  return str(path)


def run_app(*args, **popen):
  return subprocess.Popen([sys.executable, os.path.join(REPO, "experiments", "train.py"), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          **popen)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
  workdir = tmp_path / "run"
  process = run_app(f"--config={write_config_file(tmp_path, corpus, 100000)}",
                    f"--workdir={workdir}")
  deadline = time.time() + 120
  while not (workdir / metrics.METRICS_FILE).exists() or \
      not (workdir / metrics.METRICS_FILE).read_text():
    assert process.poll() is None and time.time() < deadline, process.communicate()
    time.sleep(0.2)
  process.send_signal(signal.SIGTERM)
  stdout, stderr = process.communicate(timeout=60)
  assert process.returncode == 0, stderr
  saved = checkpoints.Checkpointer(str(workdir / "checkpoints"), 1).all_steps()
  assert len(saved) == 1 and saved[0] >= 1
  assert f"stopped by SIGTERM at step {saved[0]}; checkpoint saved" in stdout
  logged = [r["step"] for r in metrics.read_records(str(workdir))]
  assert logged == list(range(1, saved[0] + 1))


@pytest.mark.slow
def test_app_reports_a_missing_data_path_in_one_line(tmp_path):
  process = run_app(f"--config={write_config_file(tmp_path, '/nonexistent/*.txt', 5)}",
                    f"--workdir={tmp_path / 'run'}")
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 1
  assert stderr.strip().splitlines() == [
      "train.py: error: config.data.path: no file matches '/nonexistent/*.txt'"]
  assert not (tmp_path / "run").exists()   # created for the run, which wrote nothing


def test_mfu_is_against_a_datasheet_peak_and_absent_on_a_cpu():
  """The matmul probe at start-up read a CPU's peak under whatever else ran (MFU 13% to
  72% for one model); an accelerator's datasheet peak is a fixed denominator, and a CPU
  gets none unless train.peak_flops gives one."""
  assert flops.datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert flops.datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
  assert flops.datasheet_peak_flops("TPU v5 lite") == 197e12
  assert flops.datasheet_peak_flops("cpu") is None
  fetched = [{"loss": 2.0, "learning_rate": 1e-3}]
  assert "mfu" not in metrics.train_record(fetched, 2.0, 1000, 6e6, None)
  record = metrics.train_record(fetched, 2.0, 1000, 6e6, 1e12)
  assert record["mfu"] == pytest.approx(500 * 6e6 / (1e12 * jax.device_count()))


def test_the_progress_bar_counts_steps_the_device_finished():
  """Its rate counted dispatched steps (74 steps/s at a real 2.5): a step is counted once
  its loss is ready, and every step dispatched once the metrics are fetched."""

  class Loss:
    def __init__(self):
      self.ready = False

    def is_ready(self):
      return self.ready

  class Bar:
    n = 0

    def update(self, count=1):
      self.n += count

  bar = Bar()
  progress = metrics.Progress(bar)
  losses = [Loss() for _ in range(3)]
  for loss in losses:
    progress.dispatched({"loss": loss})
  assert bar.n == 0
  losses[0].ready = losses[2].ready = True     # in order: the second still runs
  progress.dispatched({"loss": Loss()})
  assert bar.n == 1
  progress.all_finished()
  assert bar.n == 4
