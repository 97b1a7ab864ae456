"""Nothing lost, nothing injected: a run's files survive what stops it part way.

A torn last line of metrics.jsonl, a checkpoint with flipped bytes, a deleted file or a
bad data position, a disk that fills during a save, Ctrl-C at any stage: each is one
clear error or a clean stop, and the workdir stays usable. The damage is done to real
files (orbax's own), the limits and signals to real processes.
"""

import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.training import checkpoints, loop, metrics, optimizer, steps
from test_training import REPO, run_app, tiny_config, write_config_file


def short_config(corpus, steps_=2):
  """tiny_config saving every step, with no warm-up and no sample."""
  config = tiny_config(corpus)
  config.train.steps, config.optimizer.warmup_steps = steps_, 0
  config.checkpoint.save_every, config.sample.max_new_tokens = 1, 0
  return config


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
  """A workdir whose run saved steps 1 and 2, and its config."""
  workdir = tmp_path_factory.mktemp("saved") / "run"
  loop.train(short_config(corpus), str(workdir))
  return workdir


@pytest.fixture
def run_copy(saved_run, tmp_path):
  """A copy of `saved_run` to damage."""
  workdir = tmp_path / "run"
  shutil.copytree(saved_run, workdir)
  return workdir


# 3. metrics.jsonl: records whole, a torn last line dropped.

@pytest.mark.slow
def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_warning(corpus, run_copy, caplog):
  """A run killed mid-write left half a record: the resume used to end in a bare
  JSONDecodeError; now it drops that half, says so naming the file, and logs step 3."""
  path = run_copy / metrics.METRICS_FILE
  whole = path.read_text()
  path.write_text(whole + '{"step": 3, "loss": 5.4')
  assert loop.train(short_config(corpus, 3), str(run_copy))["step"] == 3
  text = path.read_text()
  assert text.startswith(whole) and text.endswith("\n")
  records = [json.loads(line) for line in text.splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert np.isfinite(records[-1]["loss"]) and records[-1]["loss"] != 5.4
  warnings = [r.getMessage() for r in caplog.records if "torn record" in r.getMessage()]
  assert len(warnings) == 1 and str(path) in warnings[0]


@pytest.mark.slow
def test_a_record_cut_short_by_a_file_size_limit_leaves_whole_lines(tmp_path):
  """Under a file size limit that cuts the 4th record (a full disk), the write fails
  with the OS error naming the file, the file keeps the 3 whole records, and the next
  run appends after them."""
  script = textwrap.dedent(f"""
      import os, resource
      from gemma_jax.training import metrics
      writer = metrics.MetricsWriter({str(tmp_path)!r}, 0)
      for step in (1, 2, 3):
        writer.write(step, {{"loss": 5.0 - step}})
      size = os.path.getsize(os.path.join({str(tmp_path)!r}, metrics.METRICS_FILE))
      resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))
      try:
        writer.write(4, {{"loss": 1.0, "grad_norm": 0.5}})
      except OSError as error:
        print(error)
      """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=False)
  path = tmp_path / metrics.METRICS_FILE
  lines = path.read_text().split("\n")
  assert lines[-1] == "" and [json.loads(line)["step"] for line in lines[:-1]] == [1, 2, 3]
  assert result.stdout == f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{path}'\n", (
      result.stderr)
  writer = metrics.MetricsWriter(str(tmp_path), 3)
  writer.write(4, {"loss": 1.0})
  writer.close()
  assert [r["step"] for r in metrics.read_records(str(tmp_path))] == [1, 2, 3, 4]


# 4. Checkpoints: checked on restore, the step and file named, an intact step offered.

