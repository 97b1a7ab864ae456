"""Logical axes on a device mesh: the mesh from the config, one rules table, shardings.

Every parameter and large activation names its axes (batch, length, embed, heads,
kv_heads, head_dim, qkv, mlp, vocab, expert, layers, norm). `RULES` maps them onto the mesh
axes (data, fsdp, tensor, expert). A mesh axis is used at most once per array and the
first rule that can claim it wins (flax's semantics), so an activation's `embed` stays
whole when `batch` already spans fsdp. Mesh axes of size 1 cost nothing, so the one
table serves data parallel, FSDP, FSDP + tensor parallel and expert parallel alike: the
mesh shape chooses (`MESH_PRESETS`).

    mesh = make_mesh(config.mesh)
    with activate(mesh):                       # activations follow the rules
      state = jax.jit(init, out_shardings=...)()
"""

import contextlib
import math
import os
from typing import Optional, Sequence

import flax
import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from ml_collections import config_dict

from gemma_jax import transformer
from gemma_jax.config import BATCH_AXES, MESH_AXES, ConfigError

RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("length", None),
    ("head_dim", None),
    ("qkv", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),
)

# Named mesh shapes (config.mesh fields); -1 takes the devices the other axes leave.
MESH_PRESETS = {
    "data_parallel": dict(data=-1, fsdp=1, tensor=1, expert=1),
    "fsdp": dict(data=1, fsdp=-1, tensor=1, expert=1),
    "fsdp_tensor": dict(data=1, fsdp=-1, tensor=2, expert=1),
    "expert": dict(data=1, fsdp=-1, tensor=1, expert=4),
}


def maybe_initialize_distributed(mesh_config: config_dict.ConfigDict) -> None:
  """jax.distributed.initialize() when config.mesh.distributed or JAX_COORDINATOR_ADDRESS
  asks for it; call it before anything touches a device.

  On TPU pods and under SLURM jax finds the coordinator, process count and index
  itself; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of process 0),
  JAX_NUM_PROCESSES and JAX_PROCESS_ID.
  """
  env = os.environ
  if not (mesh_config.distributed or env.get("JAX_COORDINATOR_ADDRESS")):
    return
  # Processes on CPUs (a CPU cluster, the tests) exchange data through gloo;
  # accelerator backends ignore this setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  number = lambda name: int(env[name]) if env.get(name) else None
  jax.distributed.initialize(num_processes=number("JAX_NUM_PROCESSES"),
                             process_id=number("JAX_PROCESS_ID"))


def mesh_shape(mesh_config: config_dict.ConfigDict, num_devices: int) -> dict:
  """{axis: size} with -1 resolved; ConfigError naming the axis when it cannot fit."""
  sizes = {axis: mesh_config[axis] for axis in MESH_AXES}
  fixed = math.prod(size for size in sizes.values() if size != -1)
  free = [axis for axis, size in sizes.items() if size == -1]
  if free:
    if num_devices % fixed:
      fixed_axes = ", ".join(f"{a}={s}" for a, s in sizes.items() if s != -1)
      raise ConfigError(f"mesh.{free[0]}", f"-1 takes the devices left over, but the other "
                        f"axes ({fixed_axes}: {fixed} ways) do not divide the {num_devices} "
                        "devices")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError("mesh", f"axes {sizes} span {fixed} devices, but there are "
                      f"{num_devices}")
  return sizes


def make_mesh(mesh_config: config_dict.ConfigDict,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """The device mesh with axes MESH_AXES, shaped by config.mesh (all devices by default)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_config, len(devices))
  grid = np.asarray(devices).reshape([sizes[axis] for axis in MESH_AXES])
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def activate(mesh: Mesh):
  """Within it, traced code constrains activations to `mesh` through RULES."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    yield


def to_mesh_axes(logical: PartitionSpec) -> PartitionSpec:
  """Logical names -> mesh axes through RULES."""
  return nn.logical_to_mesh_axes(tuple(logical), RULES)


def shard_ways(spec: PartitionSpec, sizes: dict) -> int:
  """Into how many pieces `spec` cuts an array on a mesh of axis `sizes`."""
  axes = [a for entry in spec if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)]
  return math.prod(sizes[a] for a in axes)


def param_specs(config: config_dict.ConfigDict, sizes: dict) -> dict:
  """Parameter tree of mesh PartitionSpecs.

  Raises:
    ConfigError (field mesh.<axis>): a sharded dimension is not divisible by its mesh
      axes; names the parameter and the dimension. (A quantized weight's scale stays
      whole along such a dimension instead.)
  """
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  # Shapes and names only: no mesh, so no sharding constraints even inside activate().
  with jax.sharding.use_abstract_mesh(AbstractMesh((), ())):
    boxed = jax.eval_shape(transformer.decoder_module(config).init,
                           jax.random.key(0), tokens, tokens, tokens)["params"]
    shapes = flax.traverse_util.flatten_dict(nn.meta.unbox(boxed))
  logical = flax.traverse_util.flatten_dict(nn.get_partition_spec(boxed))
  specs = {}
  for path, shape in shapes.items():
    spec = to_mesh_axes(logical[path])
    for dim, (length, entry) in enumerate(zip(shape.shape, spec)):
      if entry is None:
        continue
      axes = (entry,) if isinstance(entry, str) else tuple(entry)
      ways = math.prod(sizes[a] for a in axes)
      if length % ways and path[-1].endswith("_scale"):
        # Grouped int4 scales hold size / group rows where the weight holds size: the
        # weight splits, its few scales stay whole along that dimension.
        spec = PartitionSpec(*(None if d == dim else e for d, e in enumerate(spec)))
      elif length % ways:
        raise ConfigError(f"mesh.{axes[-1]}", f"parameter {'/'.join(path)} dimension {dim} "
                          f"({logical[path][dim]}) has size {length}, which mesh axes "
                          f"{axes} ({ways} ways) do not divide")
    specs[path] = spec
  return flax.traverse_util.unflatten_dict(specs)


def named(mesh: Mesh, specs):
  """A tree of PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(config: config_dict.ConfigDict, mesh: Mesh) -> dict:
  """Parameter tree of NamedShardings on `mesh`."""
  return named(mesh, param_specs(config, dict(mesh.shape)))


def optimizer_state_shardings(optimizer: optax.GradientTransformation, opt_state_shapes,
                              params_shardings, mesh: Mesh):
  """Shardings of an optimizer state: per-parameter slots (Adam's moments) as their
  parameter, everything else (counts) replicated."""
  return optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, opt_state_shapes, params_shardings,
      transform_non_params=lambda _: replicated(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, ...] arrays with rows split over the batch-carrying mesh axes."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
  """This process's rows (numpy) -> global arrays sharded by `batch_sharding`."""
  sharding = batch_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, value)
          for name, value in local_batch.items()}


def check_batch_rows(rows: int, sizes: dict) -> None:
  """ConfigError naming train.batch_size when `rows` (a micro-batch) cannot split evenly
  over the batch-carrying mesh axes."""
  ways = math.prod(sizes[axis] for axis in BATCH_AXES)
  if rows % ways:
    raise ConfigError("train.batch_size", f"a micro-batch of {rows} rows does not split "
                      f"over mesh axes {BATCH_AXES} ({ways} ways)")
