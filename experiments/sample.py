r"""Continues a prompt with a trained model: a training workdir's latest checkpoint, or a
transformers save_pretrained directory.

    python experiments/sample.py --workdir=runs/tiny --prompt="def " --max_new_tokens=100 \
        --temperature=0.8 --top_k=40
    python experiments/sample.py --hf_dir=path/to/gemma-3-1b-pt \
        --prompt="The capital of France is" --temperature=0

A workdir remembers its config and tokenizer (a LoRA run's adapters are merged into
their base); a transformers directory's tokenizer files are read from it.
Prints the prompt and its continuation, then the generation speed in tokens/s
(compilation excluded).
"""

import sys

from absl import flags

import gemma_jax as gj
from gemma_jax import apps
from gemma_jax.inference import sampler
from gemma_jax.layers import kv_cache

_MODEL = apps.define_model_flags()
_PROMPT = flags.DEFINE_string("prompt", "def ", "Text to continue, encoded as text: a "
                              "control token's name in it (<end_of_turn>, <bos>) stays "
                              "characters; for a conversation use chat.py.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Then among the likeliest of this probability "
                            "mass; 1: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_IMAGE = flags.DEFINE_multi_string("image", [], "An image file for a model with vision "
                                   "(repeatable); each fills the prompt's next image marker "
                                   "(Gemma 3: <start_of_image>, Gemma 4: <|image|>, written in "
                                   "--prompt), or goes before the prompt's text.")
_CACHE_DTYPE = flags.DEFINE_string("cache_dtype", None, "Dtype of the cached keys and values, "
                                   f"one of {', '.join(kv_cache.CACHE_DTYPES)} (int8: "
                                   "with per-token, per-head scales); default: bfloat16 on "
                                   "accelerators, else the compute dtype.")


def main(argv):
  del argv
  try:
    # Checked before loading a model: Sampler would refuse it only after.
    if _CACHE_DTYPE.value is not None and _CACHE_DTYPE.value not in kv_cache.CACHE_DTYPES:
      raise ValueError(f"--cache_dtype: {_CACHE_DTYPE.value!r} is not one of "
                       f"{', '.join(kv_cache.CACHE_DTYPES)}")
    config, params, tokenizer = _MODEL.load()
    samples = sampler.Sampler(config, params, tokenizer, cache_dtype=_CACHE_DTYPE.value).sample(
        [_PROMPT.value], max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value,
        images=[_IMAGE.value] if _IMAGE.value else None)
  except (gj.ConfigError, ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"sample.py: error: {error}")
  count = len(samples.tokens[0])
  print(_PROMPT.value + samples.texts[0])
  print(f"{count} tokens in {samples.seconds:.3f}s: {count / samples.seconds:.1f} tokens/s "
        f"(compiled in {samples.compile_seconds:.1f}s)")


if __name__ == "__main__":
  apps.run(main)
