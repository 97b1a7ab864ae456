"""Host tensors onto a mesh, each device's part read alone.

A checkpoint's tensors are memory-mapped (`gemma_jax.safetensors_io.read`) and mapped to
our layout by views (slices, transposes, axis splits), so nothing is read until a
device's part is asked for. `place` builds every parameter from the parts this process's
devices hold: on many hosts each reads only its own shards, and a checkpoint larger than
one host's memory loads.

    params = sharded_read.place(views, shardings, np.float32)
"""

from typing import Any, Sequence, Tuple

import jax
import numpy as np


class LayerStack:
  """[layers, ...]: same-shape host arrays (e.g. memory-mapped views) seen as one array
  with a leading layer axis, read only where it is indexed."""

  def __init__(self, layers: Sequence[Any]):
    shapes = {tuple(layer.shape) for layer in layers}
    if len(shapes) != 1:
      raise ValueError(f"layers of different shapes cannot be stacked: {sorted(shapes)}")
    self.layers = list(layers)
    self.shape = (len(self.layers),) + shapes.pop()
    self.dtype = np.result_type(*(layer.dtype for layer in self.layers))

  def __getitem__(self, index: Tuple[slice, ...]) -> np.ndarray:
    """The part `index` (one slice per axis, as `jax.make_array_from_callback` asks)."""
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    return np.stack([np.asarray(layer[index[1:]]) for layer in self.layers[index[0]]])


def place(tree: Any, shardings: Any, dtype) -> Any:
  """Each leaf of `tree` (a numpy array, memory-mapped view or LayerStack) as a jax.Array
  laid out by its sharding in `shardings`, in `dtype`, made from the parts this
  process's devices hold; a part held by several devices is read once."""

  def one(leaf, sharding):
    parts = {}

    def part(index):
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in parts:
        parts[key] = np.asarray(leaf[index], dtype)
      return parts[key]

    return jax.make_array_from_callback(tuple(leaf.shape), sharding, part)

  return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, LayerStack))