def largest_file(directory):
  return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_flipped_bytes_in_a_checkpoint_name_the_step_the_file_and_the_intact_step(corpus,
                                                                                run_copy):
  """Bytes flipped in step 2's largest array file had loaded silently; the resume now
  names the step and the file and offers step 1, from which it then goes on."""
  step_dir = run_copy / "checkpoints" / "2"
  damaged = largest_file(step_dir / "state")
  data = bytearray(damaged.read_bytes())
  data[len(data) // 2:len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2:
                                                                          len(data) // 2 + 8])
  damaged.write_bytes(bytes(data))
  with pytest.raises(checkpoints.CheckpointError) as error:
    loop.train(short_config(corpus, 3), str(run_copy))
  relative = damaged.relative_to(step_dir)
  assert str(error.value) == (
      f"the checkpoint of step 2 in {run_copy / 'checkpoints'} is corrupt: {relative} "
      "differs from the file saved (its sha256 in checksums.json); move "
      f"{step_dir} away to use step 1 (intact)")
  shutil.move(str(step_dir), str(run_copy / "step_2_damaged"))
  summary = loop.train(short_config(corpus, 3), str(run_copy))
  assert summary["step"] == 3 and np.isfinite(summary["eval_loss"])


def test_a_deleted_metadata_file_is_damage_not_a_config_mismatch(corpus, run_copy):
  (run_copy / "checkpoints" / "2" / "state" / "_METADATA").unlink()
  with pytest.raises(checkpoints.CheckpointError, match=(
      r"step 2 .* is corrupt: state/_METADATA is missing; move \S+/2 away to use step 1 "
      r"\(intact\)$")):
    loop.train(short_config(corpus, 3), str(run_copy))


def test_with_every_step_damaged_no_step_is_offered(corpus, run_copy):
  for step in (1, 2):
    (run_copy / "checkpoints" / str(step) / "data" / "metadata").write_text('{"next_row": 8}')
  with pytest.raises(checkpoints.CheckpointError, match=(
      r"step 2 .* is corrupt: data/metadata differs from the file saved .*; no other step "
      r"is intact \(1 neither\)$")):
    loop.train(short_config(corpus, 3), str(run_copy))


def test_a_step_saved_without_checksums_is_restored_with_a_warning(corpus, run_copy, caplog):
  """Steps saved before checksums were kept still resume."""
  (run_copy / "checkpoints" / "2" / "checksums.json").unlink(missing_ok=True)
  assert loop.train(short_config(corpus, 3), str(run_copy))["step"] == 3
  assert any("step 2" in r.getMessage() and "restored unchecked" in r.getMessage()
             for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("position, problem", [
    ({}, "the data position {} has no next_row"),
    ({"next_row": -8, "seed": 0, "rows": 10}, "has next_row -8, not an int >= 0"),
    ({"next_row": "16", "seed": 0, "rows": 10}, "has next_row '16', not an int >= 0"),
])
def test_a_bad_saved_data_position_is_one_error(corpus, run_copy, position, problem):
  """A step whose files are as saved but whose data position no run could have saved:
  one CheckpointError naming the step and the file, not a KeyError traceback or a run
  from a negative row."""
  config = short_config(corpus, 3)
  directory = run_copy / "checkpoints"
  model = gj.transform(config)
  tx = optimizer.make_optimizer(config.optimizer, lambda _: 1.0)
  like = jax.eval_shape(lambda: steps.init_state(model, tx, 0, config.data.seq_len))
  checkpointer = checkpoints.Checkpointer(str(directory), 3)
  state, _ = checkpointer.restore(like)
  checkpointer.save(state._replace(step=state.step + 1), position)
  checkpointer.wait()
  checkpointer.close()
  config.train.steps = 4
  with pytest.raises(checkpoints.CheckpointError) as error:
    loop.train(config, str(run_copy))
  message = str(error.value)
  assert message.startswith(f"the checkpoint of step 3 in {directory} holds a data position "
                            "this run cannot go on from (data/metadata: ")
  assert problem in message and message.endswith(f"; move {directory / '3'} away to use "
                                                 "step 2 (intact)")


# 10. A full disk during a save: one line naming the path and the OS error.

@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_detail_goes_to_the_log(corpus, tmp_path):
  """Files capped at 100 kB (Python ignores SIGXFSZ, so writes fail with EFBIG): orbax
  fails to write step 1's arrays, in hundreds of lines of tracebacks from its threads;
  the console gets one line, train.log the tracebacks. The compilation cache is off: its
  files would hit the cap too."""
  workdir = tmp_path / "run"
  limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, -1))"
  result = subprocess.run(
      [sys.executable, "-c", f"{limit}; import runpy, sys; sys.argv = sys.argv[1:]; "
       "runpy.run_path(sys.argv[0], run_name='__main__')",
       os.path.join(REPO, "experiments", "train.py"),
       f"--config={write_config_file(tmp_path, corpus, 3)}", f"--workdir={workdir}",
       "--config.checkpoint.save_every=1", "--compilation_cache_dir="],
      capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
  assert (result.returncode, result.stderr) == (1, (
      f"train.py: error: writing the checkpoint {workdir / 'checkpoints' / '1'} failed: "
      f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}; the steps saved before are kept: "
      "none\n"))
  log = (workdir / "train.log").read_text()
  assert "Traceback (most recent call last)" in log and "File too large" in log
  assert [r["step"] for r in metrics.read_records(str(workdir))] == [1, 2]   # 2 is due
  # With room again, the run starts afresh (no step was saved) and the failed save's
  # staging directory goes; a reader leaves it (it could be a save under way).
  checkpoints.Checkpointer(str(workdir / "checkpoints"), 3).close()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1.orbax-checkpoint-tmp"]
  assert loop.train(workdir_lib.load_config(str(workdir)), str(workdir))["step"] == 3
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2", "3"]
  assert [r["step"] for r in metrics.read_records(str(workdir))] == [1, 2, 3]


