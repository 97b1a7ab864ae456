"""Saved checkpoint directories: written whole or not at all, and only where they are
ours (gemma_jax.checkpoints.directory, through hf.save and peft_adapters.save)."""

import copy
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

import gemma_jax as gj
from gemma_jax import lora
from gemma_jax.checkpoints import CheckpointError, directory, peft_adapters, safetensors_io

MARKER = directory.MARKER
SAVED = sorted([MARKER, "config.json", "model.safetensors"])


def random_model(seed, **shape):
  """A tiny transformers Gemma 3 with random weights."""
  torch.manual_seed(seed)
  return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
      vocab_size=128, hidden_size=48, intermediate_size=80, num_attention_heads=4,
      head_dim=16, **shape)).eval()


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
  """(config, params) loaded from a tiny transformers Gemma 3 checkpoint."""
  path = str(tmp_path_factory.mktemp("two_layers"))
  random_model(0, num_hidden_layers=2, num_key_value_heads=2).save_pretrained(path)
  return gj.hf.load(path)


def _saved_embedding(path):
  return gj.hf.load(path)[1]["embed"]["embedding"]


def _files(path):
  """{relative name: bytes} of every file under `path`."""
  return {os.path.relpath(os.path.join(folder, name), path):
          open(os.path.join(folder, name), "rb").read()
          for folder, _, names in os.walk(path) for name in names}


@pytest.mark.parametrize("exchange", [True, False])
def test_save_replaces_an_existing_checkpoint(tmp_path, monkeypatch, two_layers, exchange):
  """With renameat2 (Linux), one atomic swap (no rename that leaves `out` missing);
  without it, or off Linux, two renames. Either way the new checkpoint is in place and
  nothing else is left."""
  swapped = exchange and sys.platform.startswith("linux")
  config, params = two_layers
  out = str(tmp_path / "out")
  gj.hf.save(out, config, params)
  swaps, renames = [], []
  real_exchange, real_rename = directory._exchange, os.rename

  def maybe_exchange(a, b):
    swaps.append(exchange and real_exchange(a, b))
    return swaps[-1]

  def rename(src, dst):
    renames.append(dst)
    real_rename(src, dst)

  monkeypatch.setattr(directory, "_exchange", maybe_exchange)
  monkeypatch.setattr(os, "rename", rename)
  gj.hf.save(out, config, jax.tree.map(lambda x: 2 * x, params))
  assert swaps == [swapped]
  assert len(renames) == (0 if swapped else 2)
  np.testing.assert_array_equal(_saved_embedding(out), 2 * params["embed"]["embedding"])
  assert os.listdir(tmp_path) == ["out"] and sorted(os.listdir(out)) == SAVED


def test_save_syncs_the_new_checkpoint_before_the_swap(tmp_path, monkeypatch, two_layers):
  """Every file and the staging directory reach the disk before they replace `out`
  (files identified by inode: the tensors are synced under a temporary name, then
  renamed)."""
  config, params = two_layers
  out = str(tmp_path / "out")
  gj.hf.save(out, config, params)
  synced, at_swap = set(), []
  real_fsync, real_exchange = os.fsync, directory._exchange
  inode = lambda stat: (stat.st_dev, stat.st_ino)

  def fsync(fd):
    synced.add(inode(os.fstat(fd)))
    real_fsync(fd)

  def exchange(a, b):
    wanted = [a] + [os.path.join(a, name) for name in SAVED]
    at_swap.append({inode(os.stat(path)) for path in wanted} <= synced)
    return real_exchange(a, b)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(directory, "_exchange", exchange)
  gj.hf.save(out, config, params)
  assert at_swap == [True]


def test_save_failing_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                 two_layers):
  config, params = two_layers
  out = str(tmp_path / "out")
  gj.hf.save(out, config, params)
  before = _files(out)

  def write_part(path, tensors, metadata=None):
    with open(path, "wb") as f:
      f.write(b"\0" * 8)
    raise OSError("No space left on device")

  monkeypatch.setattr(safetensors_io, "write", write_part)
  with pytest.raises(OSError, match="No space left"):
    gj.hf.save(out, config, jax.tree.map(lambda x: 2 * x, params))
  assert _files(out) == before
  assert os.listdir(tmp_path) == ["out"]


