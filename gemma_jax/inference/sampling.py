"""How a token is picked from logits: greedy, or a draw at a temperature among the top-k
likeliest and then the top-p nucleus.

    options = Sampling.of(temperature=0.8, top_k=40, top_p=0.95)
    tokens = choose(logits, rng, options)              # [B, V] -> [B]

`Sampling` is a pytree whose values (temperature, k, p) are traced and whose shape
(greedy or not, the largest k compiled for, whether a nucleus is cut) is static: a
jitted loop compiles once per shape, and every temperature, every p and every k up to
the same power of two (at least 64) reuse that program.

Dims: B batch, V vocab, K the largest k compiled for, N blocks of S (DRAW_BLOCK)
probabilities.
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

MIN_TOP_K_LIMIT = 64
DRAW_BLOCK = 512   # probabilities summed per block when a token is drawn


def check_options(temperature: float, top_k: int, top_p: float,
                  vocab_size: Optional[int] = None) -> None:
  """Raises ValueError naming the first sampling option out of range (top_k against
  `vocab_size` when given)."""
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
  if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
    raise ValueError(f"top_k must be an integer >= 0 (0: all tokens), got {top_k!r}")
  if vocab_size is not None and top_k > vocab_size:
    raise ValueError(f"top_k={top_k} exceeds the vocabulary of {vocab_size} tokens")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must lie in (0, 1] (1: all tokens), got {top_p}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
  """Sampling options; build them with `Sampling.of`.

  temperature, top_k, top_p: the values, scalars (traced under jit).
  greedy: argmax, the values unused. top_k_limit: the largest k the program handles (0:
  no top-k cut). nucleus: whether a top-p cut is made (top_p < 1).
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  greedy: bool = dataclasses.field(metadata=dict(static=True))
  top_k_limit: int = dataclasses.field(metadata=dict(static=True))
  nucleus: bool = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def of(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
         vocab_size: Optional[int] = None) -> "Sampling":
    """temperature 0 is greedy (argmax). Otherwise a draw from softmax(logits /
    temperature) restricted to the top_k likeliest tokens (0: all; ties with the k-th
    kept), then to the smallest set of the likeliest whose probability reaches top_p (1:
    all), in that order. Checked here (top_k against `vocab_size` when given)."""
    check_options(temperature, top_k, top_p, vocab_size)
    limit = 0
    if top_k and temperature > 0:
      limit = max(MIN_TOP_K_LIMIT, 1 << (int(top_k) - 1).bit_length())
    if vocab_size is not None:
      limit = min(limit, vocab_size)
    return cls(np.float32(temperature), np.int32(top_k), np.float32(top_p),
               greedy=bool(temperature == 0), top_k_limit=limit,
               nucleus=bool(temperature > 0 and top_p < 1))


GREEDY = Sampling.of()


def _ordered_keys(x: jax.Array) -> jax.Array:
  """float32 -> uint32 of the same order (-inf lowest; -0 and 0 one key)."""
  bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def nucleus(logits: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits [B, V] -> [B, V] with -inf outside each row's top-p nucleus: the tokens whose
  logit is at least the smallest logit t with less than top_p of the probability
  strictly above it. t is found by bisection over the logits' order (32 halvings, each
  one masked sum over V) instead of sorting V."""
  probs = jax.nn.softmax(logits, axis=-1)
  keys = _ordered_keys(logits)

  def halve(_, bounds):
    low, high = bounds     # the smallest key with mass above it < top_p lies in [low, high]
    mid = low + (high - low) // 2
    small = jnp.sum(jnp.where(keys > mid[:, None], probs, 0.0), axis=-1) < top_p
    return jnp.where(small, low, mid + 1), jnp.where(small, mid, high)

  rows = logits.shape[0]
  bounds = (jnp.zeros((rows,), jnp.uint32), jnp.full((rows,), 0xFFFFFFFF, jnp.uint32))
  _, floor = jax.lax.fori_loop(0, 32, halve, bounds)
  return jnp.where(keys < floor[:, None], -jnp.inf, logits)


def choose(logits: jax.Array, rng: Optional[jax.Array], options: Sampling) -> jax.Array:
  """logits [B, V] -> token ids [B] int32, as `options` say (see `Sampling.of`; `rng`
  unused when greedy)."""
  if options.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / options.temperature
  if options.top_k_limit:
    top = jax.lax.top_k(logits, min(options.top_k_limit, logits.shape[-1]))[0]   # [B, K]
    kth = jnp.take(top, jnp.asarray(options.top_k) - 1, axis=-1)[:, None]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if options.nucleus:
    logits = nucleus(logits, options.top_p)
  return draw(logits, rng)


def draw(logits: jax.Array, rng: jax.Array) -> jax.Array:
  """logits [B, V] -> [B] int32, one draw per row from softmax(logits): the inverse of
  the cumulative probability at one uniform number, located in two levels (the sums of
  blocks of DRAW_BLOCK probabilities, then within the block). A token of probability 0
  is never drawn. `jax.random.categorical` draws a Gumbel number per logit instead,
  about ten times the cost of this whole choice at Gemma's vocabulary on a CPU
  (`benchmarks/sampling_cost.py`)."""
  rows, vocab = logits.shape
  blocks = -(-vocab // DRAW_BLOCK)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  probs = jnp.pad(probs, ((0, 0), (0, blocks * DRAW_BLOCK - vocab)))
  probs = probs.reshape(rows, blocks, DRAW_BLOCK)                         # [B, N, S]
  sums = jnp.sum(probs, axis=-1)                                          # [B, N]
  ends = jnp.cumsum(sums, axis=-1)
  u = jax.random.uniform(rng, (rows,)) * ends[:, -1]
  block = _within_nonzero(jnp.sum(ends <= u[:, None], axis=-1), sums)
  picked = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]   # [B, S]
  start = jnp.take_along_axis(ends - sums, block[:, None], axis=1)[:, 0]
  offset = jnp.sum(jnp.cumsum(picked, axis=-1) <= (u - start)[:, None], axis=-1)
  return (block * DRAW_BLOCK + _within_nonzero(offset, picked)).astype(jnp.int32)


def _within_nonzero(index: jax.Array, weights: jax.Array) -> jax.Array:
  """index [B] clipped to the span of each row's nonzero `weights` [B, N]: rounding in
  the cumulative sums must not land on a weightless end."""
  positions = jnp.arange(weights.shape[-1])
  first = jnp.min(jnp.where(weights > 0, positions, weights.shape[-1]), axis=-1)
  last = jnp.max(jnp.where(weights > 0, positions, 0), axis=-1)
  return jnp.clip(index, first, last)
