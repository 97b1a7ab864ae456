"""The tied-embedding logits and their cross-entropy, a chunk of positions at a time.

Dims: B batch, T positions, C positions per chunk, D model width, V vocabulary.

A [B, T, V] float32 logits array is the largest activation of a Gemma training step:
4 x 2048 tokens of a 262,144-entry vocabulary are 8.6 GB, and the softmax's backward
pass copies it. `token_losses` computes the same weighted sums from the final hidden
states [B, T, D] and the table [V, D] without it: logits [B, C, V] a chunk at a time.
Differentiated, the forward pass also takes each chunk's cross-entropy gradient while
its logits are at hand (the loss is a sum, so its cotangent only scales them): the
matmuls are the three of the plain logits' forward and backward, and what waits for the
backward pass is d hidden [B, T, D] and d table [V, D] float32 (the table gradient's own
size) instead of the logits. A z-loss with a nonzero cotangent forms the logits once
more in the backward pass. Chunks are as small as `MIN_LOGITS_BYTES` allows unless the
table's gradient is summed (`chunk_length`): evaluation and a frozen table (LoRA) pay
no memory for a floor that only the sum's traffic needs. Off a CPU a training chunk's
log-normalisers take one read of its logits (`one_pass_logsumexp`), not two.
"""

import functools
from typing import Optional

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
import numpy as np

from gemma_jax.layers.attention import softcap
from gemma_jax.layers.loss import TokenLosses
from gemma_jax.layers.matmul import transposed

MIN_LOGITS_BYTES = 1 << 28     # float32 logits per chunk: at least 256 MiB
MIN_ROWS = 2048                # and at least this many positions (over the batch)
LOGITS_BYTES = None            # a fixed budget instead of `logits_budget`'s
ONE_PASS_LOG_Z = True          # off a CPU, the training chunks' log-normalisers in one pass


def logits_budget(vocab_size: int) -> int:
  """Float32 logits bytes per chunk: `MIN_ROWS` rows of logits (2 GiB at Gemma's
  262,144 entries), or `MIN_LOGITS_BYTES` if more. Every chunk reads and writes the
  float32 [V, D] running sum of the table gradient: a chunk of R rows moves 8 D V bytes
  for it beside its 6 R D V FLOPs of matmuls, so on an H100 (~240 FLOP per byte) a
  chunk of ~300 rows spends as long on the sum as on its matmuls, whatever D. On an H100
  chunks of 2048 rows gave the fastest step and the lowest peak memory
  (docs/performance.md)."""
  return max(MIN_LOGITS_BYTES, 4 * vocab_size * MIN_ROWS)