def test_save_without_renameat2_restores_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                 two_layers):
  """The fallback's second rename (staging -> out) fails: the first one is undone."""
  config, params = two_layers
  out = str(tmp_path / "out")
  gj.hf.save(out, config, params)
  before = _files(out)
  real_rename = os.rename

  def rename(src, dst):
    if dst == out and not src.endswith("-old"):
      raise OSError("rename failed")
    real_rename(src, dst)

  monkeypatch.setattr(directory, "_exchange", lambda a, b: False)
  monkeypatch.setattr(os, "rename", rename)
  with pytest.raises(OSError, match="rename failed"):
    gj.hf.save(out, config, jax.tree.map(lambda x: 2 * x, params))
  assert _files(out) == before
  assert os.listdir(tmp_path) == ["out"]


def test_save_removes_staging_that_a_killed_save_left(tmp_path, two_layers):
  """A save killed mid-way (SIGKILL, the OOM killer) leaves its hidden staging directory;
  the next save into the same parent removes it. Kept: the staging of a live process,
  one from another host, any `-old` copy (a kill between the fallback's two renames
  leaves the only copy there) and the user's own dot-directories."""
  config, params = two_layers
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  host = socket.gethostname()
  abandoned = f".hf-save-{child.pid}@{host}-{'a' * 16}"
  kept = [f".hf-save-{os.getpid()}@{host}-{'b' * 16}",
          f".hf-save-{child.pid}@other-host-{'c' * 16}",
          f".hf-save-{child.pid}@{host}-{'d' * 16}-old", ".hf-save-notes"]
  for name in [abandoned] + kept:
    os.makedirs(tmp_path / name / "part")
  gj.hf.save(str(tmp_path / "out"), config, params)
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["out"])


@pytest.mark.parametrize("foreign", [
    {"vae_weights.safetensors": b"\0" * 64}, {"pytorch_model_notes.bin": b"notes"},
    {"README.md": b"# my model\n"}, {os.path.join("extra", "notes.txt"): b"notes"}],
    ids=["weights", "bin", "readme", "folder"])
def test_save_over_an_earlier_save_refuses_files_it_did_not_write(tmp_path, two_layers,
                                                                  foreign):
  """An earlier save's directory with a file the user put there: a save deleted such
  files as old weights (or kept some and not others). Refused, naming the file, with
  nothing changed; `overwrite` replaces the directory whole."""
  config, params = two_layers
  out = tmp_path / "out"
  gj.hf.save(str(out), config, params)
  for name, data in foreign.items():
    os.makedirs(os.path.dirname(out / name), exist_ok=True)
    (out / name).write_bytes(data)
  before = _files(out)
  top = next(iter(foreign)).split(os.sep)[0]
  with pytest.raises(CheckpointError, match=re.escape(
      f"{out}: holds {top}, which the earlier export did not write: move it away, or pass "
      "overwrite=True (export.py --overwrite) to replace it whole")):
    gj.hf.save(str(out), config, jax.tree.map(lambda x: 2 * x, params))
  assert _files(out) == before
  gj.hf.save(str(out), config, jax.tree.map(lambda x: 2 * x, params), overwrite=True)
  assert sorted(os.listdir(out)) == SAVED
  np.testing.assert_array_equal(_saved_embedding(str(out)), 2 * params["embed"]["embedding"])
  assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("files, what", [
    ({"vae_weights.safetensors": b"\0" * 64, "pytorch_model_notes.bin": b"notes",
      "config.json": b'{"model_type": "vae"}'},
     "holds a transformers model (config.json) that no export of this kind and run wrote"),
    ({"vae_weights.safetensors": b"\0" * 64, "pytorch_model_notes.bin": b"notes"},
     "holds files no export wrote (pytorch_model_notes.bin, vae_weights.safetensors)"),
], ids=["foreign_config", "weights_only"])
def test_save_refuses_a_directory_no_export_wrote(tmp_path, two_layers, files, what):
  """A directory of someone else's files lost them: a save deleted every *.safetensors,
  pytorch_model*.bin and config.json there. Refused with one line; `overwrite` replaces
  the directory whole, never a mix of theirs and ours."""
  config, params = two_layers
  out = tmp_path / "out"
  out.mkdir()
  for name, data in files.items():
    (out / name).write_bytes(data)
  with pytest.raises(CheckpointError, match=re.escape(f"{out}: {what}: export to a new or "
                                                      "empty directory, or pass overwrite")):
    gj.hf.save(str(out), config, params)
  assert _files(out) == files
  gj.hf.save(str(out), config, params, overwrite=True)
  assert sorted(os.listdir(out)) == SAVED


