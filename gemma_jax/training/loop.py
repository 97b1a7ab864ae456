"""The training loop: `train(config, workdir)`, to be read top to bottom.

validate the config -> tokenizer -> data -> model, optimizer -> restore the latest
checkpoint or initialise -> compile -> steps (log, evaluate, checkpoint; stop on a
signal, a non-finite loss or non-finite parameters) -> final evaluation, loss plot and a
generated sample.
Everything that can be wrong with the config or the data fails before compiling.
"""

import contextlib
import os
import signal
import threading
import time
from typing import List, Tuple

import jax
import numpy as np
from ml_collections import config_dict
import tqdm

from gemma_jax import config as config_lib
from gemma_jax import lora, quant, sharding, transformer
from gemma_jax.inference import sampler
from gemma_jax.text import tokenizers
from gemma_jax.training import (checkpoints, data, flops, init_from, metrics, optimizer, steps,
                                workdir as workdir_lib)

SAMPLE_FILE = "sample.txt"


class TrainingDiverged(RuntimeError):
  """The loss, gradient norm or parameters stopped being finite."""


class StopSignal:
  """While active, SIGTERM and SIGINT (Ctrl-C) set `requested` instead of killing the
  process; a second signal gets the default behaviour back."""
  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = None
    self._previous = {}

  def _handle(self, signum, _):
    self.requested = signal.Signals(signum).name
    self._restore()

  def _restore(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *_):
    self._restore()


def _say(message: str) -> None:
  if jax.process_index() == 0:
    tqdm.tqdm.write(message)


def _say_changes_since_saved(config: config_dict.ConfigDict, workdir: str) -> None:
  """Names the settings a resumed run changes: the checkpoint checks only shapes, so a
  new learning rate, sequence length or window would otherwise pass without a word."""
  if not os.path.isfile(os.path.join(workdir, workdir_lib.CONFIG_FILE)):
    return
  try:
    saved = workdir_lib.load_config(workdir)
  except workdir_lib.WorkdirError as error:   # the run writes its own config next
    _say(f"the saved config is unreadable, so its changes are unknown: {error}")
    return
  changes = workdir_lib.config_changes(saved, config)
  if changes:
    _say("settings changed since the checkpoint's run: " + "; ".join(changes))


def _check_finite(pending: List[Tuple[int, dict]], checkpointer, directory) -> List[dict]:
  """Fetches the metrics of the steps since the last check (less params_finite); raises
  TrainingDiverged at the first step whose loss, gradient norm or updated parameters
  are not finite, so no checkpoint is saved from non-finite parameters."""
  fetched = jax.device_get(pending)
  for step, values in fetched:
    params_finite = values.pop("params_finite")
    metrics_finite = np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])
    if not (metrics_finite and params_finite):
      latest = checkpointer.latest_step()
      # Saves come only from parameters checked finite; whether the step's files are
      # intact is for the restore, which checks them, to say.
      kept = (f"the latest checkpoint is step {latest} in {directory}" if latest is not None
              else "no checkpoint was saved before it")
      what = "the loss or gradient norm is" if not metrics_finite else "the updated parameters are"
      raise TrainingDiverged(f"{what} not finite (loss {values['loss']}, grad_norm "
                             f"{values['grad_norm']}) at step {step}: stopped without saving; "
                             f"{kept}")
  return [values for _, values in fetched]


def _evaluate(eval_step, params, batches: List[dict], frozen) -> float:
  """Mean cross-entropy over the eval batches' weighted tokens."""
  sums = jax.device_get([eval_step(params, batch, frozen) for batch in batches])
  return float(sum(s.cross_entropy for s in sums) / max(sum(s.weight for s in sums), 1.0))


def _generate(config: config_dict.ConfigDict, params, tokenizer) -> str:
  """The sample prompt and its continuation, as text."""
  s = config.sample
  return s.prompt + sampler.Sampler(config, params, tokenizer)(
      s.prompt, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
      top_p=s.top_p, seed=config.seed)


