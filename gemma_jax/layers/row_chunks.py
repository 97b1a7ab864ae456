"""A position-wise module (an MLP) over long rows in chunks of positions, on a CPU.

XLA's CPU backend runs a whole MLP as one fusion; over thousands of rows its [rows, F]
intermediates leave the caches between the gate, up and down products. Run over chunks
of ~1024 rows in a loop, each chunk's intermediates stay in cache: a long row's forward
runs a few percent faster; at 2048 rows the loop gained nothing, so rows below
`MIN_ROWS` run whole (docs/performance.md). Other backends run whole: a GPU wants the
wide product.
"""

import flax.linen as nn
import jax

ROWS_PER_CHUNK = 1024
MIN_ROWS = 4096


def chunk_count(batch: int, length: int) -> int:
  """How many chunks of the length axis [B, T] positions run in: about B x T /
  `ROWS_PER_CHUNK`, a divisor of T; 1 (whole) off a CPU or below `MIN_ROWS` positions."""
  if jax.default_backend() != "cpu" or batch * length < MIN_ROWS:
    return 1
  n = batch * length // ROWS_PER_CHUNK
  while length % n:
    n -= 1
  return n


def apply_in_row_chunks(module: nn.Module, x: jax.Array) -> jax.Array:
  """module(x) for x [B, T, D] -> [B, T, D'], where `module` (created in its parent's
  compact method, not yet called) treats every position on its own: in
  `chunk_count(B, T)` chunks of T under `nn.scan`, its parameters (and any an
  interceptor adds, e.g. LoRA's) shared by every chunk and its paths unchanged; dropout
  draws a key per chunk. Whole while parameters are created or written (init,
  quantizing in place)."""
  b, t = x.shape[:2]
  n = chunk_count(b, t)
  if n == 1 or module.parent.is_mutable_collection("params"):
    return module(x)
  chunks = x.reshape(b, n, t // n, *x.shape[2:])
  _, out = nn.scan(lambda mdl, carry, chunk: (carry, mdl(chunk)),
                   variable_broadcast="params", split_rngs={"params": False, "dropout": True},
                   in_axes=1, out_axes=1, length=n)(module, None, chunks)
  return out.reshape(b, t, *out.shape[3:])
