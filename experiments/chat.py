r"""Chats with a model in Gemma's turn format: a training workdir's latest checkpoint (a
LoRA run's adapters merged) or a transformers save_pretrained directory.

    python experiments/chat.py --workdir=runs/lora
    python experiments/chat.py --hf_dir=path/to/gemma-3-1b-it --system="Answer briefly."
    printf 'What is 12 plus 30?\n/quit\n' | python experiments/chat.py --workdir=runs/lora \
        --temperature=0

Each line read is a user turn, encoded as text (a typed "<end_of_turn>" is characters,
not the marker); the reply streams as it is generated and stops at the model's end of
turn. The conversation keeps one KV cache, so a turn computes only its own tokens.
`/reset` starts a new conversation; `/quit` or end of input ends.
"""

import sys

from absl import flags

import gemma_jax as gj
from gemma_jax import apps
from gemma_jax.inference import chat_session
from gemma_jax.inference import sampler
from gemma_jax.inference import sampling

_MODEL = apps.define_model_flags()
_SYSTEM = flags.DEFINE_string("system", None, "A system prompt for every conversation.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "Tokens per reply at most.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", None, "Positions a conversation may take "
                                   "(its KV cache); default: the model's position table, "
                                   "else 4096.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Softmax temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 64, "Sample among the k likeliest tokens; 0: all.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Then among the likeliest of this probability "
                            "mass; 1: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed of the first reply (the n-th reply "
                             "uses seed + n).")
_CACHE_DTYPE = apps.define_cache_dtype_flag()


def _lines(interactive: bool):
  """The user's lines, up to /quit or end of input; piped ones are echoed after '> '."""
  while True:
    try:
      line = input("> " if interactive else "")
    except EOFError:
      return
    if not interactive:
      print(f"> {line}")
    if line.strip() == "/quit":
      return
    yield line


def main(argv):
  del argv
  try:
    config, params, tokenizer = _MODEL.load()
    session = chat_session.ChatSession(config, params, tokenizer, max_length=_MAX_LENGTH.value,
                                       system=_SYSTEM.value, cache_dtype=_CACHE_DTYPE.value)
    sampling.check_options(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value,
                           config.model.vocab_size)
    sampler.check_max_new_tokens(_MAX_NEW_TOKENS.value)
    if _MAX_NEW_TOKENS.value >= session.max_length:
      raise ValueError(f"--max_new_tokens={_MAX_NEW_TOKENS.value} leaves no room for a "
                       f"message in --max_length={session.max_length} positions")
  except (gj.ConfigError, ValueError, OSError) as error:   # WorkdirError, CheckpointError too
    sys.exit(f"chat.py: error: {error}")
  replies = 0
  for line in _lines(sys.stdin.isatty()):
    if line.strip() == "/reset":
      session.reset()
      print("(a new conversation)")
      continue
    if not line.strip():
      continue
    try:
      for piece in session.send(line, max_new_tokens=_MAX_NEW_TOKENS.value,
                                temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                                top_p=_TOP_P.value, seed=_SEED.value + replies):
        print(piece, end="", flush=True)
    except ValueError as error:   # a conversation past max_length
      print(f"chat.py: {error}", file=sys.stderr)
      continue
    print()
    if session.reply_cut:
      print(f"chat.py: the reply was cut at --max_new_tokens={_MAX_NEW_TOKENS.value}",
            file=sys.stderr)
    replies += 1


if __name__ == "__main__":
  apps.run(main)
