"""sharded_read: lazily stacked layers read like np.stack, views convert in their memory
order, and `place` lays host arrays out on a mesh reading each distinct part once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gemma_jax.checkpoints import sharded_read


def test_layer_stack_indexes_like_the_stacked_array(tmp_path):
  """Three memory-mapped [4, 6] layers: every index a device may ask for (slices on each
  axis, fewer axes than the array's) reads what np.stack would hold there."""
  layers = []
  for i in range(3):
    layer = np.lib.format.open_memmap(str(tmp_path / f"{i}.npy"), "w+", np.float32, (4, 6))
    layer[:] = np.random.RandomState(i).normal(size=(4, 6))
    layers.append(layer)
  stacked, lazy = np.stack(layers), sharded_read.LayerStack(layers)
  assert lazy.shape == (3, 4, 6) and lazy.dtype == np.float32
  for index in [(slice(None),), (slice(1, 3), slice(0, 2)),
                (slice(0, 3), slice(2, 4), slice(3, 6)), (slice(2, 3), slice(None), slice(0, 1))]:
    np.testing.assert_array_equal(sharded_read.read(lazy, np.float32, index), stacked[index])


@pytest.mark.parametrize("shape, view", [
    ((150, 70), lambda a: a.T),                                    # [out, in] -> [in, out]
    ((4 * 40, 70), lambda a: a.T.reshape(70, 4, 40)),              # -> [in, heads, head]
    ((70, 4 * 40), lambda a: a.reshape(70, 4, 40).transpose(1, 2, 0)),
    ((3, 130), lambda a: a[:, 5:]),                                # a slice: rows strided
    ((200,), lambda a: a[::2]),
    ((), lambda a: a),                                             # a per-layer scalar
])
def test_read_converts_views_in_their_memory_order(shape, view):
  """Transposed, split and sliced bfloat16 views, alone and stacked as layers, read as
  float32 hold numpy's own conversion, their axes in the stored tensor's memory order
  (a transpose is left to the device transfer)."""
  source = np.random.RandomState(0).normal(size=shape).astype(jnp.bfloat16)
  layers = [view(source), view(source * 2)]
  order = lambda a: np.argsort(a.strides, kind="stable").tolist()
  got = sharded_read.read(layers[0], np.float32)
  assert got.dtype == np.float32 and order(got) == order(layers[0])
  np.testing.assert_array_equal(got, layers[0].astype(np.float32))
  stacked = sharded_read.read(sharded_read.LayerStack(layers), np.float32)
  assert stacked.dtype == np.float32 and order(stacked[1]) == order(layers[0])
  np.testing.assert_array_equal(stacked, np.stack(layers).astype(np.float32))
  np.testing.assert_array_equal(jax.device_put(stacked), np.stack(layers).astype(np.float32))


def test_layer_stack_refuses_layers_of_different_shapes():
  with pytest.raises(ValueError, match=r"different shapes cannot be stacked: \[\(2,\), \(3,\)\]"):
    sharded_read.LayerStack([np.zeros(2), np.zeros(3)])


def test_place_reads_each_distinct_part_once():
  """[8, 4] split in 4 over 'x', replicated over 'y' (2 devices each part): 4 reads, and
  the array equals the host one, converted to the dtype asked for."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
  sharding = NamedSharding(mesh, PartitionSpec("x", None))
  host = np.arange(32, dtype=np.float64).reshape(8, 4)
  reads = []

  class Counting:
    shape = host.shape

    def __getitem__(self, index):
      reads.append(index)
      return host[index]

  placed = sharded_read.place({"w": Counting()}, {"w": sharding}, np.float32)["w"]
  assert len(reads) == 4 and placed.dtype == np.float32 and placed.sharding == sharding
  np.testing.assert_array_equal(np.asarray(placed), host.astype(np.float32))
