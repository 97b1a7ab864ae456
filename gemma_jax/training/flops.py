"""Model FLOPs per trained token, and a device's peak FLOP/s measured by a matmul.

MFU = tokens/s * training_flops_per_token / (peak FLOP/s * devices). The count is of
the model's useful work (PaLM's convention): 6 FLOPs per matmul parameter per token
(forward 2, backward 4), plus attention's two T x S products per layer, with S the
keys a query may see (the full row for global layers, the window for local ones),
also tripled for the backward pass. Embedding lookups, norms and softmax are not
counted; recomputation by remat is not counted either.
"""

import time

import jax
import jax.numpy as jnp
from ml_collections import config_dict


def matmul_params(config: config_dict.ConfigDict) -> int:
  """Parameters that multiply activations: attention and MLP kernels, and the output
  projection (the tied embedding, used once as a matmul)."""
  d, n, k, h, f = (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.mlp_dim)
  per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f
  return config.num_layers * per_layer + config.vocab_size * d


def training_flops_per_token(config: config_dict.ConfigDict, seq_len: int) -> float:
  """Forward + backward FLOPs per token of a [B, seq_len] batch (model section config)."""
  pattern = config.attention_pattern
  keys = [seq_len if pattern[i % len(pattern)] == "global" else min(seq_len, config.sliding_window)
          for i in range(config.num_layers)]
  attention = sum(2 * 2 * config.num_heads * config.head_dim * s for s in keys)
  return 3.0 * (2 * matmul_params(config) + attention)


def measure_peak_flops(dtype: str = "float32", repeats: int = 5) -> float:
  """FLOP/s of the fastest of `repeats` square matmuls on the default device."""
  size = 1024 if jax.default_backend() == "cpu" else 8192
  a = jnp.ones((size, size), jnp.dtype(dtype))
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best
