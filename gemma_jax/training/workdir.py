"""A training workdir: the config it was run with, the lock of the run using it, and the
model apps read back from it.

    WORKDIR/config.json     the resolved config, written when a run starts
    WORKDIR/checkpoints/    orbax checkpoints by step (gemma_jax.training.checkpoints)
    WORKDIR/.lock           held (flock) by the one process training in it
    WORKDIR/pins/           the steps LoRA runs over this workdir adapt: kept by its run

What apps read back from a workdir (its model, LoRA merged) is
`gemma_jax.training.init_from.load_model`.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import tempfile
from typing import List, Set

from ml_collections import config_dict

from gemma_jax import config as config_lib

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
LOCK_FILE = ".lock"
PINS_DIR = "pins"


class WorkdirError(ValueError):
  """A workdir is missing what was asked of it, or is in use by another run."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def is_workdir(path: str) -> bool:
  """Whether `path` holds a training run's config (a transformers directory does not)."""
  return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isdir(
      os.path.join(path, CHECKPOINT_DIR))


def write_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` through a staging file in the same directory, renamed over
  it once on disk: a reader (or a crash) sees the old file or the new, never part."""
  fd, staging = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                                 prefix=f".{os.path.basename(path)}-")
  umask = os.umask(0)
  os.umask(umask)
  os.fchmod(fd, 0o666 & ~umask)   # a plain new file's mode (mkstemp's is 0600)
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(staging, path)


def save_config(workdir: str, config: config_dict.ConfigDict) -> str:
  """Writes the config to WORKDIR/config.json atomically; returns the path."""
  path = os.path.join(workdir, CONFIG_FILE)
  write_atomically(path, json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
  return path


def _update(target: config_dict.ConfigDict, values: dict, where: str) -> None:
  """Sets `values` onto the locked schema section `target`; lists become tuples where
  the schema holds a tuple."""
  for key, value in values.items():
    if key not in target:
      raise WorkdirError(f"{where}: config field {key!r} is not in this version's schema")
    if isinstance(target[key], config_dict.ConfigDict):
      if not isinstance(value, dict):
        raise WorkdirError(f"{where}: config field {key!r} is a section, got {value!r}")
      _update(target[key], value, f"{where}.{key}")
      continue
    try:
      target[key] = tuple(value) if isinstance(target[key], tuple) else value
    except (TypeError, ValueError) as error:   # the schema's type, e.g. "2" for an int
      raise WorkdirError(f"{where}: config field {key!r}: {error}") from None


def config_from_dict(values: dict, where: str = "config") -> config_dict.ConfigDict:
  """A dict of `config.to_dict()` -> a locked config on the current schema."""
  config = config_lib.default_config()
  _update(config, values, where)
  return config


def load_config(workdir: str) -> config_dict.ConfigDict:
  """The config a run in `workdir` was started with (WORKDIR/config.json)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise WorkdirError(f"{path}: no such file: {workdir!r} is not a training workdir (or "
                       "its run predates saved configs)")
  with open(path) as f:
    try:
      values = json.load(f)
    except ValueError as error:
      raise WorkdirError(f"{path}: not JSON ({error})") from None
  if isinstance(values, dict) and "model_type" in values and "model" not in values:
    raise WorkdirError(f"{workdir} is a transformers directory ({path} is transformers' "
                       "config), not a training workdir")
  return config_from_dict(values, path)


def pin_step(workdir: str, step: int, by: str) -> None:
  """Records that the run in workdir `by` adapts step `step` of `workdir`, whose run then
  keeps that step past `checkpoint.keep` while `by` exists (`pinned_steps`)."""
  by = os.path.abspath(by)
  directory = os.path.join(workdir, PINS_DIR)
  os.makedirs(directory, exist_ok=True)
  name = hashlib.sha1(by.encode()).hexdigest()[:16] + ".json"
  write_atomically(os.path.join(directory, name), json.dumps({"step": int(step), "workdir": by}))


def pinned_steps(workdir: str) -> Set[int]:
  """The steps of `workdir` that existing LoRA workdirs adapt (`pin_step`); a pin whose
  workdir is gone, or that cannot be read, holds nothing."""
  directory = os.path.join(workdir, PINS_DIR)
  steps = set()
  for name in os.listdir(directory) if os.path.isdir(directory) else ():
    try:
      with open(os.path.join(directory, name)) as f:
        pin = json.load(f)
      if os.path.isdir(pin["workdir"]):
        steps.add(int(pin["step"]))
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return steps


def config_changes(before: config_dict.ConfigDict, after: config_dict.ConfigDict) -> List[str]:
  """Each field whose value differs between two configs: ["optimizer.learning_rate:
  0.001 -> 0.0002", ...] in field order (tuples and lists alike, as config.json holds
  them)."""
  def leaves(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
      if isinstance(value, dict):
        flat.update(leaves(value, f"{prefix}{key}."))
      else:
        flat[prefix + key] = value
    return flat

  old, new = (leaves(json.loads(json.dumps(c.to_dict()))) for c in (before, after))
  return [f"{name}: {old.get(name)!r} -> {new.get(name)!r}"
          for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]


def _check_not_foreign(workdir: str) -> None:
  """WorkdirError when WORKDIR/config.json exists and is not a training run's config."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path) or is_workdir(workdir):   # a run's, if damaged: resume reads
    return
  try:
    with open(path) as f:
      values = json.load(f)
  except ValueError:
    values = None
  if not (isinstance(values, dict) and {"model", "train"} <= values.keys()):
    raise WorkdirError(f"{os.path.abspath(workdir)} holds a config.json that is not a "
                       "training run's (a transformers checkpoint?), which the run's config "
                       "would replace: give --workdir a directory of its own")


@contextlib.contextmanager
def lock(workdir: str):
  """Holds WORKDIR/.lock for one run. A second run on the same workdir is refused with a
  WorkdirError naming the process holding it; the kernel drops the lock when its holder
  exits, however it exits, so a dead run leaves none behind. A directory whose
  config.json is not a run's (a transformers checkpoint) is refused before anything is
  written into it: the run's config would replace that file. A workdir this call created
  is removed again if the run wrote nothing into it (it stopped at a bad data path)."""
  _check_not_foreign(workdir)
  created = not os.path.isdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
      raise WorkdirError(f"{os.path.abspath(workdir)} is in use by {holder}: one run at a "
                         "time per workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    yield
  finally:
    if created and os.listdir(workdir) == [LOCK_FILE]:   # removed while still held
      os.unlink(path)
      os.rmdir(workdir)
    os.close(fd)   # releases the flock
