"""Per-device memory of a training step, planned without allocating anything.

Parameter, gradient and optimizer bytes are exact: shapes from `jax.eval_shape`,
shards from the sharding rules on a mesh of the requested shape (no devices needed).
With LoRA (`config.lora.rank` > 0) the base parameters are frozen: they count in
"params" (in param_dtype) but have no gradient and no optimizer state; gradients and
AdamW's moments cover the adapters only.
Activation bytes are an estimate (`activation_bytes_per_device`), checked against XLA's
own memory analysis of compiled steps in the tests.

Decoding caches (`cache_bytes`) are exact too: the shapes of what `prefill` returns.
"""

import functools
import math

import flax
import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax import decoder, lora, quant, sharding
from gemma_jax.config import attention_shape
from gemma_jax.inference import decoding
from gemma_jax.layers import attention
from gemma_jax.transformer import transform


def _shapes(config: config_dict.ConfigDict) -> dict:
  """{parameter path: ShapeDtypeStruct}, the adapters included."""
  tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
  return flax.traverse_util.flatten_dict(
      jax.eval_shape(transform(config).init, jax.random.key(0), tokens))


def _bytes_per_device(config: config_dict.ConfigDict, sizes: dict, shapes: dict) -> int:
  """Bytes of the shards of `shapes` ({path: ShapeDtypeStruct}) one device holds on a
  mesh of axis `sizes`."""
  specs = flax.traverse_util.flatten_dict(sharding.param_specs(config, sizes))
  return sum(math.ceil(s.size * s.dtype.itemsize / sharding.shard_ways(specs[path], sizes))
             for path, s in shapes.items())


def _kept_per_token(m, kind: str, policy: str) -> int:
  """Elements per token that the backward pass keeps of one layer of attention type
  `kind` under `policy` (attention probabilities aside)."""
  kv, h = attention_shape(m, kind)
  qkv = (m.num_heads + 2 * kv) * h
  d = m.d_model
  hidden = m.mlp_dim + m.experts_per_token * m.expert_mlp_dim * bool(m.num_experts)
  routed = (m.experts_per_token * (d + d) + m.num_experts) * bool(m.num_experts)
  kept = {
      # input, q/k/v, attention out, MLP gate/up/activation, MLP out, norms (+ routed rows)
      "none": d + qkv + d + 3 * hidden + d + 4 * d + routed,
      "full": d,
      "minimal": d + qkv + d + 2 * hidden + d,
      "save_qkv_proj": d + qkv,
      "save_dot_except_mlp": d + qkv + d,
      "save_out_proj": d + d,
      # like their non-offloaded counterparts where device and host memory are one (a CPU)
      "qkv_proj_offloaded": d + qkv,
      "minimal_offloaded": d + qkv + d + 2 * hidden + d,
  }
  return kept[policy]


def _keys_per_query(m, kind: str, seq_len: int) -> float:
  """Logits per query of a layer, as `decoder.layer_masks(..., blocked=True)` runs it:
  W + Q for a sliding-window layer in blocks of Q (T > 2W), the mean key prefix of a
  causal layer in query blocks (T at least two blocks), else T. (cuDNN's fused kernel
  holds none of them: for it this is a bound.)"""
  if kind == "local" and m.sliding_window and seq_len > 2 * m.sliding_window:
    return m.sliding_window + attention.local_block_size(m.sliding_window)
  size = attention.causal_block_size(seq_len)
  if seq_len >= 2 * size:
    return sum((end - start) * end for start, end in (
        (s, min(s + size, seq_len)) for s in range(0, seq_len, size))) / seq_len
  return seq_len


def activation_bytes_per_device(config: config_dict.ConfigDict, sizes: dict,
                                batch_size: int, seq_len: int) -> int:
  """Estimated activation bytes one device holds at the peak of the backward pass: what
  the policy keeps of every layer, plus (under remat) the whole working set of one remat
  unit (a scanned period of the attention pattern, or one unscanned layer) while it is
  recomputed, plus the float32 logits, their softmax and gradient."""
  m = config.model
  micro_rows = (batch_size // config.optimizer.grad_accum_steps //
                math.prod(sizes[a] for a in sharding.BATCH_AXES))
  tokens = micro_rows * seq_len
  item = np.dtype(m.dtype).itemsize
  # logits, masked logits, probabilities and their gradient: float32, heads split over
  # "tensor"
  probs = lambda kind: int(4 * micro_rows * m.num_heads * seq_len
                           * _keys_per_query(m, kind, seq_len) * 4) // sizes["tensor"]
  layer = lambda kind, policy: (_kept_per_token(m, kind, policy) * tokens * item
                                + (probs(kind) if policy == "none" else 0))
  types = decoder.layer_types(m)
  kept = sum(layer(kind, m.remat_policy) for kind in types)
  unit = m.attention_pattern if decoder.scanned_block_count(m) else ("global",)
  working = 0 if m.remat_policy == "none" else sum(layer(kind, "none") for kind in unit)
  logits = 3 * tokens * m.vocab_size * 4 // sizes["tensor"]
  return kept + working + logits


def plan(config: config_dict.ConfigDict, num_devices: int, batch_size: int,
         seq_len: int) -> dict:
  """{name: bytes per device} for params, gradients, optimizer state and activations,
  with the resolved "mesh", and the parameter counts "total_params" and
  "trainable_params" (the adapters under LoRA, else all)."""
  sizes = sharding.mesh_shape(config.mesh, num_devices)
  sharding.check_batch_rows(batch_size // config.optimizer.grad_accum_steps, sizes)
  shapes = _shapes(config)
  # Quantized weights are stored in fewer bytes (counted as stored) but train only
  # through adapters; parameters are counted as the float model's.
  stored = config.model.quant in quant.STORED_MODES
  trainable = {path: s for path, s in shapes.items()
               if path[-1] in lora.ADAPTER_NAMES or not (config.lora.rank or stored)}
  counted = _shapes(quant.float_config(config)) if stored else shapes
  trained = _bytes_per_device(config, sizes, trainable)
  return {
      "mesh": sizes,
      "params": _bytes_per_device(config, sizes, shapes),
      "gradients": trained,
      "optimizer_state": 2 * trained,          # AdamW: first and second moments
      "activations": activation_bytes_per_device(config, sizes, batch_size, seq_len),
      "total_params": sum(s.size for s in counted.values()),
      "trainable_params": sum(s.size for s in trainable.values()),
  }


def cache_bytes(config: config_dict.ConfigDict, batch_size: int, cache_length: int,
                cache_dtype: str = "bfloat16") -> dict:
  """Bytes of the decoding caches of `batch_size` rows covering `cache_length` positions
  (keys, values, int8 caches' scales and slot positions, all devices together;
  `cache_dtype` one of `kv_cache.CACHE_DTYPES`): "cache" as built, local
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