def chunk_length(batch: int, length: int, vocab_size: int,
                 logits_bytes: Optional[int] = None, table_gradient: bool = True) -> int:
  """Positions per chunk C: as few chunks as keep [B, C, V] float32 logits within
  `logits_bytes` (default `LOGITS_BYTES`, else `logits_budget(V)` where the table's
  gradient is summed, `MIN_LOGITS_BYTES` where it is not: evaluation, or a frozen
  table as under LoRA, where larger chunks only cost memory), their length then evened
  out so that the last chunk's padding stays below one position per chunk; at least 1,
  at most T."""
  logits_bytes = logits_bytes or LOGITS_BYTES or (
      logits_budget(vocab_size) if table_gradient else MIN_LOGITS_BYTES)
  longest = int(np.clip(logits_bytes // (4 * batch * vocab_size), 1, max(length, 1)))
  return -(-length // max(1, -(-length // longest)))


def token_losses(hidden: jax.Array, table: jax.Array, targets: jax.Array,
                 weights: jax.Array, *, logit_softcap: Optional[float] = None,
                 logits_bytes: Optional[int] = None) -> TokenLosses:
  """`gemma_jax.layers.loss.token_losses` of the logits softcap(hidden . table^T) in
  float32, without forming them whole.

  Args:
    hidden: [B, T, D] final hidden states (after the final norm), compute dtype.
    table: [V, D] the tied embedding table, in the compute dtype.
    targets: [B, T] int target ids; weights: [B, T] per-position weights.
    logit_softcap: the final logits' tanh cap, or None.
    logits_bytes: the float32 logits one chunk may hold (`chunk_length`). When all T
      positions fit in one chunk without the table gradient's floor, the logits are
      formed whole and differentiated as usual (no recomputation).
  """
  b, t, _ = hidden.shape
  weights = weights.astype(jnp.float32)
  if chunk_length(b, t, table.shape[0], logits_bytes, table_gradient=False) == t:
    return _sums(*_chunk_terms(hidden, table, targets, logit_softcap), weights)
  return _chunked_losses(hidden, table, targets, weights, logit_softcap, logits_bytes)


def _chunked(x: jax.Array, c: int) -> jax.Array:
  """[B, T, ...] -> [N, B, C, ...], T padded to N chunks of C."""
  b, t = x.shape[:2]
  pad = -t % c
  return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
      b, (t + pad) // c, c, *x.shape[2:]).swapaxes(0, 1)


def _unchunked(x: jax.Array, t: int) -> jax.Array:
  """[N, B, C, ...] -> [B, T, ...], the padding dropped."""
  x = x.swapaxes(0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


def _chunk_terms(hidden, table, targets, logit_softcap):
  """hidden [..., D], targets [...] -> (log-normalisers, target logits) [...] float32."""
  logits = softcap(_logits(hidden, table).astype(jnp.float32), logit_softcap)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  return log_z, jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _logits(hidden, table):
  """hidden [..., D] x table [V, D] -> [..., V] as one [rows, D] x [D, V] matmul (see
  `embed.Embed.attend`)."""
  rows = hidden.reshape(-1, hidden.shape[-1])
  return jnp.matmul(rows, table.T).reshape(*hidden.shape[:-1], table.shape[0])


def _sums(log_z, target_logits, weights) -> TokenLosses:
  return TokenLosses(cross_entropy=jnp.sum(weights * (log_z - target_logits)),
                     z_loss=jnp.sum(weights * jnp.square(log_z)), weight=jnp.sum(weights))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked_losses(hidden, table, targets, weights, logit_softcap, logits_bytes
                    ) -> TokenLosses:
  """hidden [B, T, D], targets, weights [B, T] -> the sums over all, a chunk of
  positions at a time."""
  b, t, _ = hidden.shape
  c = chunk_length(b, t, table.shape[0], logits_bytes, table_gradient=False)

  def chunk(_, inputs):
    h, y = inputs
    return None, _chunk_terms(h, table, y, logit_softcap)

  _, (log_z, target_logits) = jax.lax.scan(chunk, None, (_chunked(hidden, c),
                                                         _chunked(targets, c)))
  return _sums(log_z, target_logits, _chunked(weights, c))


def one_pass_logsumexp(x: jax.Array) -> jax.Array:
  """log sum exp over the last axis, [..., V] -> [...], reading x once: one variadic
  reduction of (running max, sum of exp(x - running max)) pairs, where
  `jax.nn.logsumexp` reduces twice (the max, then the sum). Off a CPU, where each pass
  over a chunk's [B, C, V] logits is a read of them from memory; XLA's CPU backend runs
  such a reduction unvectorised (7x slower). Finite x only."""
  def combine(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    scale = jnp.exp(-jnp.abs(m_a - m_b))     # of the pair's smaller max, once
    return jnp.maximum(m_a, m_b), jnp.where(m_a >= m_b, s_a + s_b * scale, s_a * scale + s_b)

  lowest = jnp.array(jnp.finfo(x.dtype).min, x.dtype)
  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (lowest, jnp.zeros((), x.dtype)), combine,
                        (x.ndim - 1,))
  return m + jnp.log(s)


def _chunk_gradients(d_table, h, table, d_logits_of, logit_softcap, on_cpu):
  """One chunk's logits [B, C, V], d logits = d_logits_of(logits, log_z) through the
  cap into (d_table + d table, d hidden [B, C, D], log_z, logits), the table gradient
  summed in float32 as [V, D], d logits^T h, or on a CPU as its transpose [D, V],
  h^T d logits with h `transposed` (see `matmul`: XLA's CPU backend runs a product
  contracting both operands over their first dim at a fraction of the speed); log_z by
  `one_pass_logsumexp` off a CPU."""
  logits = softcap(_logits(h, table).astype(jnp.float32), logit_softcap)
  log_z = (one_pass_logsumexp(logits) if ONE_PASS_LOG_Z and not on_cpu
           else jax.nn.logsumexp(logits, axis=-1))
  d_logits = d_logits_of(logits, log_z)
  if logit_softcap is not None:
    d_logits = d_logits * (1 - jnp.square(logits / logit_softcap))
  d_rows = d_logits.astype(h.dtype).reshape(-1, table.shape[0])         # [B * C, V]
  h_rows = h.reshape(-1, h.shape[-1])                                     # [B * C, D]
  d_hidden = jnp.matmul(d_rows, table).reshape(h.shape)
  if on_cpu:
    d_table = d_table + jnp.matmul(transposed(h_rows), d_rows,
                                   preferred_element_type=jnp.float32)
  else:
    d_table = d_table + jax.lax.dot_general(d_rows, h_rows, (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
  return d_table, d_hidden, log_z, logits


def _scan_with_table_gradient(chunk, table, chunks):
  """jax.lax.scan of chunk(d_table, inputs, on_cpu) -> (d_table, outputs) over
  `chunks` from a zero table gradient -> (d table [V, D] float32, stacked outputs).

  On a CPU the sum runs transposed, [D, V], and is transposed once at the end; elsewhere
  it is summed as [V, D] (on an H100 the final transpose would cost under 1% of a
  step)."""
  return jax.lax.platform_dependent(
      cpu=lambda: _scan_chunks(chunk, table, chunks, on_cpu=True),
      default=lambda: _scan_chunks(chunk, table, chunks, on_cpu=False))


def _scan_chunks(chunk, table, chunks, on_cpu: bool):
  """`_scan_with_table_gradient` on a CPU or not (the sum's layout)."""
  zeros = jnp.zeros(table.shape[::-1] if on_cpu else table.shape, jnp.float32)
  d_table, outputs = jax.lax.scan(functools.partial(chunk, on_cpu=on_cpu), zeros, chunks)
  return (d_table.T if on_cpu else d_table), outputs


def _chunked_forward(hidden, table, targets, weights, logit_softcap, logits_bytes):
  """The sums, and already the cross-entropy's gradients: d logits = w (p - onehot),
  so that the backward pass only scales them (no logits formed twice). The inputs come
  with whether each is differentiated (`symbolic_zeros`): the chunks take the table
  gradient's floor only where the table has a gradient."""
  summed = table.perturbed
  hidden, table, targets, weights = (a.value for a in (hidden, table, targets, weights))
  b, t, _ = hidden.shape
  c = chunk_length(b, t, table.shape[0], logits_bytes, table_gradient=summed)

  def chunk(d_table, inputs, on_cpu):
    h, y, w = inputs
    cross_entropy = lambda logits, log_z: w[..., None] * (
        jnp.exp(logits - log_z[..., None]) - jax.nn.one_hot(y, table.shape[0]))
    d_table, d_hidden, log_z, logits = _chunk_gradients(
        d_table, h, table, cross_entropy, logit_softcap, on_cpu)
    return d_table, (log_z, jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0],
                     d_hidden)

  hidden, weights = _chunked(hidden, c), _chunked(weights, c)
  d_table, (log_z, target_logits, d_hidden) = _scan_with_table_gradient(
      chunk, table, (hidden, _chunked(targets, c), weights))
  residuals = (hidden, table, targets, weights, log_z, target_logits, d_hidden, d_table)
  return _sums(log_z, target_logits, weights), residuals


def _z_loss_gradients(hidden, table, weights, logit_softcap):
  """(d hidden, d table) of the z-loss sum: d logits = 2 w log_z p, the logits formed
  again chunk by chunk."""
  def chunk(d_table, inputs, on_cpu):
    h, w = inputs
    z_loss = lambda logits, log_z: (2 * w * log_z)[..., None] * jnp.exp(
        logits - log_z[..., None])
    d_table, d_hidden, _, _ = _chunk_gradients(d_table, h, table, z_loss, logit_softcap,
                                               on_cpu)
    return d_table, d_hidden

  d_table, d_hidden = _scan_with_table_gradient(chunk, table, (hidden, weights))
  return d_hidden, d_table


def _chunked_backward(logit_softcap, logits_bytes, residuals, cotangents: TokenLosses):
  """The forward pass's cross-entropy gradients scaled by its cotangent; the z-loss's
  computed only when its cotangent is not zero (not at all when it is symbolically
  zero: the z-loss unused); d weights: each position's terms."""
  del logits_bytes   # the chunks are the residuals'
  hidden, table, targets, weights, log_z, target_logits, d_hidden, d_table = residuals
  g_ce, g_z, g_w = (0.0 if isinstance(g, SymbolicZero) else g for g in cotangents)
  cross_entropy = lambda: (g_ce * d_hidden.astype(jnp.float32), g_ce * d_table)

  def with_z_loss():
    z_hidden, z_table = _z_loss_gradients(hidden, table, weights, logit_softcap)
    ce_hidden, ce_table = cross_entropy()
    return ce_hidden + g_z * z_hidden.astype(jnp.float32), ce_table + g_z * z_table

  if isinstance(cotangents.z_loss, SymbolicZero):
    d_hidden, d_table = cross_entropy()
  else:
    d_hidden, d_table = jax.lax.cond(g_z != 0, with_z_loss, cross_entropy)
  d_weights = g_ce * (log_z - target_logits) + g_z * jnp.square(log_z) + g_w
  t = targets.shape[1]
  return (_unchunked(d_hidden, t).astype(hidden.dtype), d_table.astype(table.dtype),
          np.zeros(targets.shape, jax.dtypes.float0), _unchunked(d_weights, t))


_chunked_losses.defvjp(_chunked_forward, _chunked_backward, symbolic_zeros=True)
