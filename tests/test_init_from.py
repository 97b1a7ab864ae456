"""Runs that start from a checkpoint (train.init_from), and what a workdir keeps: its
config, its lock."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import sharding
from gemma_jax.training import workdir as workdir_lib
from gemma_jax.training import checkpoints, data, init_from, loop
from gemma_jax.text import tokenizers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, num_hidden_layers=3, sliding_window=8,
                rms_norm_eps=1e-6)


def run_config(corpus, **train):
  """A two-step run on the corpus; the model section is whatever init_from gives."""
  config = gj.get_config("gemma3-tiny")
  config.data.path = corpus
  config.data.seq_len = 32
  config.data.eval_fraction = 0.1
  config.train.update(dict(dict(steps=2, batch_size=8, log_every=1, eval_every=0,
                                eval_batches=1, progress_bar=False, peak_flops=1e9), **train))
  config.optimizer.warmup_steps = 0
  config.checkpoint.save_every = 2
  config.sample.max_new_tokens = 0
  return config


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
  """A random transformers Gemma 3 saved with save_pretrained: (model, directory)."""
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**HF_SHAPE)).eval()
  path = str(tmp_path_factory.mktemp("hf"))
  model.save_pretrained(path)
  return model, path


def test_config_round_trips_through_the_workdir(tmp_path):
  config = gj.get_config("gemma4-moe-tiny")
  config.model.attention_pattern = ("local", "global", "global")
  config.data.path = "a/*.txt,b/*.jsonl"
  config.optimizer.no_decay = ("norm", "bias")
  config.train.init_from = "/some/dir"
  workdir_lib.save_config(str(tmp_path), config)
  loaded = workdir_lib.load_config(str(tmp_path))
  assert loaded.to_dict() == config.to_dict()
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(tmp_path / "config.json").st_mode & 0o777 == 0o666 & ~umask   # not 0600
  assert loaded.model.attention_pattern == ("local", "global", "global")   # tuples stay tuples
  with pytest.raises(AttributeError):
    loaded.train.stepz = 3   # locked, as every config
  saved = json.loads((tmp_path / "config.json").read_text())
  saved["train"]["stepz"] = 3
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(workdir_lib.WorkdirError, match=r"config\.json.*train.*'stepz'"):
    workdir_lib.load_config(str(tmp_path))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["train"].update(steps="2"), r"config\.json\.train: config field 'steps': "),
    (lambda c: c["model"].update(num_layers=2.5), r"config\.json\.model: config field "
     r"'num_layers': "),
    (lambda c: c.update(lora=None), r"config\.json: config field 'lora' is a section, got None")])
def test_a_config_file_edited_with_a_wrong_type_is_one_error(tmp_path, edit, message):
  """A value of the wrong type, or a section replaced by a value, had ended in a raw
  TypeError or AttributeError from ml_collections."""
  workdir_lib.save_config(str(tmp_path), gj.get_config("gemma3-tiny"))
  saved = json.loads((tmp_path / "config.json").read_text())
  edit(saved)
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(workdir_lib.WorkdirError, match=message):
    workdir_lib.load_config(str(tmp_path))


_HOLD = """
import sys, time
from gemma_jax.training import workdir
with workdir.lock(sys.argv[1]):
  print("held", flush=True)
  time.sleep(60)
