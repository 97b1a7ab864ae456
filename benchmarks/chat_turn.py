r"""A chat turn after a cached conversation: C new tokens into the KV cache.

    python benchmarks/chat_turn.py --shapes=gemma3-small --prompt_len=32 --turn_tokens=512,2048

Shapes and flags are `side_by_side.py`'s (`--out`: default
benchmarks/results/chat_turn_<backend>.json). After a prompt of P tokens is prefilled, each
side computes a turn of C more tokens and the logits after its last one: ours with
`Decoding.extend` (the turn in passes over the cache), ours token by token (C
`decode_step`s, what `extend` did before) and, with `--torch`, transformers' forward of
the C tokens over its `DynamicCache`. Each timed call gets a freshly prefilled cache
(not timed). Times are medians of `--rounds` alternating rounds; the logits are
compared with transformers' (same weights).
"""

import copy
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
import gemma_jax as gj
import side_by_side as sbs
from gemma_jax.inference import decoding

_TURN = flags.DEFINE_list("turn_tokens", ["512", "2048"], "Tokens C of the turn.")
FLAGS = flags.FLAGS


def timed(prepare, call) -> float:
  """Seconds of call(prepare()), which must block until its work is done."""
  state = prepare()
  start = time.perf_counter()
  call(state)
  return time.perf_counter() - start


def run_shape(name: str) -> dict:
  config = sbs.model_config(name)
  p = FLAGS.prompt_len
  sizes = [int(c) for c in _TURN.value]
  tokens = sbs.random_tokens(config.model.vocab_size, (1, p + max(sizes)), seed=0)
  dec = decoding.make_decoding(config)
  params = dec.unrolled(gj.transform(config).init(jax.random.key(0), jnp.asarray(tokens[:, :8])))
  cache_length = p + max(sizes)
  prefilled = lambda: dec.prefill(params, jnp.asarray(tokens[:, :p]), cache_length=cache_length)[1]

  def by_step(cache, turn):
    for i in range(turn.shape[1]):
      logits, cache = dec.decode_step(params, turn[:, i], cache)
    return jax.block_until_ready(logits)

  theirs = None
  if FLAGS.torch:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as path:
      gj.hf.save(path, config, params)
      theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
      their_cache = theirs(torch.as_tensor(tokens[:, :p]).long(), use_cache=True).past_key_values

  rows = []
  for c in sizes:
    turn = jnp.asarray(tokens[:, p:p + c])
    calls = {"extend": (prefilled, lambda cache: jax.block_until_ready(
                 dec.extend(params, turn, cache)[0])),
             "token by token": (prefilled, lambda cache: by_step(cache, turn))}
    row = {"turn_tokens": c}
    if theirs is not None:
      ids = torch.as_tensor(np.asarray(turn)).long()

      def their_turn(cache):
        with torch.no_grad():
          return theirs(ids, past_key_values=cache, use_cache=True).logits[:, -1]
      calls["transformers"] = (lambda: copy.deepcopy(their_cache), their_turn)
      ours = np.asarray(dec.extend(params, turn, prefilled())[0])
      row["max_logit_difference"] = float(np.abs(
          ours - their_turn(copy.deepcopy(their_cache)).numpy()).max())
    for prepare, call in calls.values():   # compile and warm up
      timed(prepare, call)
    times = {k: [] for k in calls}
    for _ in range(FLAGS.rounds):
      for k, (prepare, call) in calls.items():
        times[k].append(timed(prepare, call))
    row.update({f"{k}_s": float(np.median(v)) for k, v in times.items()})
    rows.append(row)
  return {"shape": name, "prompt_len": p, "rows": rows}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = [run_shape(name) for name in FLAGS.shapes]
  table = []
  for r in results:
    for row in r["rows"]:
      theirs = row.get("transformers_s")
      table.append([r["shape"], row["turn_tokens"], row["extend_s"], row["token by token_s"],
                    row["token by token_s"] / row["extend_s"],
                    "" if theirs is None else theirs,
                    "" if theirs is None else theirs / row["extend_s"],
                    f"{row.get('max_logit_difference', float('nan')):.1e}"])
  common.print_table(
      f"a turn of C tokens after a {FLAGS.prompt_len}-token prompt, {FLAGS.dtype}, seconds",
      ["shape", "C", "extend", "token by token", "speed-up", "transformers",
       "ours / theirs (speed)", "max |logit diff|"], table)
  common.write_json(common.output_path(FLAGS.out, "chat_turn"),
                    {"dtype": FLAGS.dtype, "rounds": FLAGS.rounds, "results": results})


if __name__ == "__main__":
  app.run(main)
