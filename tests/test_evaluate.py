"""Evaluation: evaluate() and experiments/eval.py against a float64 numpy loss, and
against the training loop's own evaluation of the same batches."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import gemma_jax as gj
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.training import data, evaluate, init_from, loop
from gemma_jax.text import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(REPO, "configs", "data", "chat_small.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir of a short byte-level run on the shipped chat file: (workdir, summary)."""
  config = gj.get_config("gemma3-tiny")
  config.model.update(num_layers=2, attention_pattern=("local", "global"), sliding_window=16)
  config.data.update(path=CHAT, seq_len=128, eval_fraction=0.05)
  # eval_batches x batch_size covers the whole held-out split (35 conversations).
  config.train.update(steps=4, batch_size=8, log_every=2, eval_every=0, eval_batches=8,
                      progress_bar=False, peak_flops=1e9)
  config.optimizer.warmup_steps = 1
  config.checkpoint.save_every = 4
  config.sample.max_new_tokens = 0
  workdir = str(tmp_path_factory.mktemp("run"))
  return workdir, loop.train(config, workdir)


def numpy_loss(config, params, rows):
  """Cross-entropy per weighted target in float64 from the model's logits."""
  total = weight = 0.0
  for start in range(0, len(rows), 8):
    batch = data.make_batch(rows.tokens[start:start + 8], rows.segment_ids[start:start + 8],
                            rows.loss_mask[start:start + 8])
    logits = np.asarray(gj.transform(config).apply(
        params, jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
        segment_ids=jnp.asarray(batch["segment_ids"])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    total += (nll * batch["weights"]).sum()
    weight += batch["weights"].sum()
  return total / weight, weight


@pytest.mark.slow
def test_evaluate_equals_numpy_and_the_training_loops_evaluation(trained):
  workdir, summary = trained
  config = workdir_lib.load_config(workdir)
  _, params = init_from.merged(config, workdir)
  tokenizer = tokenizers.get_tokenizer(config.data.tokenizer, config.model.vocab_size)
  _, held_out = data.load_splits(config.data, tokenizer, config.seed)
  figures = evaluate.evaluate(config, params, held_out, batch_size=8, progress=False)
  # The loop evaluated the same rows (the whole held-out split) at its last step.
  np.testing.assert_allclose(figures["loss"], summary["eval_loss"], rtol=1e-6)
  expected, weight = numpy_loss(config, params, held_out)
  np.testing.assert_allclose(figures["loss"], expected, rtol=1e-5)
  assert figures["tokens"] == weight
  np.testing.assert_allclose(figures["perplexity"], np.exp(expected), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [64, 5])
def test_evaluate_pads_fewer_rows_than_it_has_batches(trained, monkeypatch, batch_size):
  """A batch size past the row count runs the rows alone, and an uneven split spreads
  them evenly: the same loss as numpy's over the rows, with fewer padding rows than
  batches (the last batch had been filled up to the batch size)."""
  workdir, _ = trained
  config = workdir_lib.load_config(workdir)
  _, params = init_from.merged(config, workdir)
  tokenizer = tokenizers.get_tokenizer(config.data.tokenizer, config.model.vocab_size)
  _, held_out = data.load_splits(config.data, tokenizer, config.seed)
  n = min(11, len(held_out))
  held_out = data.Rows(held_out.tokens[:n], held_out.segment_ids[:n],
                       None if held_out.loss_mask is None else held_out.loss_mask[:n])
  shapes = []
  eval_batches = data.eval_batches

  def recording_eval_batches(*args, **kwargs):
    batches = eval_batches(*args, **kwargs)
    shapes.extend(batch["tokens"].shape[0] for batch in batches)
    return batches

  monkeypatch.setattr(data, "eval_batches", recording_eval_batches)
  figures = evaluate.evaluate(config, params, held_out, batch_size=batch_size, progress=False)
  np.testing.assert_allclose(figures["loss"], numpy_loss(config, params, held_out)[0],
                             rtol=1e-5)
  assert max(shapes) <= batch_size and 0 <= sum(shapes) - n < len(shapes), (n, shapes)


@pytest.mark.slow
def test_eval_app_prints_a_table_and_writes_json(trained, tmp_path):
  workdir, _ = trained
  out = tmp_path / "figures.json"
  result = subprocess.run([sys.executable, "experiments/eval.py", f"--workdir={workdir}",
                           f"--data={CHAT}", f"--json={out}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  figures = json.loads(out.read_text())
  config = workdir_lib.load_config(workdir)
  _, params = init_from.merged(config, workdir)
  tokenizer = tokenizers.get_tokenizer(config.data.tokenizer, config.model.vocab_size)
  with config.data.unlocked():
    config.data.path = CHAT
  expected, weight = numpy_loss(config, params, data.load_all(config.data, tokenizer))
  np.testing.assert_allclose(figures["loss"], expected, rtol=1e-5)
  assert figures["tokens"] == weight and figures["rows"] > 0
  assert f"| {figures['rows']} x {config.data.seq_len} | {figures['tokens']:.0f} | " \
      f"{figures['loss']:.4f} | {figures['perplexity']:.3f} |" in result.stdout


@pytest.mark.slow
def test_a_quantized_evaluation_is_named_and_kept_beside_the_float_one(trained):
  workdir, _ = trained
  run = lambda *flags: subprocess.run([sys.executable, "experiments/eval.py",
                                       f"--workdir={workdir}", f"--data={CHAT}", *flags],
                                      cwd=REPO, capture_output=True, text=True, timeout=300)
  for flags in ([], ["--quant=int8_weights"]):
    result = run(*flags)
    assert result.returncode == 0, result.stderr
  plain = json.loads(open(os.path.join(workdir, "eval.json")).read())
  quantized = json.loads(open(os.path.join(workdir, "eval_int8_weights.json")).read())
  assert (plain["quant"], quantized["quant"]) == ("none", "int8_weights")
  assert f"| {workdir} (int8_weights) |" in result.stdout
  assert abs(quantized["loss"] / plain["loss"] - 1) < 0.01


@pytest.mark.slow
def test_eval_app_on_a_transformers_directory_writes_json_only_when_asked(trained, tmp_path):
  """The figures of --hf_dir went to ./eval.json, into whatever directory the user was in."""
  workdir, _ = trained
  hf_dir = tmp_path / "hf"
  assert subprocess.run([sys.executable, "experiments/export.py", f"--workdir={workdir}",
                         f"--out={hf_dir}"], cwd=REPO, capture_output=True,
                        timeout=300).returncode == 0
  (tmp_path / "cwd").mkdir()
  result = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "eval.py"),
                           f"--hf_dir={hf_dir}", f"--data={CHAT}", "--seq_len=128"],
                          cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "wrote" not in result.stdout and os.listdir(tmp_path / "cwd") == []
  assert "eval.json" not in os.listdir(hf_dir)


@pytest.mark.slow
def test_eval_app_names_a_missing_workdir_not_the_json_beside_it(tmp_path):
  result = subprocess.run([sys.executable, "experiments/eval.py",
                           f"--workdir={tmp_path / 'none'}", f"--data={CHAT}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "is not a training workdir" in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--data=/nowhere/*.jsonl"], "error: --data: no file matches '/nowhere/*.jsonl'"),
    (["--format=chat", "--data=README.md"], "error: --format: "),
    (["--data=README.md", "--seq_len=0"], "error: --seq_len: must be an integer >= 2, got 0"),
    (["--data=README.md", "--json=/nowhere/eval.json"],
     "--json: cannot write /nowhere/eval.json (no such folder, or not writable)"),
])
def test_eval_app_bad_data_is_one_error_line(trained, flags, message):
  workdir, _ = trained
  result = subprocess.run([sys.executable, "experiments/eval.py", f"--workdir={workdir}",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("eval.py: error: ") and message in lines[0], \
      result.stderr


@pytest.mark.slow
def test_eval_app_on_a_workdir_without_checkpoint_is_one_error_line(tmp_path):
  config = gj.get_config("gemma3-tiny")
  workdir_lib.save_config(str(tmp_path), config)
  (tmp_path / "checkpoints").mkdir()
  result = subprocess.run([sys.executable, "experiments/eval.py", f"--workdir={tmp_path}",
                           f"--data={CHAT}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip() == f"eval.py: error: {tmp_path}: no checkpoint in " \
      f"{tmp_path}/checkpoints yet"
