"""KV-cached decoding as two pure functions: `make_decoding(config) -> Decoding`.

    dec = make_decoding(config)
    logits, cache = dec.prefill(params, prompts, lengths, cache_length=256)   # [B, V]
    logits, cache = dec.decode_step(params, next_tokens, cache)               # [B, V]
    logits, cache = dec.extend(params, more_tokens, cache)     # [B, C] -> [B, V]
    logits, cache = dec.extend(params, padded, cache, lengths)  # right-padded rows

Prompts are right-padded rows [B, P] with `lengths` [B] real tokens each; a row's
tokens sit at positions 0, 1, ... and every row decodes at its own position. Each layer
keeps its keys and values in a ring of S slots, a token at position p in slot p % S:
S = cache_length on global layers, min(sliding_window, cache_length) on local ones,
so 5 layers in 6 hold a window, not the context; `cache_dtype="int8"` stores them as
int8 with a scale per token and head (`gemma_jax.layers.kv_cache`). The masks come from
the positions each slot holds (-1: empty), so no query sees padding, an empty slot, or
a key outside its window.

The layers run unrolled whatever `scan_layers` says: under a scan each decode step
would slice every layer's weights out of their stack, a copy of the whole model per
token (on the CPU, where the scan copies them, decoding ran at half the speed). The
functions take either parameter layout; a scanned tree is unstacked inside each call,
so a caller that makes many calls converts it once with `Decoding.unrolled` (`Sampler`,
`generate` and `ChatSession` do). For the same reason, on the CPU that conversion also
splits each MoE layer's experts into one array per expert (`moe.split_experts`): a token
then reads its k experts where they lie (`expert_dispatch.switched`), where slicing them
out of their [E, ...] stack copied each one first (docs/performance.md). The prefill
stacks them back for its grouped products.

Dims: B batch, P prompt length, S cache slots, K key/value heads, H head dim, V vocab.
"""

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax import transformer
from gemma_jax.decoder import layer_masks, layer_types, unstack_layers
from gemma_jax.inference import decode_jit
from gemma_jax.layers import kv_cache
from gemma_jax.layers import moe
from gemma_jax.layers.attention import attention_mask
from gemma_jax.layers.cache_access import Decode, Extend, Prefill
from gemma_jax.models import towers
from gemma_jax.models.gemma3 import vision
from gemma_jax.transformer import _check_positions, _check_tokens


class Cache(NamedTuple):
  """The decoding state of a batch; a pytree.

  layers: the layers' "cache" collection, the unrolled parameter tree's layout with "k"
    and "v" [B, S, K, H] under each layer's attention (`layers_{i}`); int8 ones with
    their scales "k_scale", "v_scale" [B, S, K] float32 (`gemma_jax.layers.kv_cache`).
  positions: {attention type: [B, S] int32}, the position each slot holds, -1 if none.
  next_position: [B] int32, the position of each row's next token.
  """
  layers: dict
  positions: dict
  next_position: jax.Array


# Tokens `extend` computes per pass: its logits are at most [B, N, 512, S + 512].
EXTEND_CHUNK = 512


def ring_sizes(config: config_dict.ConfigDict, cache_length: int) -> dict:
  """{attention type present: S}: cache_length for global layers, the window (at
  most cache_length) for local ones."""
  return {kind: min(config.sliding_window, cache_length) if kind == "local" else cache_length
          for kind in sorted(set(layer_types(config)))}


def default_cache_dtype(config: config_dict.ConfigDict) -> str:
  """bfloat16 on accelerators, the compute dtype on the CPU."""
  return config.model.dtype if jax.default_backend() == "cpu" else "bfloat16"


def _window(config: config_dict.ConfigDict, kind: str) -> Optional[int]:
  return config.sliding_window if kind == "local" else None


