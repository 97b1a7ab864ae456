r"""A chat reply streamed token by token against the same tokens from one program.

    python benchmarks/chat_reply.py --shapes=gemma3-small --new_tokens=64 --rounds=10

`ChatSession.send` makes one call per token and reads each token back to the host to
stream its text; `sampler.generate` runs its decode steps in one `lax.while_loop`, so
it is the floor a per-token loop can approach. Both decode greedily over the same random
weights (float32 unless `--dtype`), a byte tokenizer whose stop ids are never met (every
reply is `--new_tokens` long) and whose text is decoded at every token, as the chat app
does. Ours per token: the reply from its turn's logits to its end, over its tokens; the loop's:
(time of N new tokens - time of 1) / (N - 1), so the prefill drops out. Medians of
`--rounds` rounds alternating the two. Shapes and flags are `side_by_side.py`'s
(`--out`: default benchmarks/results/chat_reply_<backend>.json).
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
import gemma_jax as gj
import side_by_side as sbs
from gemma_jax.inference import decoding, sampler
from gemma_jax.inference.chat_session import ChatSession
from gemma_jax.text import tokenizers

FLAGS = flags.FLAGS


class EndlessBytes(tokenizers.ByteTokenizer):
  """The byte tokenizer with no stop ids, so that a reply runs to `max_new_tokens`."""
  stop_ids = ()


def run_shape(name: str) -> dict:
  config = sbs.model_config(name)
  n = FLAGS.new_tokens
  tokenizer = EndlessBytes()
  prompt = "Hello there, how are you today?"
  params = gj.transform(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  session = ChatSession(config, params, tokenizer, max_length=FLAGS.prompt_len + 64 + n)
  prompts = jnp.asarray(sbs.random_tokens(config.model.vocab_size, (1, FLAGS.prompt_len), 0))
  lengths = jnp.asarray([FLAGS.prompt_len], jnp.int32)

  def streamed() -> float:
    session.reset()
    pieces = session.send(prompt, max_new_tokens=n)
    jax.block_until_ready(session.logits)   # the turn, computed at the call
    start, t = len(session.ids), time.perf_counter()
    for _ in pieces:
      pass
    return (time.perf_counter() - t) / (len(session.ids) - start)

  def generate(count: int):
    return lambda: np.asarray(sampler.generate(
        session.decoding, session.params, prompts, lengths, jax.random.key(0),
        jnp.zeros((0,), jnp.int32), max_new_tokens=count,
        cache_length=FLAGS.prompt_len + n, cache_dtype=session.cache_dtype))

  loop_one, loop_n = generate(1), generate(n)
  streamed(), loop_one(), loop_n()   # compile and warm up
  times = {"streamed": [], "one": [], "many": []}
  for _ in range(FLAGS.rounds):
    times["streamed"].append(streamed())
    for key, fn in (("one", loop_one), ("many", loop_n)):
      t = time.perf_counter()
      fn()
      times[key].append(time.perf_counter() - t)
  median = {k: float(np.median(v)) for k, v in times.items()}
  loop = (median["many"] - median["one"]) / (n - 1)
  return {"shape": name, "new_tokens": n, "chat_session_s_per_token": median["streamed"],
          "loop_s_per_token": loop}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = [run_shape(name) for name in FLAGS.shapes]
  common.print_table(
      f"greedy reply of {FLAGS.new_tokens} tokens, batch 1, {FLAGS.dtype}: tokens/s",
      ["shape", "ChatSession (streamed)", "sampler loop", "streamed / loop"],
      [[r["shape"], 1 / r["chat_session_s_per_token"], 1 / r["loop_s_per_token"],
        r["loop_s_per_token"] / r["chat_session_s_per_token"]] for r in results])
  common.write_json(common.output_path(FLAGS.out, "chat_reply"),
                    {"dtype": FLAGS.dtype, "rounds": FLAGS.rounds, "results": results})


if __name__ == "__main__":
  app.run(main)
