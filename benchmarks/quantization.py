r"""What each quantization mode costs and buys: parameter bytes, decode tokens/s, eval loss.

    python benchmarks/quantization.py --workdir=runs/tiny
    python benchmarks/quantization.py --hf_dir=path/to/gemma-3-1b-it --data='my/*.txt' \
        --cache_dtypes=bfloat16,int8

Each mode quantizes the same float checkpoint (`gemma_jax.quant`); decoding is greedy,
`--batch_size` prompts of the data's first tokens, `--new_tokens` tokens each, timed
after a compiled warm-up (median of rounds). Eval loss is `experiments/eval.py`'s on the
data (nats per token). int8 KV caches are timed as extra rows on the float weights.
"""

import functools

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
from gemma_jax import apps, quant
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.inference import sampler
from gemma_jax.training import data, evaluate

_MODEL = apps.define_model_flags()
_DATA = flags.DEFINE_string("data", None, "Globs of the eval text; default: a workdir's own "
                            "eval split.")
_MODES = flags.DEFINE_list("modes", ["none", "int8_weights", "int4_weights", "int8"],
                           "config.model.quant modes to compare.")
_CACHE_DTYPES = flags.DEFINE_list("cache_dtypes", ["int8"], "Extra KV cache dtypes timed "
                                  "on the float model.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Decoding rows.")
_PROMPT = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per row.")
_EVAL_ROWS = flags.DEFINE_integer("eval_batches", 8, "Eval batches of --batch_size rows.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/quantization_<backend>.json.")


def decode_tokens_per_second(config, params, prompts, cache_dtype) -> float:
  decoding = decoding_lib.make_decoding(config)
  run = functools.partial(
      sampler.generate, decoding, params, prompts,
      jnp.full(prompts.shape[:1], prompts.shape[1], jnp.int32), jax.random.key(0),
      jnp.zeros((0,), jnp.int32), max_new_tokens=_NEW.value,
      cache_length=prompts.shape[1] + _NEW.value, cache_dtype=cache_dtype)
  seconds = common.median_seconds(lambda: jax.block_until_ready(run()))
  return prompts.size // prompts.shape[1] * _NEW.value / seconds


def main(argv):
  del argv
  loaded = _MODEL.load()
  config, params = quant.float_config(loaded.config), loaded.params
  if _DATA.value:
    with config.data.unlocked():
      config.data.path = _DATA.value
    rows = data.load_all(config.data, loaded.tokenizer)
  else:
    rows = data.load_splits(config.data, loaded.tokenizer, config.seed)[1]
  prompts = jnp.asarray(rows.tokens[:_BATCH.value, :_PROMPT.value], jnp.int32)
  n = _BATCH.value * _EVAL_ROWS.value
  eval_rows = data.Rows(rows.tokens[:n], rows.segment_ids[:n],
                        None if rows.loss_mask is None else rows.loss_mask[:n])
  float_cache = decoding_lib.default_cache_dtype(config)
  results = []
  for mode in _MODES.value:
    if mode in quant.STORED_MODES:
      mode_config, mode_params = quant.quantize(config, params, mode)
    else:
      mode_config, mode_params = config.copy_and_resolve_references(), params
      mode_config.model.quant = mode
    caches = [float_cache] + (_CACHE_DTYPES.value if mode == "none" else [])
    for cache_dtype in caches:
      row = {"mode": mode, "cache_dtype": cache_dtype,
             "param_bytes": sum(a.nbytes for a in jax.tree.leaves(mode_params)),
             "decode_tokens_per_s": decode_tokens_per_second(mode_config, mode_params, prompts,
                                                             cache_dtype),
             "eval_loss": evaluate.evaluate(mode_config, mode_params, eval_rows,
                                            _BATCH.value)["loss"]}
      results.append(row)
      print(row, flush=True)
  base = results[0]
  common.print_table(
      f"{_MODEL.workdir.value or _MODEL.hf_dir.value} on {jax.default_backend()}: "
      f"{_BATCH.value} x ({_PROMPT.value} + {_NEW.value}) tokens greedy; eval on {_DATA.value or 'its eval split'}",
      ["mode", "KV cache", "param MiB", "x float", "decode tok/s", "x float", "eval loss",
       "change"],
      [[r["mode"], r["cache_dtype"], f"{r['param_bytes'] / 2**20:.2f}",
        f"{r['param_bytes'] / base['param_bytes']:.3f}", f"{r['decode_tokens_per_s']:.1f}",
        f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}",
        f"{r['eval_loss']:.4f}", f"{r['eval_loss'] / base['eval_loss'] - 1:+.2%}"]
       for r in results])
  common.write_json(common.output_path(_OUT.value, "quantization"),
                    {"model": _MODEL.workdir.value or _MODEL.hf_dir.value, "data": _DATA.value,
                     "batch_size": _BATCH.value, "prompt_len": _PROMPT.value,
                     "new_tokens": _NEW.value, "results": results})


if __name__ == "__main__":
  apps.run(main)
