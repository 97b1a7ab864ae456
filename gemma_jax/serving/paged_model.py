"""The model's programs over paged KV caches: a chunk of prompt into the pools, and one
decode step of every slot with its token chosen, each compiled once per shape.

Each attention type has a pool of N pages of P tokens per layer ("k", "v" [N x P, K, H],
`layers.cache_access.Paged`); shared key/value layers (Gemma 4) hold none. Rows give
their pages by logical block: `tables[type]` [R, M] lists the page of block b (tokens
bP..bP + P - 1) of each row, M = max_length / P. A global layer attends over all M
blocks; a local one over the blocks its window and the chunk reach, ceil((window + T -
1) / P) + 1 of them from the block of the chunk's first query's window, so its cost is
the window's, not the context's. Positions follow from the blocks, so no page holds
bookkeeping: a slot at block b, offset o holds position bP + o, seen where written
(below start + count) and allowed by causality and the window. Pages a row no longer
needs (local blocks behind the window) may hold anything: they are masked.

Dims: R rows, T tokens a row, S decode slots, V vocab, M blocks a row, W blocks a view.
"""

from typing import Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
from ml_collections import config_dict

from gemma_jax import sharding
from gemma_jax.decoder import layer_types
from gemma_jax.inference import decode_jit
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.layers.attention import attention_mask
from gemma_jax.layers.cache_access import Paged
from gemma_jax.models import towers
from gemma_jax.models.gemma3 import vision
from gemma_jax.serving import sampling


class Shape(NamedTuple):
  """The engine's compiled shapes: page size P, pages per type, blocks per row M, decode
  slots S, prompt rows per chunk and chunk length T, the top-k and logprobs the
  sampling step handles."""
  page_size: int
  num_pages: Dict[str, int]
  max_blocks: int
  num_slots: int
  prefill_rows: int
  prefill_chunk: int
  top_k_limit: int
  num_logprobs: int