"""


def _holder(workdir):
  process = subprocess.Popen([sys.executable, "-c", _HOLD, workdir], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
  assert process.stdout.readline().strip() == "held"
  return process


def test_a_second_run_on_a_workdir_in_use_is_refused_naming_the_holder(tmp_path, corpus):
  holder = _holder(str(tmp_path))
  try:
    with pytest.raises(workdir_lib.WorkdirError, match=f"in use by process {holder.pid} on"):
      loop.train(run_config(corpus), str(tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
  finally:
    holder.kill()
    holder.wait()
  # Killed without any clean-up: the kernel released its lock.
  with workdir_lib.lock(str(tmp_path)):
    pass


@pytest.mark.slow
def test_training_from_a_transformers_checkpoint_starts_from_its_weights(
    hf_checkpoint, corpus, tmp_path):
  model, path = hf_checkpoint
  config = run_config(corpus, steps=1, init_from=path, log_every=1)
  summary = loop.train(config, str(tmp_path))
  assert summary["step"] == 1
  saved = workdir_lib.load_config(str(tmp_path))
  assert (saved.model.d_model, saved.model.num_layers, saved.model.vocab_size) == (32, 3, 300)
  assert saved.train.init_from == os.path.abspath(path) and saved.data.tokenizer == "byte"
  # The weights init_from places are the checkpoint's: our logits on the first training
  # batch (rebuilt from the seed) equal transformers' on each row's first document
  # (transformers sees whole rows, so only there are both computing the same thing).
  tokenizer = tokenizers.get_tokenizer("byte", 300)
  rows, _ = data.load_splits(saved.data, tokenizer, saved.seed)
  batch = data.TrainBatches(rows, 8, saved.seed).batch(0)
  logits = np.asarray(gj.transform(saved).apply(
      init_from.base_params(saved), jnp.asarray(batch["tokens"]),
      positions=jnp.asarray(batch["positions"]), segment_ids=jnp.asarray(batch["segment_ids"])))
  with torch.no_grad():
    expected = model(torch.as_tensor(batch["tokens"]).long(),
                     position_ids=torch.as_tensor(batch["positions"]).long()).logits.numpy()
  first = np.cumsum(batch["positions"] == 0, axis=1) == 1
  np.testing.assert_allclose(logits[first], expected[first], atol=1e-4)
  # And the run's first logged loss (before its update) is theirs: the weighted
  # cross-entropy of those logits over the whole batch.
  logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  start, first_step = [json.loads(line)
                       for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose(first_step["loss"], (nll * batch["weights"]).sum()
                             / batch["weights"].sum(), rtol=1e-5)
  # Before training, the run evaluated the checkpoint's weights: step 0.
  assert start["step"] == 0 and start["eval_loss"] == summary["start_eval_loss"]


@pytest.mark.slow
def test_weights_load_straight_onto_a_mesh(hf_checkpoint, corpus, tmp_path):
  """base_params(config, mesh) of a transformers directory and of a LoRA workdir trained
  from it (restored onto the mesh, adapters merged) equal the host load, laid out by the
  sharding rules (fsdp 8: every kernel and the embedding split)."""
  _, path = hf_checkpoint
  workdir = str(tmp_path / "lora")
  tuned = run_config(corpus, init_from=path)
  tuned.lora.update(rank=4, alpha=8.0)
  loop.train(tuned, workdir)
  mesh_config = gj.get_config("gemma3-tiny").mesh
  mesh_config.update(data=1, fsdp=8)
  mesh = sharding.make_mesh(mesh_config)
  for source in (path, workdir):
    config = init_from.resolve(run_config(corpus, init_from=source))
    placed = init_from.base_params(config, mesh)
    layouts = sharding.param_shardings(config, mesh)
    for ours, whole, layout in zip(jax.tree.leaves(placed),
                                   jax.tree.leaves(init_from.base_params(config)),
                                   jax.tree.leaves(layouts)):
      assert ours.sharding == layout
      np.testing.assert_allclose(np.asarray(ours), whole, rtol=1e-6, atol=1e-7)
    kernels = [a for p, a in jax.tree_util.tree_leaves_with_path(placed)
               if jax.tree_util.keystr(p).endswith(("['kernel']", "['embedding']"))]
    assert kernels and all(not a.sharding.is_fully_replicated for a in kernels), source


def test_a_model_flag_contradicting_the_checkpoint_is_named(hf_checkpoint, corpus, tmp_path):
  _, path = hf_checkpoint
  config = run_config(corpus, init_from=path)
  config.model.d_model = 64
  with pytest.raises(gj.ConfigError, match=r"config\.model\.d_model: 64 contradicts the "
                     r"checkpoint .* \(32\)"):
    loop.train(config, str(tmp_path), model_overrides={"d_model"})
  # A compute option may be set; the same d_model, unset by the user, is taken from it.
  config.model.dtype = "bfloat16"
  resolved = init_from.resolve(config, {"dtype"})
  assert (resolved.model.d_model, resolved.model.dtype) == (32, "bfloat16")


@pytest.mark.parametrize("from_itself", [False, True])
def test_a_transformers_directory_is_refused_as_a_workdir(hf_checkpoint, corpus, tmp_path,
                                                          from_itself):
  """Its config.json would be replaced by the run's (the checkpoint no longer loads), and a
  start from itself failed after making checkpoints/ there, after which init_from took
  it for a workdir. Refused before anything is written; a copy is used so the shared
  fixture stays whole."""
  _, path = hf_checkpoint
  copy = tmp_path / "hf"
  shutil.copytree(path, copy)
  before = {name: (copy / name).read_bytes() for name in os.listdir(copy)}
  config = run_config(corpus, init_from=str(copy) if from_itself else None)
  with pytest.raises(workdir_lib.WorkdirError, match=re.escape(
      f"{copy} holds a config.json that is not a training run's")):
    loop.train(config, str(copy))
  assert {name: (copy / name).read_bytes() for name in os.listdir(copy)} == before
  gj.hf.load(str(copy))


@pytest.mark.parametrize("files, message", [
    (None, "nowhere': no such directory"),
    ({}, "nowhere' is neither a transformers directory"),
    ({"adapter_config.json": "{}"}, "nowhere' holds peft adapters, not a model: start from "
                                    "their base"),
])
def test_init_from_a_path_that_is_no_checkpoint_is_one_error(corpus, tmp_path, files, message):
  if files is not None:
    (tmp_path / "nowhere").mkdir()
    for name, text in files.items():
      (tmp_path / "nowhere" / name).write_text(text)
  config = run_config(corpus, init_from=str(tmp_path / "nowhere"))
  with pytest.raises(gj.ConfigError, match=r"config\.train\.init_from: .*" + message):
    loop.train(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_workdir_with_checkpoints_resumes_instead_of_reading_init_from(
    hf_checkpoint, corpus, tmp_path):
  _, path = hf_checkpoint
  workdir = str(tmp_path / "run")
  loop.train(run_config(corpus, steps=2, init_from=path), workdir)
  result = subprocess.run(
      [sys.executable, "experiments/train.py", "--config=configs/gemma3_tiny.py",
       f"--workdir={workdir}", f"--config.train.init_from={path}", "--config.train.steps=3",
       f"--config.data.path={corpus}", "--config.data.seq_len=32", "--config.train.batch_size=8",
       "--config.train.eval_batches=1", "--config.data.eval_fraction=0.1",
       "--config.optimizer.warmup_steps=0", "--config.checkpoint.save_every=2",
       "--config.train.progress_bar=False", "--config.train.peak_flops=1e9",
       "--config.sample.max_new_tokens=0"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "resumed from step 2" in result.stderr + result.stdout
  assert "init_from is read only for a new run" in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flag,message", [
    ("--config.model.num_layers=5", "config.model.num_layers: 5 contradicts"),
    ("--noconfig.model.norm_plus_one", "config.model.norm_plus_one: False contradicts"),
    ("flagfile", "config.model.num_layers: 5 contradicts")])
def test_train_app_names_a_contradicting_model_flag_in_one_line(hf_checkpoint, tmp_path, flag,
                                                                message):
  """However the flag is given (a --no form or a --flagfile's line too, which a match on
  argv had missed, so the checkpoint's value was taken without a word)."""
  _, path = hf_checkpoint
  if flag == "flagfile":
    (tmp_path / "flags.txt").write_text("--config.model.num_layers=5\n")
    flag = f"--flagfile={tmp_path / 'flags.txt'}"
  result = subprocess.run(
      [sys.executable, "experiments/train.py", "--config=configs/gemma3_tiny.py",
       f"--workdir={tmp_path / 'run'}", f"--config.train.init_from={path}", flag],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and f"{message} the checkpoint" in lines[0], lines


@pytest.mark.slow
def test_a_lora_run_keeps_the_step_of_the_workdir_it_adapts(corpus, tmp_path):
  """LoRA over a training workdir's weights, whose run then trains on: the LoRA model, as
  the apps load it and as its run resumes, stays over the step it was trained on (it
  followed the base's latest checkpoint); train.init_from_step picks a kept step and
  names a missing one."""
  tiny = dict(vocab_size=262, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
              num_layers=2, attention_pattern=("local", "global"), sliding_window=8)
  base, tuned = str(tmp_path / "base"), str(tmp_path / "lora")

  def train_base(steps, keep=5):
    config = run_config(corpus, steps=steps)
    config.model.update(tiny)
    config.checkpoint.update(save_every=1, keep=keep)
    loop.train(config, base)

  def lora_config(**train):
    config = run_config(corpus, init_from=base, **train)
    config.lora.rank = 2
    return config

  train_base(2)
  loop.train(lora_config(steps=1), tuned)
  assert workdir_lib.load_config(tuned).train.init_from_step == 2
  _, before = init_from.merged(workdir_lib.load_config(tuned), tuned)
  train_base(3)   # the base trains on
  _, after = init_from.merged(workdir_lib.load_config(tuned), tuned)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  loop.train(lora_config(steps=2), tuned)   # resumed: its base stays at step 2
  assert workdir_lib.load_config(tuned).train.init_from_step == 2
  assert init_from.resolve(lora_config(init_from_step=1)).train.init_from_step == 1
  with pytest.raises(gj.ConfigError, match=r"config\.train\.init_from_step: .*base holds the "
                     r"checkpoints of steps 1, 2, 3, not of step 7"):
    init_from.resolve(lora_config(init_from_step=7))
  # The base trains on, keeping 2 steps: it keeps the one the LoRA workdir adapts too
  # (its keep rotation had deleted it, after which the LoRA workdir no longer loaded),
  # until that workdir is gone.
  _, resumed = init_from.merged(workdir_lib.load_config(tuned), tuned)
  train_base(6, keep=2)
  assert checkpoints.Checkpointer(workdir_lib.checkpoint_dir(base), 1).all_steps() == (2, 5, 6)
  _, kept = init_from.merged(workdir_lib.load_config(tuned), tuned)
  jax.tree.map(np.testing.assert_array_equal, kept, resumed)
  shutil.rmtree(tuned)
  train_base(7, keep=2)
  assert checkpoints.Checkpointer(workdir_lib.checkpoint_dir(base), 1).all_steps() == (6, 7)


def test_load_model_names_a_directory_given_as_the_other_kind(hf_checkpoint, tmp_path):
  """A workdir as hf_dir had failed on 'unsupported model_type None', a transformers
  directory as workdir on its 'architectures' key."""
  _, path = hf_checkpoint
  workdir_lib.save_config(str(tmp_path), gj.get_config("gemma3-tiny"))
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(workdir_lib.WorkdirError, match=re.escape(
      f"{tmp_path} is a training workdir, not a transformers directory: load it as "
      "workdir=")):
    init_from.load_model(hf_dir=str(tmp_path))
  with pytest.raises(workdir_lib.WorkdirError, match=re.escape(
      f"{path} is no training workdir (a transformers directory?): load it as hf_dir=")):
    init_from.load_model(workdir=path)
