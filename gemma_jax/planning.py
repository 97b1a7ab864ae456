"""Per-device memory of a training step, planned without allocating anything.

Parameter, gradient and optimizer bytes are exact: shapes from `jax.eval_shape`,
shards from the sharding rules on a mesh of the requested shape (no devices needed).
Activation bytes are an estimate: what the backward pass keeps per layer under the
remat policy (the tensors the policy saves, plus each layer's input), one layer's
full working set while it is recomputed, and the float32 logits and their gradient.

Decoding caches (`cache_bytes`) are exact too: the shapes of what `prefill` returns.
"""

import functools
import math

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import sharding
from gemma_jax.inference import decoding
from gemma_jax.transformer import transform


def param_bytes_per_device(config: config_dict.ConfigDict, sizes: dict) -> int:
  """Bytes of the parameter shards one device holds on a mesh of axis `sizes`."""
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  shapes = flax.traverse_util.flatten_dict(
      jax.eval_shape(transform(config).init, jax.random.key(0), tokens))
  specs = flax.traverse_util.flatten_dict(sharding.param_specs(config, sizes))
  return sum(math.ceil(s.size * s.dtype.itemsize / sharding.shard_ways(specs[path], sizes))
             for path, s in shapes.items())


def _kept_per_token(m, policy: str) -> int:
  """Elements per token per layer that the backward pass keeps under `policy`."""
  qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
  d, f = m.d_model, m.mlp_dim
  kept = {
      "none": d + qkv + d + 3 * f + d + 4 * d,      # input, qkv, out, mlp hidden, mlp out, norms
      "full": d,
      "minimal": d + qkv + d + 2 * f + d,
      "save_qkv_proj": d + qkv,
      "save_dot_except_mlp": d + qkv + d,
      "save_out_proj": d + d,
      "qkv_proj_offloaded": d,                      # the rest is in host memory
      "minimal_offloaded": d,
  }
  return kept[policy]


def activation_bytes_per_device(config: config_dict.ConfigDict, sizes: dict,
                                batch_size: int, seq_len: int) -> int:
  """Estimated activation bytes one device holds at the peak of the backward pass."""
  m = config.model
  micro_rows = (batch_size // config.optimizer.grad_accum_steps //
                math.prod(sizes[a] for a in sharding.BATCH_AXES))
  tokens = micro_rows * seq_len
  item = np.dtype(m.dtype).itemsize
  kept = _kept_per_token(m, m.remat_policy) * tokens * item * m.num_layers
  probs = micro_rows * m.num_heads * seq_len * seq_len * 4 // sizes["tensor"]
  if m.remat_policy == "none":
    kept += probs * m.num_layers
  working = _kept_per_token(m, "none") * tokens * item + probs
  logits = 2 * tokens * m.vocab_size * 4 // sizes["tensor"]
  return kept + working + logits


def plan(config: config_dict.ConfigDict, num_devices: int, batch_size: int,
         seq_len: int) -> dict:
  """{name: bytes per device} for params, gradients, optimizer state and activations,
  with the resolved "mesh"."""
  sizes = sharding.mesh_shape(config.mesh, num_devices)
  sharding.check_batch_rows(batch_size // config.optimizer.grad_accum_steps, sizes)
  params = param_bytes_per_device(config, sizes)
  return {
      "mesh": sizes,
      "params": params,
      "gradients": params,
      "optimizer_state": 2 * params,           # AdamW: first and second moments
      "activations": activation_bytes_per_device(config, sizes, batch_size, seq_len),
  }


def cache_bytes(config: config_dict.ConfigDict, batch_size: int, cache_length: int,
                cache_dtype: str = "bfloat16") -> dict:
  """Bytes of the decoding caches of `batch_size` rows covering `cache_length` positions
  (keys, values and slot positions, all devices together): "cache" as built, local
  layers holding only their window, and "full_length" with every layer holding the
  whole context. Nothing is allocated."""

  def total(config):
    tokens = jax.ShapeDtypeStruct((batch_size, 1), np.int32)
    params = jax.eval_shape(transform(config).init, jax.random.key(0), tokens)
    prefill = functools.partial(decoding.make_decoding(config).prefill, cache_length=cache_length,
                                cache_dtype=cache_dtype)
    _, cache = jax.eval_shape(prefill, params, tokens)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))

  full_length = config_dict.ConfigDict(config.to_dict())
  full_length.model.sliding_window = cache_length
  return {"cache": total(config), "full_length": total(full_length)}