def _tokenizer_name(config: config_dict.ConfigDict) -> str:
  """data.tokenizer, or the tokenizer of the checkpoint train.init_from names (its
  directory's files, or the workdir's tokenizer), else "byte"."""
  if config.data.tokenizer:
    return config.data.tokenizer
  path = config.train.init_from
  if path and workdir_lib.is_workdir(path):
    return workdir_lib.load_config(path).data.tokenizer or "byte"
  if path and any(os.path.isfile(os.path.join(path, name))
                  for name in ("tokenizer.json", "tokenizer.model")):
    return path
  return "byte"


def _anchor_paths(config: config_dict.ConfigDict) -> None:
  """Makes data.path's globs and a tokenizer file or directory absolute, so that the
  saved config names the same files from any working directory."""
  d = config.data
  if d.path is not None:
    d.path = ",".join(os.path.abspath(os.path.expanduser(p.strip()))
                      for p in d.path.split(",") if p.strip())
  if d.tokenizer != "byte" and os.path.exists(d.tokenizer):
    d.tokenizer = os.path.abspath(d.tokenizer)


def _resumed_base_step(config: config_dict.ConfigDict, workdir: str) -> config_dict.ConfigDict:
  """The config, given the step of train.init_from that the run in `workdir` started
  from when it resumes one and none is set: a LoRA run's base must not move."""
  t = config.train
  if not (t.init_from and t.init_from_step is None and workdir_lib.is_workdir(workdir)):
    return config
  saved = workdir_lib.load_config(workdir).train
  if saved.init_from != os.path.abspath(t.init_from):
    return config
  config = config.copy_and_resolve_references()
  config.train.init_from_step = saved.init_from_step
  return config


def _pin_base_step(base: str, step: int, workdir: str) -> None:
  """Asks the run in workdir `base` to keep the step this LoRA run adapts (past its
  checkpoint.keep); a base one cannot write to is only warned about."""
  try:
    workdir_lib.pin_step(base, step, workdir)
  except OSError as error:
    _say(f"warning: could not pin step {step} of {base} ({error}); should its run delete "
         "that step, this workdir's model can no longer be loaded")


def _frozen_base(config: config_dict.ConfigDict, mesh):
  """The weights LoRA adapts, laid out on `mesh`: train.init_from's."""
  if not config.train.init_from:
    raise config_lib.ConfigError("lora.rank", "LoRA adapts pretrained weights: set "
                                 "train.init_from to a transformers directory or a workdir")
  return init_from.base_params(config, mesh)


def train(config: config_dict.ConfigDict, workdir: str, *, model_overrides=()) -> dict:
  """Trains (or resumes training) and returns a summary.

  With `config.train.init_from` the model section comes from that checkpoint (see
  `init_from.resolve`; `model_overrides` are the model fields the user set, which must
  be compute options or agree with it) and training starts from its weights with a
  fresh optimizer; with `config.lora.rank` > 0 only LoRA adapters are trained over
  those frozen weights. A workdir that has checkpoints resumes instead. The resolved
  config is saved as WORKDIR/config.json; one run at a time holds the workdir.

  Returns:
    dict with "step" (reached), "stopped_by" (a signal name, or None), for a new run
    from train.init_from "start_eval_loss" (of its weights), and when the run is
    complete "eval_loss", "unigram_entropy" (both in nats per token) and "sample" (text,
    or None).

  Raises:
    ConfigError / data.DataError: naming the config field at fault, before compiling.
    TrainingDiverged: the loss or parameters became NaN or infinite; no checkpoint is
      written from that step on.
    checkpoints.CheckpointError: the checkpoint to resume from is damaged (it names the
      intact step to use instead), or a save failed (it names the OS error).
    OSError: metrics.jsonl could not be written (its records stay whole).
  """
  config_lib.validate(config)
  config = init_from.resolve(_resumed_base_step(config, workdir), model_overrides)
  with config.unlocked():
    config.data.tokenizer = _tokenizer_name(config)
  _anchor_paths(config)
  config_lib.validate(config)
  if config.model.quant in quant.STORED_MODES and not config.lora.rank:
    raise config_lib.ConfigError(
        "model.quant", f"{config.model.quant!r} holds integer weights, which do not train: "
        "use 'int8' (quantization-aware training), or LoRA (lora.rank > 0) over the "
        "quantized base")
  if config.lora.rank:
    lora.check_targets(config)
  # Process 0 holds the workdir for the run; the other hosts of the same run share it.
  held = workdir_lib.lock(workdir) if jax.process_index() == 0 else contextlib.nullcontext()
  with held:
    return _train(config, workdir)


