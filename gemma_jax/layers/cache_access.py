"""How an attention layer keeps its keys and values between calls: the cache accesses
that replace its mask, and the reads and writes of its "cache" collection they imply.

Contiguous rings (`Prefill`, `Decode`, `Extend`; gemma_jax.inference.decoding): "k",
"v" [B, S, K, H] per layer, a row's S slots its own. Paged pools (`Paged`;
gemma_jax.serving): "k", "v" [N x P, K, H] per layer, N pages of P tokens shared by all
sequences; a sequence's view is the pages its page table lists, in order. int8 caches
keep float32 scales "k_scale", "v_scale" beside them (`gemma_jax.layers.kv_cache`).
Which position each slot holds is the caller's bookkeeping, shared by every layer of one
attention type; it gives the mask.

Dims: B batch, T new tokens, S slots a row attends over, K key/value heads, H head dim,
N pages, P tokens a page, W pages in a row's view.
"""

from typing import Any, NamedTuple, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers import kv_cache

KV_AXES = ("batch", "length", "kv_heads", "head_dim")


class Prefill(NamedTuple):
  """Fill the cache: attend over the T new keys under `mask` (the prompt's own mask, in
  any form a layer takes: [B, T, T], `LocalBlocks`, `CausalBlocks` or `CausalMask`, so a
  long prompt skips masked work as a forward pass does), then store in the S cache slots
  the new keys and values at token indices `sources` [B, S] (slots the decoder marks
  empty hold anything)."""
  mask: Any
  sources: jax.Array


class Decode(NamedTuple):
  """Extend the cache: write the T new keys and values into the cache slots `slots`
  [B, T], then attend over all S slots under `mask` [B, T, S]."""
  mask: jax.Array
  slots: jax.Array


class Extend(NamedTuple):
  """Extend the cache by a chunk of T tokens at once: attend over the S slots as they
  were and the T new keys, under `mask` [B, T, S + T]; then write new key and value t
  into slot `slots` [B, T] (S or more: not written, as for padding, or for the older
  tokens of a chunk longer than the ring)."""
  mask: jax.Array
  slots: jax.Array


class Paged(NamedTuple):
  """Extend a paged cache: write new key and value t into pool slot `slots` [B, T] (page
  x P + offset; N x P or more: not written), then attend over the row's view, the pages
  `pages` [B, W] in order (W x P slots), under `mask` [B, T, W x P]. A query must not
  need a slot the same call overwrites (the caller's rings leave room for a chunk)."""
  mask: jax.Array
  pages: jax.Array
  slots: jax.Array


CACHE_ACCESSES = (Prefill, Decode, Extend, Paged)


def own_mask(mask: Any) -> Any:
  """The mask a layer attends under, a cache access's own or `mask` itself."""
  return mask.mask if isinstance(mask, CACHE_ACCESSES) else mask


def keys_values(module: nn.Module, k: jax.Array, v: jax.Array,
                mask: Any) -> Tuple[jax.Array, jax.Array]:
  """Inside `module`'s call: the new keys and values [B, T, K, H] -> those to attend over
  under `mask`, after the cache access it may be (without one: k, v themselves)."""
  pairs = (("k", k), ("v", v))
  if isinstance(mask, Prefill):
    for name, new in pairs:
      module.put_variable("cache", name,
                          jnp.take_along_axis(new, mask.sources[:, :, None, None], axis=1))
  elif isinstance(mask, Decode):
    k, v = (_write(module, name, new, mask.slots) for name, new in pairs)
  elif isinstance(mask, Extend):
    k, v = (_extend(module, name, new, mask.slots) for name, new in pairs)
  elif isinstance(mask, Paged):
    k, v = (_paged(module, name, new, mask) for name, new in pairs)
  return k, v


def _extend(module: nn.Module, name: str, new: jax.Array, slots: jax.Array) -> jax.Array:
  """The ring `name` [B, S, K, H] as it was, then new [B, T, K, H] (the keys or values an
  `Extend` attends over, [B, S + T, K, H] in the compute dtype); writes the new ones
  into `slots` [B, T] (S: not written)."""
  before = _read(module, name)
  _write(module, name, new, slots)
  return jnp.concatenate([before, new.astype(module.dtype)], axis=1)


def _read(module: nn.Module, name: str) -> jax.Array:
  """The ring `name` [B, S, K, H] in the compute dtype (an int8 ring dequantized)."""
  ring = module.get_variable("cache", name)
  if ring.dtype == jnp.int8:
    ring = kv_cache.dequantize(ring, module.get_variable("cache", kv_cache.scale_name(name)),
                               module.dtype)
  return nn.with_logical_constraint(ring.astype(module.dtype), KV_AXES)


def _write(module: nn.Module, name: str, new: jax.Array, slots: jax.Array) -> jax.Array:
  """Writes new [B, T, K, H] into the cache ring `name` [B, S, K, H] at slots [B, T] (a
  slot past the ring: not written); returns the ring in the compute dtype. An int8
  ring takes the rows quantized and their scales into its scale ring."""
  ring = module.get_variable("cache", name)
  chex.assert_shape(slots, new.shape[:2])
  rows = jnp.arange(new.shape[0])[:, None]
  if ring.dtype == jnp.int8:
    new, scale = kv_cache.quantize(new)
    scales = module.get_variable("cache", kv_cache.scale_name(name))
    module.put_variable("cache", kv_cache.scale_name(name),
                        scales.at[rows, slots].set(scale, mode="drop"))
  module.put_variable("cache", name, ring.at[rows, slots].set(new.astype(ring.dtype),
                                                              mode="drop"))
  return _read(module, name)


def _paged(module: nn.Module, name: str, new: jax.Array, access: Paged) -> jax.Array:
  """Writes new [B, T, K, H] into the pool `name` [N x P, K, H] at `access.slots`, then
  returns the rows' views [B, W x P, K, H] in the compute dtype."""
  pool = module.get_variable("cache", name)
  chex.assert_shape(access.slots, new.shape[:2])
  b, w = access.pages.shape
  page_size = access.mask.shape[-1] // w
  flat = access.slots.reshape(-1)
  rows = new.reshape(-1, *new.shape[2:])                                  # [B x T, K, H]
  scale_name = kv_cache.scale_name(name)
  if pool.dtype == jnp.int8:
    rows, scale = kv_cache.quantize(rows)
    scales = module.get_variable("cache", scale_name).at[flat].set(scale, mode="drop")
    module.put_variable("cache", scale_name, scales)
  pool = pool.at[flat].set(rows.astype(pool.dtype), mode="drop")
  module.put_variable("cache", name, pool)

  def view(a):   # [N x P, ...] -> [B, W x P, ...], the listed pages in order
    pages = a.reshape(-1, page_size, *a.shape[1:])
    return pages[access.pages].reshape(b, w * page_size, *a.shape[1:])

  out = view(pool)
  if pool.dtype == jnp.int8:
    out = kv_cache.dequantize(out, view(module.get_variable("cache", scale_name)), module.dtype)
  return nn.with_logical_constraint(out.astype(module.dtype), KV_AXES)