def test_save_with_overwrite_leaves_no_stale_shard(tmp_path, two_layers):
  """A bigger sharded checkpoint (and older weights) replaced by a one-file one: only the
  new files remain, so transformers reads the new weights."""
  config, params = two_layers
  out = str(tmp_path / "out")
  random_model(1, num_hidden_layers=4, num_key_value_heads=2).save_pretrained(
      out, max_shard_size="50KB")
  assert "model.safetensors.index.json" in os.listdir(out)
  with open(os.path.join(out, "pytorch_model.bin"), "wb") as f:   # older weights still
    f.write(b"stale")
  gj.hf.save(out, config, params, overwrite=True)
  assert sorted(os.listdir(out)) == SAVED
  model = transformers.Gemma3ForCausalLM.from_pretrained(out)
  np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(),
                                params["embed"]["embedding"])


def test_save_over_the_export_of_another_run_or_kind_is_refused(tmp_path, two_layers):
  """The marker says who wrote a directory: another workdir's export (or a plain save's)
  is not this one's to replace, nor are adapters a model's."""
  config, params = two_layers
  out = tmp_path / "out"
  gj.hf.save(str(out), config, params, source="/runs/a")
  before = _files(out)
  for source, owner in ((None, "/runs/a"), ("/runs/b", "/runs/a")):
    with pytest.raises(CheckpointError, match=re.escape(
        f"{out}: holds the export of {owner}, not of {source or 'this model'}")):
      gj.hf.save(str(out), config, params, source=source)
  lora_config = copy.deepcopy(config)
  lora_config.lora.update(rank=2, alpha=4.0)
  with pytest.raises(CheckpointError, match=re.escape(
      f"{out}: holds a transformers model, which this export of peft adapters would mix")):
    peft_adapters.save(str(out), lora_config, lora.init_adapters(lora_config, jax.random.key(0)),
                 source="/runs/a")
  assert _files(out) == before
  gj.hf.save(str(out), config, params, source="/runs/a")   # its own: replaced
  assert sorted(os.listdir(out)) == SAVED


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=3), r"missing parameters: \['layers_2/attn/k/kernel', .*"
                         r"'layers_2/pre_mlp_norm/scale'\]$"),
    (dict(num_layers=1), r"unexpected parameters: \['layers_1/attn/k/kernel', .*\]$"),
    (dict(mlp_dim=40), r"shape mismatches: \['layers_0/mlp/down/kernel: \(80, 48\) != "
                       r"expected \(40, 48\)', .*'layers_1/mlp/up/kernel: \(48, 80\) != "
                       r"expected \(48, 40\)'\]$"),
    ("adapters", r"unexpected parameters: \['layers_0/attn/k/lora_a', .*"
                 r"'layers_1/mlp/up/lora_b'\]; LoRA adapters are saved merged: save "
                 r"lora\.merge\(config, params\) with lora\.disabled\(config\)$"),
], ids=["fewer_layers", "more_layers", "mlp_dim", "unmerged_lora"])
def test_save_refuses_params_that_do_not_fit_the_config(tmp_path, two_layers, change, message):
  """Checked before anything is written: what transformers would otherwise load with
  missing layers initialised at random, or refuse."""
  config, params = two_layers
  config = copy.deepcopy(config)
  if change == "adapters":
    config.lora.rank = 4
    params = lora.combine(params, lora.init_adapters(config, jax.random.key(0)))
  else:
    config.model.update(change)
  with pytest.raises(gj.hf.CheckpointError, match=r"^params do not fit config\.model: "
                     + message):
    gj.hf.save(str(tmp_path / "out"), config, params)
  assert not os.listdir(tmp_path)


