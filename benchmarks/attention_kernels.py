r"""One attention layer's forward and forward+backward, per kernel, at gemma3-1b's heads.

    python benchmarks/attention_kernels.py                    # 4 x 2048, window 512 and global
    python benchmarks/attention_kernels.py --seq_len=8192
    python benchmarks/attention_kernels.py --batch_size=1 --seq_len=8192 --heads=16 \
        --kv_heads=2 --head_dim=512 --layer_types=global   # Gemma 4 26B-A4B's global layer

Queries [B, T, 4, 256] over one key/value head (gemma3-1b; `--heads`, `--kv_heads`,
`--head_dim` for others), in bfloat16 on a GPU and float32 elsewhere, under a causal
mask with the sliding window (local layers) or without (global layers), one document
per row. Variants:

- "einsum (blocks)": our kernel as the decoder runs it (`LocalBlocks` / `CausalBlocks`);
- "jax (blocks)": the "jax" kernel on those blocks, as the decoder runs it for heads
  cuDNN does not take (XLA's implementation block by block);
- "jax: mask + structure": the "jax" kernel given `CausalMask` (the [B, T, T] mask,
  causal, window), as the decoder runs it for heads cuDNN takes: cuDNN's on a GPU,
  else XLA's over every logit;
- "cudnn: structure only": `jax.nn.dot_product_attention` with the structure and no mask
  array (what a row of one document needs);
- "tokamax ...": tokamax's flash attention (Pallas Triton and Mosaic GPU), where tokamax
  is installed.

The outputs' max difference from the first variant's is printed with the times (median
of 10 calls after a warm-up, `jax.block_until_ready`). A variant that fails is reported
with its error.
"""

import functools
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
from gemma_jax.layers import attention

_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
_WINDOW = flags.DEFINE_integer("window", 512, "Sliding window of the local layer.")
_HEADS = flags.DEFINE_integer("heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 1, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 256, "Head width.")
_LAYER_TYPES = flags.DEFINE_list("layer_types", ["local", "global"],
                                 "Layers to time: local (the window) and / or global.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/attention_kernels_<backend>.json.")


def variants(seq_len: int, window):
  """{name: fn(q, k, v) -> out} for one layer type (window None: global)."""
  segments = jnp.ones((_BATCH.value, seq_len), jnp.int32)
  index = jnp.broadcast_to(jnp.arange(seq_len), segments.shape)
  dense = attention.attention_mask(index, index, segments, segments, window=window)
  out = {}
  for kernel in ("einsum", "jax"):
    if window and seq_len > 2 * window:
      blocks = attention.local_blocks(segments, window)
      fn = functools.partial(attention.local_block_attention, blocks=blocks, kernel=kernel)
    elif seq_len >= 2 * attention.causal_block_size(seq_len):
      blocks = attention.CausalBlocks(dense)
      fn = functools.partial(attention.causal_block_attention, blocks=blocks, kernel=kernel)
    else:
      fn = functools.partial(attention.dot_product_attention, mask=dense, kernel=kernel)
    out[f"{kernel} (blocks)"] = fn
  out["jax: mask + structure"] = lambda q, k, v: attention.dot_product_attention(
      q, k, v, dense, kernel="jax", causal=True, window=window)
  band = None if window is None else (window - 1, 0)
  implementation = "cudnn" if jax.default_backend() == "gpu" else None
  out["cudnn: structure only"] = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, scale=1.0, is_causal=True, local_window_size=band,
      implementation=implementation)
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    print(f"tokamax is not installed here ({e}): its variants are left out", flush=True)
    return out
  for impl in ("triton", "mosaic"):
    for name, mask in (("mask + structure", dense[:, None]), ("structure only", None)):
      out[f"tokamax {impl}: {name}"] = functools.partial(
          lambda q, k, v, impl, mask: tokamax.dot_product_attention(
              q, k, v, mask=mask, scale=1.0, is_causal=True, local_window_size=band,
              implementation=impl), impl=impl, mask=mask)
  return out


def median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(10):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  b, t = _BATCH.value, _SEQ.value
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  rng = np.random.default_rng(0)
  heads, kv_heads, head_dim = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, head_dim)) / 16, dtype)
             for n in (heads, kv_heads, kv_heads))
  results, rows = [], []
  windows = {"local": _WINDOW.value, "global": None}
  for window in (windows[kind] for kind in _LAYER_TYPES.value):
    reference = None
    for name, fn in variants(t, window).items():
      layer = "local" if window else "global"
      try:
        forward = jax.jit(fn)
        grads = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(
            fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
        out = np.asarray(forward(q, k, v), np.float32)
        reference = out if reference is None else reference
        r = {"layer": layer, "window": window, "variant": name,
             "forward_ms": median_ms(forward, q, k, v),
             "forward_backward_ms": median_ms(grads, q, k, v),
             "max_difference_vs_first": float(np.abs(out - reference).max())}
        rows.append([layer, name, r["forward_ms"], r["forward_backward_ms"],
                     r["max_difference_vs_first"]])
      except Exception as e:  # pylint: disable=broad-except
        r = {"layer": layer, "window": window, "variant": name,
             "error": f"{type(e).__name__}: {str(e)[:500]}"}
        rows.append([layer, name, "failed", type(e).__name__, ""])
      results.append(r)
      print(rows[-1], flush=True)
  common.print_table(
      f"{jax.devices()[0].device_kind}: attention over {b} x {t} tokens, {heads} heads, "
      f"{kv_heads} key/value heads, head dim {head_dim}, {jnp.dtype(dtype).name}",
      ["layer", "kernel", "forward ms", "forward+backward ms", "max diff vs first"], rows)
  common.write_json(common.output_path(_OUT.value, "attention_kernels"),
                    {"batch_size": b, "seq_len": t, "dtype": jnp.dtype(dtype).name,
                     "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
