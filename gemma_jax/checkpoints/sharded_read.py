"""Host tensors onto a mesh, each device's part read alone.

A checkpoint's tensors are memory-mapped (`checkpoints.safetensors_io.read`) and mapped to
our layout by views (slices, transposes, axis splits), so nothing is read until a
device's part is asked for. `place` builds every parameter from the parts this process's
devices hold: on many hosts each reads only its own shards, and a checkpoint larger than
one host's memory loads.

    params = sharded_read.place(views, shardings, np.float32)
"""

from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np


class LayerStack:
  """[layers, ...]: same-shape host arrays (e.g. memory-mapped views) seen as one array
  with a leading layer axis, read (`read`) only where a part is asked for."""

  def __init__(self, layers: Sequence[Any]):
    shapes = {tuple(layer.shape) for layer in layers}
    if len(shapes) != 1:
      raise ValueError(f"layers of different shapes cannot be stacked: {sorted(shapes)}")
    self.layers = list(layers)
    self.shape = (len(self.layers),) + shapes.pop()
    self.dtype = np.result_type(*(layer.dtype for layer in self.layers))


def read(leaf: Any, dtype, index: Optional[Tuple[slice, ...]] = None) -> np.ndarray:
  """The part `index` (one slice per leading axis; default: all) of `leaf` (an array,
  memory-mapped view or LayerStack) as an array of `dtype` laid out in the stored
  tensor's memory order (a transposed view stays a transposed array).

  Converting in memory order is one sequential pass, and `jax.device_put` transposes on
  the way to the device; putting it in C order on the host walks the source at the full
  stride, an order of magnitude slower (as stacking layers with np.stack did; figures in
  docs/performance.md)."""
  index = tuple(index or ()) + (slice(None),) * (len(leaf.shape) - len(index or ()))
  if not isinstance(leaf, LayerStack):
    return np.asarray(leaf[index], dtype)     # numpy keeps the source's memory order
  layers = [np.asarray(layer[index[1:]]) for layer in leaf.layers[index[0]]]
  axes = sorted(range(layers[0].ndim), key=lambda a: -layers[0].strides[a])   # outer first
  out = np.empty((len(layers),) + tuple(layers[0].shape[a] for a in axes), dtype)
  out = out.transpose(0, *(1 + axes.index(a) for a in range(layers[0].ndim)))
  for i, layer in enumerate(layers):
    np.copyto(out[i, ...], layer, casting="unsafe")   # (a view even of a 0-d layer)
  return out


def place(tree: Any, shardings: Any, dtype) -> Any:
  """Each leaf of `tree` (a numpy array, memory-mapped view or LayerStack) as a jax.Array
  laid out by its sharding in `shardings`, in `dtype`, made from the parts this
  process's devices hold; a part held by several devices is read once."""

  def one(leaf, sharding):
    parts = {}

    def part(index):
      key = tuple((s.start, s.stop, s.step) for s in index)
      if key not in parts:
        parts[key] = read(leaf, dtype, index)
      return parts[key]

    return jax.make_array_from_callback(tuple(leaf.shape), sharding, part)

  return jax.tree.map(one, tree, shardings, is_leaf=lambda x: isinstance(x, LayerStack))
