r"""Continues a prompt with a trained model: a training workdir's latest checkpoint, or a
transformers save_pretrained directory.

    python experiments/sample.py --config=configs/gemma3_tiny.py --workdir=runs/tiny \
        --prompt="def " --max_new_tokens=100 --temperature=0.8 --top_k=40
    python experiments/sample.py --hf_dir=path/to/gemma-3-1b-pt \
        --tokenizer=path/to/tokenizer.model --prompt="The capital of France is" \
        --temperature=0

With --workdir, --config is the config file (and overrides) the run was trained with.
Prints the prompt and its continuation, then the generation speed in tokens/s
(compilation excluded).
"""

import os
import sys

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

import gemma_jax as gj
from gemma_jax import sharding
from gemma_jax.inference import sampler
from gemma_jax.training import checkpoints, optimizer, steps, tokenizers

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (with "
                                          "--workdir).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: its latest checkpoint.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "A transformers save_pretrained directory.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "'byte' or a SentencePiece model path; default: the config's "
    "data.tokenizer with --workdir, HF_DIR/tokenizer.model with --hf_dir.")
_PROMPT = flags.DEFINE_string("prompt", "def ", "Text to continue.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Then among the likeliest of this probability "
                            "mass; 1: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_IMAGE = flags.DEFINE_multi_string("image", [], "An image file for a model with vision "
                                   "(repeatable); each fills the prompt's next "
                                   "<start_of_image>, or goes before the prompt's text.")
_CACHE_DTYPE = flags.DEFINE_string("cache_dtype", None, "Dtype of the cached keys and values, "
                                   f"one of {', '.join(gj.config.DTYPES)}; default: bfloat16 on "
                                   "accelerators, else the compute dtype.")


def _from_workdir(config, workdir: str):
  """(config, params) of the latest checkpoint in `workdir`, laid out on config's mesh."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"--workdir: no checkpoints in {directory}")
  model = gj.transform(config)
  tx = optimizer.make_optimizer(
      config.optimizer, optimizer.learning_rate_schedule(config.optimizer, config.train.steps))
  init = lambda: steps.init_state(model, tx, config.seed, config.data.seq_len)
  mesh = sharding.make_mesh(config.mesh)
  shardings = steps.state_shardings(config, tx, jax.eval_shape(init), mesh)
  checkpointer = checkpoints.Checkpointer(directory, config.checkpoint.keep)
  if checkpointer.latest_step() is None:
    raise ValueError(f"--workdir: no checkpoints in {directory}")
  state, _ = checkpointer.restore(jax.eval_shape(jax.jit(init, out_shardings=shardings)))
  checkpointer.close()
  return config, state.params


def _load():
  """(config, params, tokenizer name) from the flags."""
  if bool(_WORKDIR.value) == bool(_HF_DIR.value):
    raise ValueError("give exactly one of --workdir and --hf_dir")
  if _WORKDIR.value:
    if _CONFIG.value is None:
      raise ValueError("--workdir needs the --config the run was trained with")
    config, params = _from_workdir(_CONFIG.value, _WORKDIR.value)
    return config, params, _TOKENIZER.value or config.data.tokenizer or "byte"
  config, params = gj.hf.load(_HF_DIR.value)
  return config, params, _TOKENIZER.value or os.path.join(_HF_DIR.value, "tokenizer.model")


def main(argv):
  del argv
  try:
    # Checked before loading a model: jnp.dtype would raise TypeError only after it.
    if _CACHE_DTYPE.value is not None and _CACHE_DTYPE.value not in gj.config.DTYPES:
      raise ValueError(f"--cache_dtype: {_CACHE_DTYPE.value!r} is not one of "
                       f"{', '.join(gj.config.DTYPES)}")
    config, params, tokenizer_name = _load()
    tokenizer = tokenizers.get_tokenizer(tokenizer_name, config.model.vocab_size)
    samples = sampler.Sampler(config, params, tokenizer, cache_dtype=_CACHE_DTYPE.value).sample(
        [_PROMPT.value], max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value, top_p=_TOP_P.value, seed=_SEED.value,
        images=[_IMAGE.value] if _IMAGE.value else None)
  except (gj.ConfigError, ValueError, OSError) as error:
    sys.exit(f"sample.py: error: {error}")
  count = len(samples.tokens[0])
  print(_PROMPT.value + samples.texts[0])
  print(f"{count} tokens in {samples.seconds:.3f}s: {count / samples.seconds:.1f} tokens/s "
        f"(compiled in {samples.compile_seconds:.1f}s)")


if __name__ == "__main__":
  app.run(main)
