"""A first sampler: greedy, temperature and top-k decoding from a prompt.

The loop runs inside jit over a fixed [B, P + N] token buffer and recomputes the full
forward pass every step (no KV cache yet): simple, and O(N) forward passes.
"""

import functools
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp


def choose(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """logits [B, V] -> token ids [B]: argmax when temperature is 0, else a sample from
  softmax(logits / temperature) restricted to the top_k likeliest (0: all)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("apply", "max_new_tokens", "temperature",
                                             "top_k", "eos_id", "pad_id"))
def sample(apply: Callable, params, prompt: jax.Array, rng: jax.Array, *, max_new_tokens: int,
           temperature: float = 1.0, top_k: int = 0, eos_id: Optional[int] = None,
           pad_id: int = 0) -> jax.Array:
  """Continues each prompt row by `max_new_tokens` tokens.

  Args:
    apply: the model's apply, `apply(params, tokens [B, L]) -> logits [B, L, V]`.
    params: its parameters.
    prompt: [B, P] int token ids (P >= 1).
    rng: PRNG key (unused when greedy).
    max_new_tokens: N.
    temperature, top_k: see `choose`.
    eos_id: a row stops after emitting it; later slots hold `pad_id`. None: never stops.

  Returns:
    [B, P + N] int32: the prompt and its continuation.
  """
  chex.assert_rank(prompt, 2)
  b, p = prompt.shape
  tokens = jnp.full((b, p + max_new_tokens), pad_id, jnp.int32).at[:, :p].set(prompt)

  def unfinished(carry):
    index, _, done, _ = carry
    return (index < p + max_new_tokens) & ~jnp.all(done)

  def step(carry):
    index, tokens, done, rng = carry
    rng, key = jax.random.split(rng)
    logits = jax.lax.dynamic_index_in_dim(apply(params, tokens), index - 1, axis=1,
                                          keepdims=False)
    token = jnp.where(done, pad_id, choose(logits, key, temperature, top_k))
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], index, axis=1)
    if eos_id is not None:
      done = done | (token == eos_id)
    return index + 1, tokens, done, rng

  _, tokens, _, _ = jax.lax.while_loop(
      unfinished, step, (jnp.asarray(p), tokens, jnp.zeros((b,), bool), rng))
  return tokens