# 12. Ctrl-C at any stage: one line and status 130, or the loop's clean stop.

WORKDIR_FILES = {workdir_lib.LOCK_FILE, workdir_lib.CONFIG_FILE, workdir_lib.CHECKPOINT_DIR,
                 metrics.METRICS_FILE, metrics.PLOT_FILE, "tensorboard", "train.log"}


def assert_nothing_half_written(workdir):
  """Every file of the workdir whole: no staging files, a config that loads, records
  that parse, only finished checkpoint steps."""
  if not workdir.exists():
    return
  assert set(os.listdir(workdir)) <= WORKDIR_FILES, os.listdir(workdir)
  if (workdir / workdir_lib.CONFIG_FILE).exists():
    workdir_lib.load_config(str(workdir))
  if (workdir / metrics.METRICS_FILE).exists():
    text = (workdir / metrics.METRICS_FILE).read_text()
    assert text == "" or text.endswith("\n")
    for line in text.splitlines():
      json.loads(line)
  if (workdir / workdir_lib.CHECKPOINT_DIR).exists():
    assert all(name.isdigit() for name in os.listdir(workdir / workdir_lib.CHECKPOINT_DIR))


def interrupt(args, when):
  """(status, stdout, stderr) of train.py sent SIGINT once `when(stdout so far)` holds."""
  process = run_app(*args, env={**os.environ, "PYTHONUNBUFFERED": "1"})
  out, err = [], []

  def read(stream, lines):
    for line in stream:
      lines.append(line)

  readers = [threading.Thread(target=read, args=pair) for pair in
             ((process.stdout, out), (process.stderr, err))]
  for reader in readers:
    reader.start()
  deadline = time.time() + 180
  while not when("".join(out)):
    if process.poll() is not None or time.time() > deadline:
      process.kill()
      pytest.fail(f"train.py ended before its SIGINT: {''.join(out)}{''.join(err)}")
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  try:
    process.wait(timeout=120)
  except subprocess.TimeoutExpired:
    process.kill()
    pytest.fail(f"train.py went on after SIGINT: {''.join(out)[-500:]}{''.join(err)}")
  finally:
    for reader in readers:
      reader.join()
  return process.returncode, "".join(out), "".join(err)


@pytest.mark.slow
def test_ctrl_c_at_any_stage_is_one_line_and_status_130_or_a_clean_stop(corpus, tmp_path):
  """Ctrl-C while importing, loading, compiling, starting the steps, training, and
  restoring a checkpoint to resume, one run after another in one workdir; a last run
  goes on from what they left and logs each step once."""
  workdir = tmp_path / "run"
  args = [f"--config={write_config_file(tmp_path, corpus, 100000)}", f"--workdir={workdir}",
          "--config.train.peak_flops=0"]   # 0: the datasheet's, none on a CPU
  records = lambda: (metrics.read_records(str(workdir))
                     if (workdir / metrics.METRICS_FILE).exists() else [])
  # When to send SIGINT, given the time the run started, the records there were then,
  # and its output so far.
  stages = [
      ("importing", lambda start, logged, out: time.time() > start + 0.3),
      ("loading or compiling", lambda start, logged, out: "data:" in out),
      ("starting the steps",
       lambda start, logged, out: "compiled the train and eval steps" in out),
      ("training", lambda start, logged, out: len(records()) > logged),
      ("restoring", lambda start, logged, out: "data:" in out),
  ]
  stopped_at = None
  for stage, when in stages:
    status, out, err = interrupt(args, functools.partial(when, time.time(), len(records())))
    if status == 0:   # the loop's own stop, with a checkpoint of the step reached
      assert err == "", (stage, err)
      stopped_at = int(out.split("stopped by SIGINT at step ")[1].split(";")[0])
      assert stopped_at in checkpoints.Checkpointer(str(workdir / "checkpoints"), 1).all_steps()
    else:
      assert (status, err) == (130, "train.py: interrupted\n"), (stage, status, err)
    if stage == "importing":
      assert out == "" and not workdir.exists()
    if stage == "training":
      assert status == 0
    assert_nothing_half_written(workdir)
  final = run_app(*args, f"--config.train.steps={stopped_at + 2}")
  out, err = final.communicate(timeout=300)
  assert final.returncode == 0, err
  assert f"resumed from step {stopped_at}" in out
  assert [r["step"] for r in records()] == list(range(1, stopped_at + 3))
