"""orbax checkpoints of the train state and the data position, by step.

A checkpoint `directory/<step>/` holds `state` (params, optimizer state, step and the
dropout key, as arrays), `data` (the data iterator's position, as JSON, in
`DATA_POSITION_FILE`) and `CHECKSUMS_FILE`: the sha256 of every file of those two,
written once they are on disk and before orbax renames the step into place. A restore
checks them, so flipped bytes or a deleted file are an error naming the step and the
file, not NaN at the next step.
"""

import contextlib
import hashlib
import json
import os
import re
from typing import Callable, Dict, List, Optional, Set, Tuple

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from gemma_jax.config import ConfigError
from gemma_jax.training.optimizer import param_path
from gemma_jax.training.steps import TrainState


CHECKSUMS_FILE = "checksums.json"
DATA_POSITION_FILE = "data/metadata"   # orbax's JSON item file
_ITEMS = ("state", "data")


class CheckpointError(ValueError):
  """A checkpoint step cannot be read, or written."""


def _to_arrays(state: TrainState) -> dict:
  """The state as a dict of arrays; the typed PRNG key becomes its raw key data."""
  return state._replace(rng=jax.random.key_data(state.rng))._asdict()


def _shapes(tree) -> dict:
  """{"params/embed/embedding": shape, ...} of a tree of arrays or array metadata."""
  return {param_path(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


class _Pinned:
  """An orbax preservation policy: keep the steps `pinned()` names, read at each save."""

  def __init__(self, pinned: Callable[[], Set[int]]):
    self._pinned = pinned

  def should_preserve(self, checkpoints, *, context) -> List[bool]:
    del context
    steps = self._pinned()
    return [info.step in steps for info in checkpoints]


def _gist(error: Exception) -> str:
  """The first line of an orbax or tensorstore error, without tensorstore's pointer to
  its "full details" (the repr of a bound method), at most 300 characters."""
  line = (str(error).strip().splitlines() or [""])[0]
  return line.split(" See full TensorStore details")[0][:300]


# How tensorstore's messages and Python's name an OS error's number.
_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]|\[Errno (\d+)\]")


def _write_failure(error: Exception) -> str:
  """The OS error behind a failed write ("[Errno 28] No space left on device"), found in
  the exception chain or in tensorstore's message, wherever it stands in its text; else
  the error's type and first line."""
  cause = error
  while cause is not None:
    if isinstance(cause, OSError) and cause.errno:
      return f"[Errno {cause.errno}] {os.strerror(cause.errno)}"
    cause = cause.__cause__ or cause.__context__
  match = _ERRNO.search(str(error))
  if match:
    code = int(match.group(1) or match.group(2))
    return f"[Errno {code}] {os.strerror(code)}"
  return f"{type(error).__name__}: {_gist(error)}"


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
      digest.update(block)
  return digest.hexdigest()


def _item_files(step_dir: str) -> List[str]:
  """The files of a step's items, as paths relative to its directory ("state/_METADATA")."""
  files = []
  for item in _ITEMS:
    for root, _, names in os.walk(os.path.join(step_dir, item)):
      files += [os.path.relpath(os.path.join(root, name), step_dir) for name in names]
  return sorted(files)


def _mismatch(step_dir: str, expected: Dict[str, str]) -> Optional[str]:
  """The first file of `expected` (path -> sha256) that is missing or differs under
  step_dir ("state/_METADATA is missing"), or None when all match. Each host hashes its
  share of the files and all hosts get the same answer."""
  names = sorted(expected)
  codes = np.zeros(len(names), np.int8)   # 0: matches, 1: missing, 2: differs
  for i in range(jax.process_index(), len(names), jax.process_count()):
    path = os.path.join(step_dir, names[i])
    if not os.path.isfile(path):
      codes[i] = 1
    elif _sha256(path) != expected[names[i]]:
      codes[i] = 2
  if jax.process_count() > 1:
    codes = multihost_utils.process_allgather(codes).max(axis=0)
  bad = np.flatnonzero(codes)
  if not bad.size:
    return None
  first = names[bad[0]]
  what = "is missing" if codes[bad[0]] == 1 else (
      f"differs from the file saved (its sha256 in {CHECKSUMS_FILE})")
  more = f" ({bad.size - 1} more file(s) missing or different)" if bad.size > 1 else ""
  return f"{first} {what}{more}"


class Checkpointer:
  """Saves (TrainState, data position) every call, keeping the last `keep` steps and
  those `pinned()` names (steps that other runs adapt).

  The `writer` (the run training in `directory`) removes the staging directories that
  saves which failed (a full disk) or were killed left there; others leave them alone,
  as they may be those of a save under way.
  """

  def __init__(self, directory: str, keep: int, pinned: Callable[[], Set[int]] = set, *,
               writer: bool = False):
    self._directory = directory
    self._in_flight = None   # the step being written in the background
    keeping = preservation_policy.AnyPreservationPolicy(
        [preservation_policy.LatestN(keep), _Pinned(pinned)])
    self._manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            preservation_policy=keeping, create=True, cleanup_tmp_directories=writer,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums)),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> Tuple[int, ...]:
    return tuple(self._manager.all_steps())

  def save(self, state: TrainState, data_state: dict) -> None:
    """Saves at `state.step` (once: a step already saved is left as it is)."""
    step = int(state.step)
    if step in self._manager.all_steps():
      return
    self.wait()   # a failure of the save before is reported as that step's
    self._in_flight = step
    with self._writing(step):
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_to_arrays(state)), data=ocp.args.JsonSave(data_state)))

  def _write_checksums(self) -> None:
    """Writes CHECKSUMS_FILE into the step being saved: orbax calls this on the primary
    host once every host's files are written, before it renames the step's staging
    directory into place, so a step that is there has its checksums."""
    staged = os.path.join(self._directory,
                          f"{self._in_flight}{ocp.path.atomicity_types.TMP_DIR_SUFFIX}")
    step_dir = staged if os.path.isdir(staged) else self._step_dir(self._in_flight)
    checksums = {name: _sha256(os.path.join(step_dir, name)) for name in _item_files(step_dir)}
    with open(os.path.join(step_dir, CHECKSUMS_FILE), "w", encoding="utf-8") as f:
      json.dump({"sha256": checksums}, f, indent=1, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())

  def _step_dir(self, step: int) -> str:
    return os.path.join(self._directory, str(step))

  def _has_checksums(self, step: int) -> bool:
    """Whether the step has CHECKSUMS_FILE (steps saved before it was written do not)."""
    return os.path.isfile(os.path.join(self._step_dir(step), CHECKSUMS_FILE))

  def _damage(self, step: int) -> Optional[str]:
    """What differs between the step's files and its checksums ("state/_METADATA is
    missing"); None when nothing does, or when the step has no checksums."""
    if not self._has_checksums(step):
      return None
    try:
      with open(os.path.join(self._step_dir(step), CHECKSUMS_FILE), encoding="utf-8") as f:
        expected = dict(json.load(f)["sha256"])
    except (ValueError, KeyError, TypeError):
      return f"{CHECKSUMS_FILE} is not the JSON written there"
    return _mismatch(self._step_dir(step), expected)

  def damaged(self, step: int, problem: str) -> CheckpointError:
    """The error for step `step`, which `problem` says cannot be used ("is corrupt:
    ..."), naming the latest other step whose files match their checksums and how to
    resume from it."""
    others = [s for s in reversed(self.all_steps()) if s != step]
    intact = next((s for s in others if self._damage(s) is None), None)
    if intact is not None:
      checked = "intact" if self._has_checksums(intact) else (
          "saved without checksums, so unchecked")
      advice = f"move {self._step_dir(step)} away to use step {intact} ({checked})"
    else:
      advice = (f"no other step is intact ({', '.join(map(str, others))} neither)" if others
                else "no other step is kept")
    return CheckpointError(f"the checkpoint of step {step} in {self._directory} {problem}; "
                           f"{advice}")

  def restore(self, like: TrainState, step: Optional[int] = None) -> Tuple[TrainState, dict]:
    """The state and the data position.

    Args:
      like: the state's structure, shapes and dtypes (`jax.ShapeDtypeStruct` leaves);
        where they carry shardings, each host reads just its shards and the arrays
        come back laid out that way, whatever mesh the checkpoint was saved from.
      step: the step to restore; the latest by default.

    Raises:
      ConfigError (field model, or optimizer): the saved arrays' names or shapes are
        not those of `like` (the config's model or optimizer changed since the save).
      CheckpointError: the step's files differ from their checksums or cannot be read
        (damaged, or deleted meanwhile); it names the latest intact step.
    """
    step = self.latest_step() if step is None else step
    if not self._has_checksums(step):
      logging.warning("the checkpoint of step %d in %s has no %s (saved before checksums "
                      "were kept): restored unchecked", step, self._directory, CHECKSUMS_FILE)
    problem = self._damage(step)
    if problem:
      raise self.damaged(step, f"is corrupt: {problem}")
    abstract = jax.tree.map(
        lambda shape, leaf: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                 sharding=leaf.sharding),
        jax.eval_shape(_to_arrays, like), like._asdict())
    with self._readable(step):
      metadata = self._manager.item_metadata(step)["state"]
    if metadata is None:   # what orbax gives for a step without state/_METADATA
      raise self.damaged(step, "is corrupt: orbax finds no metadata of its arrays "
                         "(state/_METADATA)")
    saved, wanted = _shapes(metadata), _shapes(abstract)
    if saved != wanted:
      differ = [p for p in saved.keys() | wanted.keys() if saved.get(p) != wanted.get(p)]
      path = min(differ, key=lambda p: (not p.startswith("params/"), p))
      raise ConfigError("model" if path.startswith("params/") else "optimizer",
                        f"the checkpoint of step {step} in {self._directory} does not match "
                        f"this config: {path} is {saved.get(path, 'absent')} there, "
                        f"{wanted.get(path, 'absent')} here; resume with the config it was "
                        "saved with, or use a new workdir")
    with self._readable(step):
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    arrays = restored["state"]
    rng = jax.random.wrap_key_data(arrays["rng"])
    return TrainState(**{**arrays, "rng": rng}), restored["data"]

  @contextlib.contextmanager
  def _readable(self, step: int):
    """Turns any failure to read step `step` (a damaged or half-deleted checkpoint: orbax
    and tensorstore raise KeyError, JSON and I/O errors of their own) into one
    CheckpointError naming it and the latest intact step."""
    try:
      yield
    except Exception as error:   # pylint: disable=broad-except
      raise self.damaged(step, f"cannot be read ({type(error).__name__}: "
                         f"{_gist(error)})") from None

  @contextlib.contextmanager
  def _writing(self, step: int):
    """Turns a failed write of step `step` (a full disk, a quota) into one
    CheckpointError naming its directory, the OS error and the steps kept; orbax's
    report, hundreds of lines, is left to the log."""
    try:
      yield
    except Exception as error:   # pylint: disable=broad-except
      kept = ", ".join(str(s) for s in self.all_steps() if s != step) or "none"
      raise CheckpointError(f"writing the checkpoint {self._step_dir(step)} failed: "
                            f"{_write_failure(error)}; the steps saved before are kept: "
                            f"{kept}") from None

  def wait(self) -> None:
    """Blocks until every save has been written."""
    if self._in_flight is None:
      return
    try:
      with self._writing(self._in_flight):
        self._manager.wait_until_finished()
    finally:
      self._in_flight = None

  def close(self) -> None:
    self._manager.close()