def view_blocks(model: config_dict.ConfigDict, kind: str, page_size: int, max_blocks: int,
                chunk: int) -> int:
  """W, the blocks a row of `chunk` tokens attends over in a layer of type `kind`."""
  if kind != "local":
    return max_blocks
  reach = -(-(model.sliding_window + chunk - 1) // page_size) + 1
  return min(reach, max_blocks)


def paged_accesses(model: config_dict.ConfigDict, shape: Shape, tables: dict,
                   starts: jax.Array, counts: jax.Array, chunk: int,
                   spans: Optional[jax.Array] = None):
  """{type: `Paged`} and the query positions [R, T] for rows writing `counts` [R] tokens
  from positions `starts` [R] (a row's tokens past its count are padding: not written,
  queried at its start). spans [R, T]: image span ids of the tokens, bidirectional in
  `bidirectional_span_types` (a span lies within one call)."""
  p = shape.page_size
  index = jnp.arange(chunk, dtype=jnp.int32)
  real = index < counts[:, None]
  new = starts[:, None] + index                                               # [R, T]
  queries = jnp.where(real, new, starts[:, None])
  accesses = {}
  for kind, table in tables.items():
    m, window = table.shape[1], model.sliding_window if kind == "local" else None
    page = jnp.take_along_axis(table, jnp.clip(new // p, 0, m - 1), axis=1)
    slots = jnp.where(real, page * p + new % p, shape.num_pages[kind] * p)
    first = jnp.maximum(starts - window + 1, 0) // p if window else jnp.zeros_like(starts)
    blocks = first[:, None] + jnp.arange(
        view_blocks(model, kind, p, shape.max_blocks, chunk))   # [R, W]
    pages = jnp.take_along_axis(table, jnp.clip(blocks, 0, m - 1), axis=1)
    keys = (blocks[:, :, None] * p + jnp.arange(p)).reshape(blocks.shape[0], -1)  # [R, W P]
    written = (keys < (starts + counts)[:, None]) & (keys < m * p)
    q_spans = kv_spans = None
    if spans is not None and kind in model.bidirectional_span_types:
      offset = keys - starts[:, None]                       # the key's index in the call
      q_spans = jnp.where(real, spans, 0)
      kv_spans = jnp.where((offset >= 0) & (offset < counts[:, None]), jnp.take_along_axis(
          q_spans, jnp.clip(offset, 0, chunk - 1), axis=1), 0)
    mask = attention_mask(queries, keys, jnp.ones_like(queries), written.astype(jnp.int32),
                          window=window, q_spans=q_spans, kv_spans=kv_spans)
    accesses[kind] = Paged(mask, pages, slots)
  return accesses, queries


class PagedModel:
  """A config's paged programs: `pools(params, cache_dtype)`, `prefill(params, pools,
  tokens, starts, counts, tables) -> pools`, and `decode(...)` (see each)."""

  def __init__(self, config: config_dict.ConfigDict, shape: Shape):
    self.decoding = decoding_lib.Decoding(config)
    self.model = self.decoding.model
    unrolled = config_dict.ConfigDict(config.model.to_dict())
    unrolled.scan_layers = False      # the layout the programs hold the parameters in
    self._unrolled_model = config_dict.FrozenConfigDict(unrolled)
    self.shape = shape
    self.types = tuple(sorted(set(layer_types(self.model))))
    # decode_jit: on a CPU, without the rewrite that costs small reductions a kernel more
    self.prefill = decode_jit.jit(self._prefill, donate_argnames="pools")
    self.soft = jax.jit(self._soft)
    self.decode = decode_jit.jit(self._decode, donate_argnames=("pools", "counts"))

  def pools(self, params, cache_dtype: str) -> dict:
    """Zeroed pools for every layer that keeps keys and values: the "cache" collection,
    [N x P, K, H] leaves (int8 ones with [N x P, K] scales)."""
    contiguous = jax.eval_shape(
        lambda p: self.decoding.fill(p, jnp.ones((1, 2), jnp.int32),
                                     cache_length=self.shape.page_size,
                                     cache_dtype=cache_dtype)[1].layers, params)
    types = layer_types(self.model)
    pools = {}
    for name, layer in contiguous.items():
      slots = self.shape.num_pages[types[int(name.split("_")[-1])]] * self.shape.page_size
      pools[name] = jax.tree.map(lambda a, n=slots: jnp.zeros((n,) + a.shape[2:], a.dtype),
                                 layer)
    return pools

  def _run(self, params, pools, tokens, starts, counts, tables, soft_tokens=None):
    spans = None
    if soft_tokens is not None:
      spans = vision.image_span_ids(tokens, self.model.vision.image_token_id)
    accesses, queries = paged_accesses(self.model, self.shape, tables, starts, counts,
                                       tokens.shape[1], spans)
    return self.decoding.apply_with_cache(params, pools, tokens, queries,
                                          jnp.ones_like(tokens), accesses,
                                          soft_tokens=soft_tokens)

  def _prefill(self, params, pools, tokens, starts, counts, tables, soft_tokens=None):
    """Writes rows of prompt tokens [R, T] (`counts` [R] real, from `starts` [R]) into the
    pools; no logits are computed. soft_tokens [R, T, D]: the image placeholders'
    embeddings (`towers.soft_embeddings`; a model with vision)."""
    return self._run(params, pools, tokens, starts, counts, tables, soft_tokens)[1]

  def _soft(self, params, tokens, images):
    """A prompt's placeholder embeddings [max_length, D] from its images (tokens
    [1, max_length])."""
    return towers.soft_embeddings(self._unrolled_model, params["vision"], tokens, images)[0]

  def _decode(self, params, pools, tokens, positions, active, tables, options, prompt_seen,
              counts, seeds, indices):
    """One token per slot, tokens [S] at `positions` [S] (rows not `active` write
    nothing), then each active row's next token chosen by its options, drawn with the
    key of (seeds [S], indices [S]) (`sampling.row_key`): (`sampling.Choice`, pools,
    counts with the choices)."""
    keys = jax.vmap(sampling.row_key)(seeds, indices)
    logits, pools = self._run(params, pools, tokens[:, None], positions,
                              active.astype(jnp.int32), tables)
    choice = sampling.choose_rows(logits[:, 0], options, prompt_seen, counts, keys,
                                  top_k_limit=self.shape.top_k_limit,
                                  num_logprobs=self.shape.num_logprobs)
    return choice, pools, sampling.update_counts(counts, choice.tokens, active)


def pool_shardings(pools: dict, mesh) -> dict:
  """The pools' shardings on `mesh`: key/value heads over the axes "kv_heads" maps to
  (whole where they do not divide), every page on every device."""
  def of(a):
    spec = sharding.to_mesh_axes(PartitionSpec(None, "kv_heads", "head_dim")[:a.ndim])
    ways = sharding.shard_ways(PartitionSpec(spec[1]), dict(mesh.shape))
    return NamedSharding(mesh, spec if a.shape[1] % ways == 0 else PartitionSpec())
  return jax.tree.map(of, pools)


def pool_bytes(pools: dict) -> int:
  """Bytes of the pools' arrays."""
  return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(pools)))