def _train(config: config_dict.ConfigDict, workdir: str) -> dict:
  """`train` once the config is resolved and the workdir held."""
  run = _Run(config, workdir)
  with sharding.activate(run.mesh):
    state = run.initial_state()
    run.compile(state)
  state, summary, last_eval = run.loop(state)
  if summary["stopped_by"]:
    _say(f"stopped by {summary['stopped_by']} at step {summary['step']}; checkpoint saved in "
         f"{run.checkpoint_dir}")
    return summary
  return run.finish(state, summary, last_eval)


class _Run:
  """One run's parts, in the order `_train` uses them: the data, model, optimizer and
  checkpoints (`__init__`), the state it starts from (`initial_state`), its compiled
  steps (`compile`), the steps themselves (`loop`) and the final report (`finish`)."""

  def __init__(self, config: config_dict.ConfigDict, workdir: str):
    self.config, self.workdir = config, workdir
    t = config.train
    self.mesh = sharding.make_mesh(config.mesh)
    # Evaluation runs in micro-batches too: they are what fits in memory.
    accum = config.optimizer.grad_accum_steps
    sharding.check_batch_rows(t.batch_size // accum, dict(self.mesh.shape))
    self.tokenizer = tokenizers.get_tokenizer(config.data.tokenizer, config.model.vocab_size)
    config_lib.check_sample_fits(
        config, 1 + len(self.tokenizer.encode([config.sample.prompt])[0]))
    train_rows, eval_rows = data.load_splits(config.data, self.tokenizer, config.seed)
    self.batches = data.TrainBatches(train_rows, t.batch_size, config.seed)
    local_eval_set = data.eval_batches(eval_rows, t.batch_size // accum,
                                       t.eval_batches * accum)
    self.entropy = metrics.unigram_entropy(local_eval_set)
    _say(f"data: {len(train_rows)} train rows, {len(eval_rows)} eval rows of "
         f"{config.data.seq_len} tokens; eval unigram entropy {self.entropy:.4f} nats/token")

    model = transformer.transform(config)
    self.schedule = optimizer.learning_rate_schedule(config.optimizer, t.steps)
    self.tx = optimizer.make_optimizer(config.optimizer, self.schedule)
    trained = steps.trained_part(config)
    self.init = lambda: steps.init_state(model, self.tx, config.seed, config.data.seq_len,
                                         trained)
    self.state_shardings = steps.state_shardings(config, self.tx, jax.eval_shape(self.init),
                                                 self.mesh)
    self.eval_set = [sharding.global_batch(batch, self.mesh) for batch in local_eval_set]
    self.checkpoint_dir = workdir_lib.checkpoint_dir(workdir)
    self.checkpointer = checkpoints.Checkpointer(
        self.checkpoint_dir, config.checkpoint.keep,
        pinned=lambda: workdir_lib.pinned_steps(workdir), writer=True)
    if config.lora.rank and t.init_from_step is not None and jax.process_index() == 0:
      _pin_base_step(t.init_from, t.init_from_step, workdir)
    # Trained params combined with the frozen ones (a LoRA run's base; else nothing).
    if config.lora.rank:
      self.combine = lora.combine
      self.frozen_shardings = lora.split(sharding.param_shardings(config, self.mesh))[0]
    else:
      self.combine = lambda frozen, params: params
      self.frozen_shardings = {}
    self.forward = steps.model_forward(model)
    self.frozen, self.config_file = {}, None

  def initial_state(self):
    """The state the run starts from: its latest checkpoint (and data position), else
    train.init_from's weights, else a fresh init; the config is saved once it is known
    the run goes on. Under the run's mesh."""
    config, t = self.config, self.config.train
    init = jax.jit(self.init, out_shardings=self.state_shardings)
    if config.lora.rank:
      self.frozen = _frozen_base(config, self.mesh)
    if self.checkpointer.latest_step() is not None:
      state, data_state = self.checkpointer.restore(jax.eval_shape(init))
      try:
        self.batches.restore(data_state)
      except ValueError as error:   # a position no run saves: written by hand, or damaged
        raise self.checkpointer.damaged(int(state.step), "holds a data position this run "
                                        f"cannot go on from ({checkpoints.DATA_POSITION_FILE}"
                                        f": {error})") from None
      _say(f"resumed from step {int(state.step)} in {self.checkpoint_dir}"
           + (" (train.init_from is read only for a new run)" if t.init_from else ""))
      _say_changes_since_saved(config, self.workdir)
    elif t.init_from and not config.lora.rank:
      params = init_from.base_params(config, self.mesh)
      tx = self.tx
      state = jax.jit(lambda params: init()._replace(params=params, opt_state=tx.init(params)),
                      out_shardings=self.state_shardings)(params)
      _say(f"starting from the weights of {t.init_from}")
    else:
      state = init()
      if t.init_from:
        _say(f"LoRA (rank {config.lora.rank}) over the frozen weights of {t.init_from}")
    # Only now: a resume the checkpoint refuses leaves the config it was saved with.
    if jax.process_index() == 0:
      self.config_file = workdir_lib.save_config(self.workdir, config)
    return state

  def _train_step(self, state, batch, frozen):
    forward, combine = self.forward, self.combine
    step_forward = lambda params, batch, rng: forward(combine(frozen, params), batch, rng)
    return steps.make_train_step(
        step_forward, self.tx, self.schedule,
        grad_accum_steps=self.config.optimizer.grad_accum_steps,
        z_loss=self.config.train.z_loss)(state, batch)

  def _eval_step(self, params, batch, frozen):
    return steps.make_eval_step(self.forward)(self.combine(frozen, params), batch)

  def compile(self, state) -> None:
    """Compiles the train and eval steps for `state`'s shapes (under the run's mesh)."""
    start = time.perf_counter()
    batch_sharding = sharding.batch_sharding(self.mesh)
    self.train_step = jax.jit(
        self._train_step, in_shardings=(self.state_shardings, batch_sharding,
                                        self.frozen_shardings),
        out_shardings=(self.state_shardings, sharding.replicated(self.mesh)),
        donate_argnums=0,
    ).lower(state, sharding.global_batch(self.batches.batch(0), self.mesh),
            self.frozen).compile()
    self.eval_step = jax.jit(
        self._eval_step, in_shardings=(self.state_shardings.params, batch_sharding,
                                       self.frozen_shardings),
        out_shardings=sharding.replicated(self.mesh)).lower(
            state.params, self.eval_set[0], self.frozen).compile()
    _say(f"compiled the train and eval steps in {time.perf_counter() - start:.1f}s")

  def evaluate(self, params) -> float:
    return _evaluate(self.eval_step, params, self.eval_set, self.frozen)

  def _start_report(self, state, writer, summary: dict) -> None:
    """A new run from train.init_from: the eval loss of the weights it starts from."""
    t = self.config.train
    start_loss = self.evaluate(state.params)
    summary["start_eval_loss"] = start_loss
    if writer:
      writer.write(0, {"eval_loss": start_loss})
    stored = (f", as {self.config.model.quant}"
              if self.config.model.quant in quant.STORED_MODES else "")
    _say(f"step 0/{t.steps} | eval_loss {start_loss:.4f} (the weights of {t.init_from}"
         f"{stored})")

  def loop(self, state):
    """The steps from `state` to train.steps or a stop signal, logging, evaluating and
    saving as configured: (the last state, the summary so far, (step, eval loss) of the
    last evaluation or None)."""
    config, t = self.config, self.config.train
    tokens_per_step = t.batch_size * config.data.seq_len
    flops_per_token = flops.training_flops_per_token(config.model, config.data.seq_len,
                                                     lora.param_count(config))
    peak = t.peak_flops or flops.datasheet_peak_flops()
    step = int(state.step)
    writer = metrics.MetricsWriter(self.workdir, step) if jax.process_index() == 0 else None
    if writer and writer.dropped:
      _say(f"dropped {writer.dropped} record(s) past step {step} from "
           f"{metrics.METRICS_FILE}: this run logs those steps again")
    summary = {"step": step, "stopped_by": None}
    last_eval = None   # (step, eval loss)
    if step == 0 and t.init_from:   # where fine-tuning starts from
      self._start_report(state, writer, summary)
    # Metrics of steps not yet checked, and of those checked but not yet logged; the
    # seconds those steps ran (evaluations, logging and saves left out).
    pending, unlogged, seconds, interval_start = [], [], 0.0, time.perf_counter()
    bar = tqdm.tqdm(total=t.steps, initial=step, desc="train", unit="step",
                    dynamic_ncols=True, disable=not t.progress_bar or jax.process_index() != 0)
    progress = metrics.Progress(bar)
    try:
      with StopSignal() as stop:
        while step < t.steps and not stop.requested:
          state, step_metrics = self.train_step(
              state, sharding.global_batch(next(self.batches), self.mesh), self.frozen)
          step += 1
          pending.append((step, step_metrics))
          progress.dispatched(step_metrics)
          done = step == t.steps
          evaluate = done or (t.eval_every and step % t.eval_every == 0)
          log = done or evaluate or stop.requested or step % t.log_every == 0
          save = done or step % config.checkpoint.save_every == 0
          if not (log or save or stop.requested):
            continue
          unlogged += _check_finite(pending, self.checkpointer, self.checkpoint_dir)
          pending = []
          progress.all_finished()
          seconds += time.perf_counter() - interval_start
          if log:
            record = metrics.train_record(unlogged, seconds, len(unlogged) * tokens_per_step,
                                   flops_per_token, peak)
            unlogged, seconds = [], 0.0
            if evaluate:
              record["eval_loss"] = self.evaluate(state.params)
              last_eval = (step, record["eval_loss"])
            if done:
              record["unigram_entropy"] = self.entropy
            if writer:
              writer.write(step, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            _say(metrics.log_line(step, t.steps, record))
          if save or stop.requested:
            self.checkpointer.save(state, self.batches.state())
          interval_start = time.perf_counter()
        summary.update(step=step, stopped_by=stop.requested)
    finally:
      bar.close()
      try:
        self.checkpointer.wait()
      finally:
        self.checkpointer.close()
        if writer:
          writer.close()
    return state, summary, last_eval

  def finish(self, state, summary: dict, last_eval) -> dict:
    """The final evaluation, loss plot and sample of a completed run; -> the summary."""
    config, workdir, step = self.config, self.workdir, summary["step"]
    if last_eval is None or last_eval[0] != step:
      last_eval = (step, self.evaluate(state.params))
    eval_loss = last_eval[1]
    summary.update(eval_loss=eval_loss, unigram_entropy=self.entropy, sample=None)
    _say(metrics.final_report(eval_loss, self.entropy))
    if "start_eval_loss" in summary:
      _say(f"eval loss {summary['start_eval_loss']:.4f} -> {eval_loss:.4f} "
           f"({eval_loss / summary['start_eval_loss'] - 1:+.1%}) from "
           f"{config.train.init_from}")
    written = {}
    if jax.process_index() == 0:
      metrics.plot_losses(metrics.read_records(workdir),
                          os.path.join(workdir, metrics.PLOT_FILE), reference=self.entropy)
      written = {"config": self.config_file, "checkpoints": self.checkpoint_dir,
                 "metrics": os.path.join(workdir, metrics.METRICS_FILE),
                 "plot": os.path.join(workdir, metrics.PLOT_FILE)}
    if config.sample.max_new_tokens:
      with sharding.activate(self.mesh):   # LoRA adapters run beside their base, unmerged
        summary["sample"] = _generate(config, self.combine(self.frozen, state.params),
                                      self.tokenizer)
      _say(f"sample: {summary['sample']!r}")
      if jax.process_index() == 0:
        written["sample"] = os.path.join(workdir, SAMPLE_FILE)
        workdir_lib.write_atomically(written["sample"], summary["sample"])
    for what, path in written.items():
      _say(f"{what:>11}: {path}")
    return summary
