"""int8 KV caches: keys and values stored as int8 with a float32 scale per token and head.

Symmetric absmax per token and key/value head: a row x [H] gets scale s = max|x| / 127
and values round(x / s) in [-127, 127] (an all-zero row: scale 0, values 0). Beside
each cached "k" and "v" [B, S, K, H] (int8) lie "k_scale" and "v_scale" [B, S, K]
(float32): H + 4 bytes per token and head instead of 2 H in bfloat16.

Prefill attends over its prompt in the compute dtype and `store` quantizes the filled
caches once; each decode step quantizes its new rows into the rings (`Attention`) and
attends over the rings dequantized to the compute dtype.

Dims: B batch, T tokens, S cache slots, K key/value heads, H head dim.
"""

from collections.abc import Mapping
from typing import Tuple, Union

import jax
import jax.numpy as jnp

from gemma_jax.config import DTYPES

INT8 = "int8"
CACHE_DTYPES = DTYPES + (INT8,)   # what `prefill(..., cache_dtype=)` accepts


def scale_name(name: str) -> str:
  """The scales' entry beside the int8 cache entry `name` ("k" -> "k_scale")."""
  return f"{name}_scale"


def check_dtype(cache_dtype: Union[str, jnp.dtype]) -> str:
  """The name of a cache dtype given as a string or dtype; ValueError naming it unless
  it is one of `CACHE_DTYPES`."""
  try:
    name = jnp.dtype(cache_dtype).name
  except TypeError:
    name = None
  if name not in CACHE_DTYPES:
    raise ValueError(f"unknown cache dtype {cache_dtype!r}; known: {', '.join(CACHE_DTYPES)}")
  return name


def quantize(x: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """x [B, T, K, H] -> (values [B, T, K, H] int8, scale [B, T, K] float32)."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=-1) / 127
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  values = jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8)
  return values, scale


def dequantize(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """`quantize` undone: values [B, S, K, H] * scale [B, S, K] in `dtype`."""
  return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def store(layers: Mapping, cache_dtype: str) -> dict:
  """A "cache" collection of float keys and values ("k", "v" [B, S, K, H] under each
  layer) in the stored form of `cache_dtype` (one of `CACHE_DTYPES`): cast, or for
  int8 quantized with their scales beside them."""
  if cache_dtype != INT8:
    return jax.tree.map(lambda a: a.astype(cache_dtype), layers)
  stored = {}
  for name, value in layers.items():
    if isinstance(value, Mapping):
      stored[name] = store(value, cache_dtype)
    else:
      stored[name], stored[scale_name(name)] = quantize(value)
  return stored
