"""orbax checkpoints of the train state and the data position, by step.

A checkpoint `directory/<step>/` holds `state` (params, optimizer state, step and the
dropout key, as arrays) and `data` (the data iterator's position, as JSON).
"""

import contextlib
import os
from typing import Callable, List, Optional, Set, Tuple

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from gemma_jax.config import ConfigError
from gemma_jax.training.optimizer import param_path
from gemma_jax.training.steps import TrainState


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


class Checkpointer:
  """Saves (TrainState, data position) every call, keeping the last `keep` steps and
  those `pinned()` names (steps that other runs adapt)."""

  def __init__(self, directory: str, keep: int, pinned: Callable[[], Set[int]] = set):
    self._directory = directory
    keeping = preservation_policy.AnyPreservationPolicy(
        [preservation_policy.LatestN(keep), _Pinned(pinned)])
    self._manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(preservation_policy=keeping,
                                                        create=True),
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
    with self._writing():
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_to_arrays(state)), data=ocp.args.JsonSave(data_state)))

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
      CheckpointError: the step's files cannot be read (damaged, or deleted meanwhile).
    """
    step = self.latest_step() if step is None else step
    abstract = jax.tree.map(
        lambda shape, leaf: jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                 sharding=leaf.sharding),
        jax.eval_shape(_to_arrays, like), like._asdict())
    with self._readable(step):
      metadata = self._manager.item_metadata(step)["state"]
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
    CheckpointError naming it and the steps kept."""
    try:
      yield
    except Exception as error:   # pylint: disable=broad-except
      first_line = _gist(error)
      others = [s for s in self.all_steps() if s != step]
      raise CheckpointError(
          f"the checkpoint of step {step} in {self._directory} cannot be read "
          f"({type(error).__name__}: {first_line}); "
          + (f"move {os.path.join(self._directory, str(step))} away to use step "
             f"{others[-1]}" if others else "no other step is kept")) from None

  @contextlib.contextmanager
  def _writing(self):
    """Turns a failed write (a full disk, a quota; orbax reports an earlier save's
    failure at the next call) into one CheckpointError naming the steps kept."""
    try:
      yield
    except Exception as error:   # pylint: disable=broad-except
      first_line = _gist(error)
      kept = ", ".join(map(str, self.all_steps())) or "none"
      raise CheckpointError(f"writing a checkpoint in {self._directory} failed "
                            f"({type(error).__name__}: {first_line}); the steps saved "
                            f"before are kept: {kept}") from None

  def wait(self) -> None:
    """Blocks until every save has been written."""
    with self._writing():
      self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
