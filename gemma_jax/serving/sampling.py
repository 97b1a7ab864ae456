"""Token choice per row of a serving step: every row (decode slot) has its own sampling
options, traced, so one compiled step serves any mix of them.

    options = RowOptions.of([slot.request.sampling for slot in slots])   # [S] each
    keys = jax.vmap(row_key)(seeds, generated)                           # [S]
    choice = choose_rows(logits, options, prompt_seen, generated_counts, keys,
                         top_k_limit=64, num_logprobs=5)
    generated_counts = update_counts(generated_counts, choice.tokens, active)

Per row, in this order: the penalties (repetition over the tokens of the prompt and the
output, then presence and frequency over the output's); temperature 0 takes the argmax;
otherwise the logits are divided by the temperature, cut to the top-k, to the top-p
nucleus and by the min-p floor, and one token is drawn with the row's own key, so a seed
gives the same text whatever else is in the batch. Each option means what
`requests.SamplingOptions` says.

Dims: S rows (decode slots), V vocab, K top_k_limit, L num_logprobs.
"""

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gemma_jax.inference import sampling
from gemma_jax.serving import requests

_DTYPES = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
               repetition_penalty=np.float32, presence_penalty=np.float32,
               frequency_penalty=np.float32)


class RowOptions(NamedTuple):
  """Per-row sampling options, each [S] (a pytree of arrays, traced under jit): top_k
  int32, the others float32. An idle row: `SamplingOptions(temperature=0.0)`."""
  temperature: ArrayLike
  top_k: ArrayLike
  top_p: ArrayLike
  min_p: ArrayLike
  repetition_penalty: ArrayLike
  presence_penalty: ArrayLike
  frequency_penalty: ArrayLike

  @classmethod
  def of(cls, options: Sequence[requests.SamplingOptions]) -> "RowOptions":
    """One row per entry of `options`, as numpy arrays."""
    return cls(**{name: np.asarray([getattr(o, name) for o in options], dtype)
                  for name, dtype in _DTYPES.items()})


class Choice(NamedTuple):
  """The tokens chosen, and log-probabilities under the model's own distribution
  log_softmax(logits), before penalties and cuts.

  tokens [S] int32; logprobs [S] float32, the chosen tokens'; top_ids [S, L] int32 and
  top_logprobs [S, L] float32, the L likeliest tokens, likeliest first.
  """
  tokens: jax.Array
  logprobs: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def row_key(seed: ArrayLike, index: ArrayLike) -> jax.Array:
  """The typed key of a request's index-th generated token, from its seed alone (a
  Python int, or int32 / uint32 under jit; vmaps over [S] seeds and indices)."""
  return jax.random.fold_in(jax.random.key(seed), index)


def penalize(logits: jax.Array, options: RowOptions, prompt_seen: jax.Array,
             generated_counts: jax.Array) -> jax.Array:
  """logits [S, V] float32 -> [S, V] after each row's penalties. prompt_seen [S, V] bool:
  the token is in the row's prompt; generated_counts [S, V] int32: how often the row
  generated it. Repetition over the tokens of either (positive logits divided by it,
  negative ones multiplied), then minus count * frequency and, once, presence."""
  generated = generated_counts > 0
  repetition = jnp.asarray(options.repetition_penalty)[:, None]
  seen = prompt_seen | generated
  logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition),
                     logits)
  return (logits - generated_counts * jnp.asarray(options.frequency_penalty)[:, None]
          - generated * jnp.asarray(options.presence_penalty)[:, None])


def warp(logits: jax.Array, options: RowOptions, top_k_limit: int) -> jax.Array:
  """Penalized logits [S, V] -> the logits each sampled row draws from [S, V]: divided by
  the temperature (rows of temperature 0 by 1), -inf outside the top_k likeliest (ties
  with the k-th kept; top_k 0: none cut), outside the top-p nucleus (top_p 1: none cut)
  and below the min-p floor. top_k_limit: static, the largest top_k the program handles
  (0: no top-k cut; a row's larger top_k is cut at it, the caller's error)."""
  temperature = jnp.asarray(options.temperature)
  logits = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  top_k = jnp.asarray(options.top_k)
  limit = min(top_k_limit, logits.shape[-1])
  if limit:
    logits = _where_asked(top_k > 0, lambda x: _top_k_cut(x, top_k, limit), logits)
  top_p = jnp.asarray(options.top_p)
  logits = _where_asked(top_p < 1, lambda x: sampling.nucleus(x, top_p), logits)
  # probability < min_p * the likeliest's, in logits: below max + log(min_p) (log 0: -inf)
  floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(options.min_p)[:, None]
  return jnp.where(logits < floor, -jnp.inf, logits)


def choose_rows(logits: jax.Array, options: RowOptions, prompt_seen: jax.Array,
                generated_counts: jax.Array, keys: jax.Array, *, top_k_limit: int,
                num_logprobs: int) -> Choice:
  """One token per row of logits [S, V], as the row's options say: the argmax of the
  penalized logits where temperature is 0, else a draw from the `warp`ed ones with the
  row's key (keys [S], typed). prompt_seen, generated_counts: see `penalize`.
  top_k_limit: see `warp`; num_logprobs: L, the top alternatives returned (0: none).
  Both static: one program serves every value of the options."""
  logits = logits.astype(jnp.float32)
  penalized = penalize(logits, options, prompt_seen, generated_counts)
  sampled = jnp.asarray(options.temperature) > 0

  def draw_rows(greedy):
    # draw takes one key for its batch: a batch of one per row, so that each row's token
    # depends on its own key and logits alone
    warped = warp(penalized, options, top_k_limit)
    drawn = jax.vmap(lambda row, key: sampling.draw(row[None], key)[0])(warped, keys)
    return jnp.where(sampled, drawn, greedy)

  greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)
  tokens = jax.lax.cond(jnp.any(sampled), draw_rows, lambda x: x, greedy)   # all greedy: no draw
  raw = jax.nn.log_softmax(logits, axis=-1)
  logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
  top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
  return Choice(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)


def update_counts(generated_counts: jax.Array, tokens: jax.Array,
                  active: jax.Array) -> jax.Array:
  """generated_counts [S, V] with tokens [S] counted once more in the rows where active
  [S] (bool)."""
  rows = jnp.arange(tokens.shape[0])
  return jnp.asarray(generated_counts).at[rows, tokens].add(
      jnp.asarray(active).astype(generated_counts.dtype))


def _top_k_cut(logits: jax.Array, top_k: jax.Array, limit: int) -> jax.Array:
  """logits [S, V] -> -inf below each row's top_k-th largest, top_k [S] in [1, limit]."""
  top = jax.lax.top_k(logits, limit)[0]                                     # [S, K]
  kth = jnp.take_along_axis(top, jnp.clip(top_k - 1, 0, limit - 1)[:, None], axis=-1)
  return jnp.where(logits < kth, -jnp.inf, logits)


def _where_asked(asked: jax.Array, cut: Callable[[jax.Array], jax.Array],
                 logits: jax.Array) -> jax.Array:
  """cut(logits) [S, V] in the rows where asked [S], the rest as they are; not computed
  at all when no row asks (the cuts cost passes over V)."""
  return jax.lax.cond(jnp.any(asked), lambda x: jnp.where(asked[:, None], cut(x), x),
                      lambda x: x, logits)
