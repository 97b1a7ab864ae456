"""Model FLOPs per trained token, and a device's peak FLOP/s: its datasheet's, or
measured by a matmul.

MFU = tokens/s * training_flops_per_token / (peak FLOP/s * devices). The count is of
the model's useful work (PaLM's convention): 6 FLOPs per matmul parameter per token
(forward 2, backward 4; 4 for a LoRA run's frozen base), plus attention's two T x S products per layer, with S the
keys a query may see (the full row for global layers, the window for local ones),
also tripled for the backward pass. Embedding lookups, norms and softmax are not
counted; recomputation by remat is not counted either.
"""

import time
from typing import Optional

import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.config import attention_shape, layer_types


def matmul_params(config: config_dict.ConfigDict) -> int:
  """Parameters that multiply each token's activations: attention and MLP kernels (of a
  mixture of experts, the router and the k experts a token is routed to), and the
  output projection (the tied embedding, used once as a matmul)."""
  d, n = config.d_model, config.num_heads
  mlp_matrices = 2 if config.block_type == "gpt3" else 3   # GPT-3's MLP is not gated
  total = config.vocab_size * d
  for kind in layer_types(config):
    k, h = attention_shape(config, kind)
    values = 0 if kind == "global" and config.global_k_eq_v else d * k * h
    total += 2 * d * n * h + d * k * h + values + mlp_matrices * d * config.mlp_dim
    if config.num_experts:
      total += d * config.num_experts + config.experts_per_token * 3 * d * config.expert_mlp_dim
  return total


def training_flops_per_token(config: config_dict.ConfigDict, seq_len: int,
                             adapter_params: int = 0) -> float:
  """Forward + backward FLOPs per token of a [B, seq_len] batch (model section config).
  With LoRA (`adapter_params`, `lora.param_count`, > 0) the base is frozen: its matmul
  parameters cost 4 (forward 2, the activations' gradient 2, no weight gradient) and
  the adapters' 6; adapters on experts are counted as if every token used them."""
  attention = 0
  for kind in layer_types(config):
    keys = seq_len if kind == "global" else min(seq_len, config.sliding_window)
    attention += 2 * 2 * config.num_heads * attention_shape(config, kind)[1] * keys
  per_base_param = 4 if adapter_params else 6
  return per_base_param * matmul_params(config) + 6.0 * adapter_params + 3.0 * attention


# Dense bfloat16 peak FLOP/s of an accelerator, by a substring of its JAX device_kind
# (datasheets; the first match wins): the denominator of the MFU a run reports. A CPU has
# none: its rate is not a fixed property of the machine the run shares.
DATASHEET_PEAK = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
                  ("A100", 312e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12),
                  ("TPU v5p", 459e12), ("TPU v6 lite", 918e12))


def datasheet_peak_flops(device_kind: Optional[str] = None) -> Optional[float]:
  """The datasheet's dense bfloat16 peak FLOP/s of a device (default: JAX's first
  device), or None for a device not in DATASHEET_PEAK (every CPU)."""
  kind = jax.devices()[0].device_kind if device_kind is None else device_kind
  return next((peak for name, peak in DATASHEET_PEAK if name in kind), None)


def square_matmul(size: int, dtype: str = "float32"):
  """(a blocking call of one jitted [size, size] x [size, size] matmul, its FLOPs)."""
  a = jnp.ones((size, size), jnp.dtype(dtype))
  matmul = jax.jit(lambda x: x @ x)
  return (lambda: matmul(a).block_until_ready()), 2.0 * size ** 3


def measure_peak_flops(dtype: str = "float32", repeats: int = 5) -> float:
  """FLOP/s of the fastest of `repeats` square matmuls on the default device, over two
  sizes: one size alone under-reads a CPU's peak by up to a quarter from run to run
  (124 vs 168 GFLOP/s at 1024 on the 2-core CI machine, 165 at 2048)."""
  best = 0.0
  for size in (1024, 2048) if jax.default_backend() == "cpu" else (4096, 8192):
    run, flop = square_matmul(size, dtype)
    run()
    for _ in range(repeats):
      start = time.perf_counter()
      run()
      best = max(best, flop / (time.perf_counter() - start))
  return best