def _ring_sources(lengths: jax.Array, size: int):
  """For rows of `lengths` tokens at positions 0..length-1, the ring of `size` slots
  holding the latest of them: (token index of each slot [B, S], its position or -1)."""
  slot = jnp.arange(size)
  latest = slot + size * ((lengths[:, None] - 1 - slot) // size)
  return jnp.maximum(latest, 0), jnp.where(latest >= 0, latest, -1).astype(jnp.int32)


def check_lengths(tokens, lengths, name: str = "lengths") -> None:
  """Raises ValueError unless `lengths` has shape [B] of tokens [B, C] and, when concrete,
  every value is in 1..C."""
  if tuple(np.shape(lengths)) != tuple(tokens.shape[:1]):
    raise ValueError(f"{name} must have shape [batch] = {tokens.shape[:1]}, got "
                     f"{np.shape(lengths)}")
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    bad = (values < 1) | (values > tokens.shape[1])
    if bad.any():
      row = int(np.argwhere(bad)[0, 0])
      raise ValueError(f"{name}[{row}] = {values[row]} is outside [1, {tokens.shape[1]}] "
                       "(the width of the padded tokens)")


def check_prompts(tokens, lengths, cache_length: int, vocab_size: int) -> None:
  """Raises ValueError naming what is wrong with right-padded prompts for a cache."""
  _check_tokens(tokens, vocab_size, "prompt tokens")
  check_lengths(tokens, lengths)
  if tokens.shape[1] > cache_length:
    raise ValueError(f"prompt of {tokens.shape[1]} tokens is longer than cache_length="
                     f"{cache_length}")


def _check_text(tokens, model: config_dict.ConfigDict, method: str) -> None:
  """Raises ValueError when concrete tokens [B, C] hold an image placeholder: `method`
  runs text only, and a placeholder without its image would be read as a word. (Not
  checked in decode_step, whose tokens are sampled: a model may emit the id.)"""
  if not model.vision.enabled or isinstance(tokens, jax.core.Tracer):
    return
  found = np.argwhere(np.asarray(tokens) == model.vision.image_token_id)
  if found.size:
    row, col = found[0]
    raise ValueError(f"tokens[{row}, {col}] is the image placeholder id "
                     f"{model.vision.image_token_id}: {method} takes text only; a prompt "
                     "with images goes in through prefill(..., images=...)")


class Decoding:
  """A config's decoding programs, all jitted: `prefill(params, tokens, lengths, *,
  cache_length, cache_dtype) -> (logits, cache)`, `decode_step(params, tokens, cache) ->
  (logits, cache)`, `extend(params, tokens, cache, lengths) -> (logits, cache)`,
  `unrolled(params)` -> the parameters with one entry per layer (a copy of a scanned
  tree; an unrolled one is returned as it is), on the CPU with each MoE layer's experts
  split (`moe.split_experts`), and `fill(params, tokens, lengths, *, cache_length,
  cache_dtype) -> (last tokens, cache)`, a prefill but its decode step. Equal only to
  itself: jitted code that takes it as a static argument compiles once per instance."""

  def __init__(self, config: config_dict.ConfigDict):
    config_lib.validate(config)
    self.config = config
    self.model = config_dict.FrozenConfigDict(config.model)
    unrolled_config = config_dict.ConfigDict(config.to_dict())
    unrolled_config.model.scan_layers = False
    self._module = transformer.decoder_module(unrolled_config)
    self._split_experts = (self.model.num_experts and self.model.quant == "none"
                           and jax.default_backend() == "cpu")
    self.unrolled = jax.jit(self._unrolled)
    self._step = decode_jit.jit(self._decode, donate_argnames="cache")
    self._fill = decode_jit.jit(self._fill_caches,
                                static_argnames=("cache_length", "cache_dtype"))
    self._extend = decode_jit.jit(self._extend_but_last, donate_argnames="cache")

  def _unrolled(self, params: dict) -> dict:
    params = unstack_layers(params, self.model)
    return moe.split_experts(params) if self._split_experts else params

  def apply_with_cache(self, params, layers, tokens, positions, segment_ids, masks,
                       images=None, soft_tokens=None):
    """The decoder with cache accesses `masks` (`layers.cache_access`) over the "cache"
    collection `layers` (None: none yet): (logits, the collection after). Traceable;
    `images` or `soft_tokens` as `Decoder` takes them."""
    params = self._unrolled(params)
    variables = {"params": params} if layers is None else {"params": params, "cache": layers}
    logits, state = self._module.apply(variables, tokens, positions, segment_ids,
                                       masks=masks, images=images, soft_tokens=soft_tokens,
                                       mutable=["cache"])
    return logits, state["cache"]

  def _decode(self, params, tokens: jax.Array, cache: Cache):
    """tokens [B] at each row's next position -> (logits [B, V], cache)."""
    position = cache.next_position
    rows = jnp.arange(tokens.shape[0])
    positions, masks = {}, {}
    for kind, ring in cache.positions.items():
      slot = position % ring.shape[1]
      positions[kind] = ring.at[rows, slot].set(position)
      mask = attention_mask(position[:, None], positions[kind], jnp.ones_like(tokens[:, None]),
                            (positions[kind] >= 0).astype(jnp.int32),
                            window=_window(self.model, kind))
      masks[kind] = Decode(mask, slot[:, None])
    logits, layers = self.apply_with_cache(params, cache.layers, tokens[:, None],
                                           position[:, None], jnp.ones_like(tokens[:, None]),
                                           masks)
    return logits[:, 0], Cache(layers, positions, position + 1)

  def _fill_caches(self, params, tokens, lengths, images, cache_length, cache_dtype):
    # All but each row's last token fill the caches (their logits are never computed, so
    # XLA drops the last layer's attention output and MLP); the last one is left to a
    # decode step, whose logits are the prefill's. Image spans are bidirectional in the
    # prompt; a whole span ends with its end-of-image token, so none reaches the last
    # token.
    chunk = tokens[:, :max(tokens.shape[1] - 1, 1)]
    filled = lengths - 1
    index = jnp.broadcast_to(jnp.arange(chunk.shape[1]), chunk.shape)
    segment_ids = (index < filled[:, None]).astype(jnp.int32)
    spans = (vision.image_span_ids(chunk, self.model.vision.image_token_id) * segment_ids
             if images is not None else None)
    prompt_masks = layer_masks(self.model, segment_ids, spans, blocked=True)
    positions, masks = {}, {}
    for kind, size in ring_sizes(self.model, cache_length).items():
      sources, positions[kind] = _ring_sources(filled, size)
      masks[kind] = Prefill(prompt_masks[kind], sources)
    _, layers = self.apply_with_cache(params, None, chunk, index, segment_ids, masks, images)
    layers = kv_cache.store(layers, cache_dtype)
    last = jnp.take_along_axis(tokens, filled[:, None], axis=1)[:, 0]
    return last, Cache(layers, positions, filled)

  def fill(self, params: dict, tokens: jax.Array, lengths: Optional[jax.Array] = None, *,
           cache_length: int, cache_dtype: Union[str, jnp.dtype, None] = None,
           images: Optional[jax.Array] = None):
    """Fills the caches with all but each row's last prompt token: (those last tokens [B]
    int32, Cache). `decode_step` of them is `prefill`; a loop whose first step feeds them
    (`sampler.generate`) holds one decode step in its program, not two. Arguments as in
    `prefill`."""
    if lengths is None:
      lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
    check_prompts(tokens, lengths, cache_length, self.model.vocab_size)
    if self.model.trainable_position_size and cache_length > self.model.trainable_position_size:
      raise ValueError(f"cache_length={cache_length} exceeds the model's "
                       f"trainable_position_size={self.model.trainable_position_size}")
    dtype = kv_cache.check_dtype(cache_dtype or default_cache_dtype(self.config))
    towers.check_image_inputs(tokens, images, self.model)
    return self._fill(params, tokens, jnp.asarray(lengths, jnp.int32), images, cache_length, dtype)

  def prefill(self, params: dict, tokens: jax.Array, lengths: Optional[jax.Array] = None, *,
              cache_length: int, cache_dtype: Union[str, jnp.dtype, None] = None,
              images: Optional[jax.Array] = None):
    """Fills the caches with prompts: (logits [B, V] float32 after each row's last prompt
    token, Cache). Two programs called eagerly: `fill`'s, then the decode step's, which
    later decode steps share.

    Args:
      params: the model's parameters.
      tokens: [B, P] int prompt ids, right-padded.
      lengths: [B] real tokens per row (1..P); default: P for every row.
      cache_length: positions the caches cover: prompt plus generated tokens. Past it,
        global layers forget their oldest keys.
      cache_dtype: dtype of the cached keys and values, one of `kv_cache.CACHE_DTYPES`:
        float32, bfloat16, float16, or int8 (a float32 scale per token and head beside
        them, see `gemma_jax.layers.kv_cache`); default `default_cache_dtype`.
      images: the images of the prompts' placeholder spans (a model with
        `vision.enabled`; see `Transformed.apply`).
    """
    return self._step(params, *self.fill(params, tokens, lengths, cache_length=cache_length,
                                         cache_dtype=cache_dtype, images=images))

  def decode_step(self, params: dict, tokens: jax.Array, cache: Cache):
    """One token per row, tokens [B] int, at each row's next position: (logits [B, V]
    float32, the cache with it). The cache passed in is donated (do not reuse it).
    Under jit the positions are not checked against a learned position table (see
    `sampler.Sampler`, which checks the prompt plus new tokens once)."""
    if tokens.shape != cache.next_position.shape:
      raise ValueError(f"tokens must have shape [batch] = {cache.next_position.shape}, got "
                       f"{tokens.shape}")
    _check_tokens(tokens[:, None], self.model.vocab_size)
    _check_positions(cache.next_position, self.model.trainable_position_size, "cache.next_position")
    return self._step(params, tokens, cache)

  def _chunk(self, params, tokens: jax.Array, counts: jax.Array, cache: Cache) -> Cache:
    """tokens [B, T] at each row's next positions, of which each row's first `counts` [B]
    are its own and the rest padding, attending over the cache and each other in one call
    (`cache_access.Extend`) -> the cache with the real ones. A query sees what it would see
    decoded token by token: filled slots and earlier chunk tokens, the last S positions
    of a ring of S slots (on local layers, S is at most the window). Padding is neither
    stored nor seen; its queries sit at the row's next position, a valid one, so that a
    learned position table gives them finite values."""
    b, t = tokens.shape
    index = jnp.arange(t, dtype=jnp.int32)
    real = index < counts[:, None]                                          # [B, T]
    new = cache.next_position[:, None] + index                              # [B, T]
    queries = jnp.where(real, new, cache.next_position[:, None])
    rows = jnp.arange(b)[:, None]
    positions, masks = {}, {}
    for kind, ring in cache.positions.items():
      size = ring.shape[1]
      kept = real & (index >= counts[:, None] - size)   # the row's latest S stay in the ring
      slots = jnp.where(kept, new % size, size)          # slot S: not written
      keys = jnp.concatenate([ring, new], axis=1)   # padding follows: causality hides it
      mask = attention_mask(queries, keys, jnp.ones_like(new), (keys >= 0).astype(jnp.int32),
                            window=size)
      masks[kind] = Extend(mask, slots)
      positions[kind] = ring.at[rows, slots].set(new, mode="drop")
    _, layers = self.apply_with_cache(params, cache.layers, tokens, queries,
                                      jnp.ones_like(tokens), masks)
    return Cache(layers, positions, cache.next_position + counts)

  def _extend_but_last(self, params, tokens, lengths, cache):
    # All but each row's last token go in as chunks of EXTEND_CHUNK (their logits are
    # never computed), a scan over the whole ones then the rest: (the last tokens [B],
    # the cache), the last left to a decode step as in `fill`.
    params = self._unrolled(params)
    body, counts = tokens[:, :-1], lengths - 1
    whole = body.shape[1] // EXTEND_CHUNK * EXTEND_CHUNK
    if whole:
      pieces = body[:, :whole].reshape(body.shape[0], -1, EXTEND_CHUNK).swapaxes(0, 1)
      starts = jnp.arange(0, whole, EXTEND_CHUNK, dtype=jnp.int32)

      def piece_in(cache, piece_and_start):
        piece, start = piece_and_start
        return self._chunk(params, piece, jnp.clip(counts - start, 0, EXTEND_CHUNK), cache), None

      cache, _ = jax.lax.scan(piece_in, cache, (pieces, starts))
    if body.shape[1] > whole:
      cache = self._chunk(params, body[:, whole:], jnp.maximum(counts - whole, 0), cache)
    return jnp.take_along_axis(tokens, counts[:, None], axis=1)[:, 0], cache

  def extend(self, params: dict, tokens: jax.Array, cache: Cache,
             lengths: Optional[jax.Array] = None):
    """Continues every row's cached context with its tokens, tokens [B, C] int
    right-padded to `lengths` [B] real tokens a row (1..C; default C): (logits [B, V]
    float32 after each row's last one, the cache with them). Only the new tokens are
    computed, in passes of up to `EXTEND_CHUNK` over the cache (local rings and global
    capacity behave as in decoding them one by one); a chat turn added to a
    conversation costs its own tokens, not the conversation's. Padding is neither
    stored nor attended to, so one program (one C) serves chunks of any length up to C,
    and rows of different lengths extend together. Called eagerly it runs that program,
    then the decode step's (for each row's last token), which every C shares. The cache
    passed in is donated."""
    if tokens.ndim != 2 or tokens.shape[:1] != cache.next_position.shape or not tokens.shape[1]:
      raise ValueError(f"tokens must have shape [batch={cache.next_position.shape[0]}, C >= 1], "
                       f"got {tokens.shape}")
    if lengths is None:
      lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
    check_lengths(tokens, lengths)
    _check_tokens(tokens, self.model.vocab_size)
    _check_text(tokens, self.model, "extend")
    _check_positions(cache.next_position + jnp.asarray(lengths) - 1,
                     self.model.trainable_position_size, "cache.next_position + lengths - 1")
    if tokens.shape[1] == 1:
      return self._step(params, tokens[:, 0], cache)
    return self._step(params, *self._extend(params, tokens, jnp.asarray(lengths, jnp.int32), cache))


def make_decoding(config: config_dict.ConfigDict) -> Decoding:
  """Validates `config` and returns its jitted decoding programs."""
  return Decoding(config)
