"""Next-token cross-entropy, masked by per-token weights, with an optional z-loss.

Losses are returned as sums over tokens, so that micro-batches add up exactly and
the caller divides once by the batch's total weight.
"""

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp


class TokenLosses(NamedTuple):
  """Weighted sums over the tokens of a batch (float32 scalars)."""
  cross_entropy: jax.Array   # sum of w * -log p(target)
  z_loss: jax.Array          # sum of w * log(Z)^2, Z the softmax normaliser
  weight: jax.Array          # sum of w: how many tokens count


def next_token_targets(tokens: jax.Array, segment_ids: Optional[jax.Array] = None
                       ) -> jax.Array:
  """tokens [B, T] -> targets [B, T]: each position's next token, and -1 (not counted)
  at the last position and, with segment_ids [B, T] (0: padding), where the next token
  starts another document or is padding.

  Targets of the rows' own length keep T as the rows have it: a row of 2048 tokens
  stays 2048 long (one position unscored) where `tokens[:, :-1]` would make it 2047,
  a length that matmul and attention kernels pad to their tile sizes at every layer."""
  tokens = tokens.astype(jnp.int32)        # -1 must stay negative (unsigned ids)
  following = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], -1)], axis=1)
  if segment_ids is None:
    return following
  next_ids = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], 1)
  return jnp.where((next_ids == segment_ids) & (next_ids > 0), following, -1)


def token_losses(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> TokenLosses:
  """logits [B, T, V], targets [B, T] int, weights [B, T] -> weighted sums, in float32."""
  chex.assert_rank(logits, 3)
  chex.assert_shape([targets, weights], logits.shape[:2])
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return TokenLosses(cross_entropy=jnp.sum(weights * (log_z - target_logits)),
                     z_loss=jnp.sum(weights * jnp.square(log_z)),
                     weight=jnp.sum(weights))