def test_save_refuses_a_path_that_is_a_file(tmp_path, two_layers):
  out = tmp_path / "out"
  out.write_bytes(b"not a directory")
  for overwrite in (False, True):
    with pytest.raises(CheckpointError, match=re.escape(f"{out}: exists and is not a")):
      gj.hf.save(str(out), *two_layers, overwrite=overwrite)
  assert out.read_bytes() == b"not a directory"
  assert os.listdir(tmp_path) == ["out"]


def test_new_checkpoint_directory_gets_the_mode_of_any_new_directory(tmp_path, two_layers):
  """Not tempfile's private 0700: other users may read what the umask lets them."""
  umask = os.umask(0o022)
  try:
    gj.hf.save(str(tmp_path / "out"), *two_layers)
    (tmp_path / "plain").mkdir()
  finally:
    os.umask(umask)
  assert os.stat(tmp_path / "out").st_mode == os.stat(tmp_path / "plain").st_mode
  assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o755


def test_save_never_replaces_a_training_run_or_a_folder_of_runs(tmp_path, two_layers):
  """`--out=runs` beside the workdirs in it: replacing the directory whole would delete
  them. Refused before anything is written, `overwrite` or not."""
  config, params = two_layers
  run = tmp_path / "runs" / "live"
  (run / "checkpoints").mkdir(parents=True)
  (run / "metrics.jsonl").write_text("{}\n")
  for out, overwrite, message in (
      (run, True, f"{run}: holds a training run's checkpoints"),
      (run.parent, False, f"{run.parent}: holds files no export wrote (live)"),
      (run.parent, True, f"{run.parent}: holds the training run live, which replacing")):
    with pytest.raises(CheckpointError, match=re.escape(message)):
      gj.hf.save(str(out), config, params, overwrite=overwrite)
  assert sorted(_files(tmp_path)) == [os.path.join("runs", "live", "metrics.jsonl")]


def test_a_new_tokenizer_replaces_every_file_of_the_old_one(tmp_path, two_layers):
  """A save with a SentencePiece tokenizer over one with a tokenizer.json: the old
  tokenizer.json had stayed, and transformers (and load_model) read it instead."""
  config, params = two_layers
  out = tmp_path / "out"

  def writer(**files):
    return lambda staging: [open(os.path.join(staging, name), "w").write(text)
                            for name, text in files.items()]

  gj.hf.save(str(out), config, params, write_extra=writer(
      **{"tokenizer.json": "{}", "tokenizer_config.json": "{}"}))
  gj.hf.save(str(out), config, params, write_extra=writer(**{"tokenizer.model": "sp"}))
  assert sorted(os.listdir(out)) == sorted(SAVED + ["tokenizer.model"])


def test_save_through_a_symlink_writes_into_its_directory(tmp_path, two_layers):
  config, params = two_layers
  (tmp_path / "real").mkdir()
  (tmp_path / "link").symlink_to("real")
  for _ in range(2):   # new, then over its own save
    gj.hf.save(str(tmp_path / "link"), config, params)
  assert os.readlink(tmp_path / "link") == "real"
  assert sorted(os.listdir(tmp_path)) == ["link", "real"]
  assert sorted(os.listdir(tmp_path / "real")) == SAVED
  np.testing.assert_array_equal(_saved_embedding(str(tmp_path / "real")),
                                params["embed"]["embedding"])
