"""A multi-turn conversation over one KV cache: each turn computes only its own tokens.

    session = ChatSession(config, params, tokenizer, system="Be brief.")
    for text in session.send("What is 2 plus 3?"):     # streamed as it is generated
      print(text, end="", flush=True)

The conversation is Gemma's chat format (`gemma_jax.chat`): the first turn is prefilled
from its BOS, each later one (the model's end-of-turn, "\\n", the user's turn and the
model's opening) is appended to the cache with `Decoding.extend`, and the reply is
sampled one cached step at a time until a stop id or `max_new_tokens`.
"""

import functools
from typing import Iterator, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax.inference import decode_jit
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.inference import sampler
from gemma_jax.inference import sampling
from gemma_jax.layers import kv_cache
from gemma_jax.text import chat
from gemma_jax.text import text_stream

_choose = jax.jit(sampling.choose)   # one program per kind of options, whatever their values


@functools.partial(decode_jit.jit, static_argnames="decoding", donate_argnames="cache")
def _feed_and_choose(decoding: decoding_lib.Decoding, params, token: jax.Array,
                     cache: decoding_lib.Cache, rng: jax.Array, options: sampling.Sampling):
  """Feeds the token [1] just sampled and chooses the next: (next token [1], logits
  [1, V], cache, rng), one call a token: as separate calls (the decode step, the key
  split, the logits sliced, the choice) a reply spent a third of each token dispatching
  them (docs/performance.md)."""
  logits, cache = decoding.decode_step(params, token, cache)
  rng, key = jax.random.split(rng)
  return sampling.choose(logits, key, options), logits, cache, rng


class ChatSession:
  """One conversation with a model (batch 1), its cache kept across turns.

  Args:
    config, params, tokenizer: the model (merged parameters; a scanned tree is held
      unrolled, a copy) and a tokenizer with turn markers.
    max_length: positions the cache holds; a turn that would need more is refused (start
      again with `reset`). Default: the learned position table, else 4096.
    system: a system prompt, folded into the first user turn as the template does.
    cache_dtype: of the cached keys and values, one of `kv_cache.CACHE_DTYPES` (int8: with
      per-token, per-head scales); default `decoding.default_cache_dtype`.
  """

  def __init__(self, config: config_dict.ConfigDict, params, tokenizer, *,
               max_length: Optional[int] = None, system: Optional[str] = None,
               cache_dtype: Optional[str] = None):
    chat.generation_prompt_ids(tokenizer)   # a tokenizer without turn markers fails here
    self.config, self.tokenizer, self.system = config, tokenizer, system
    table = config.model.trainable_position_size
    if max_length is None:
      max_length = table or 4096
    if not (isinstance(max_length, int) and 1 <= max_length <= (table or max_length)):
      raise ValueError(f"max_length must be an integer >= 1"
                       + (f" within the learned position table "
                          f"(config.model.trainable_position_size={table})" if table else "")
                       + f", got {max_length!r}")
    self.max_length = max_length
    self.cache_dtype = kv_cache.check_dtype(cache_dtype or
                                            decoding_lib.default_cache_dtype(config))
    self.decoding = decoding_lib.make_decoding(config)
    self.params = self.decoding.unrolled(params)   # once: every token is its own call
    self.reset()

  def reset(self) -> None:
    """Forgets the conversation."""
    self.ids: List[int] = []        # every token of the conversation, in the cache or not
    self.fed_chunks: List[int] = []  # tokens computed by each prefill or extend, in order
    self._cache = None
    self._unfed: Optional[int] = None   # the last sampled token, not yet in the cache
    self._pending = None   # [1] a sampled token the cache holds, its read interrupted
    self._logits = None              # [1, V] after the last token computed
    self.reply_cut = False           # the last reply ended at max_new_tokens, not a stop id

  def _turn_ids(self, text: str) -> np.ndarray:
    """The ids that follow the conversation so far for a user turn `text`, through the
    model's opening."""
    t = self.tokenizer
    if not self.ids:
      messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
          {"role": "user", "content": text}]
      return chat.render(messages, t, add_generation_prompt=True).ids
    closing = [] if self.ids[-1] == t.end_of_turn_id else [t.end_of_turn_id]
    return np.concatenate([closing, t.encode(["\n"])[0], chat.turn_ids(t, "user", text),
                           chat.generation_prompt_ids(t)]).astype(np.int32)

  def _feed(self, ids: np.ndarray) -> None:
    """Computes `ids` [C] after the cache (prefill for the first turn), right-padded to a
    `sampler.bucket` width: a conversation compiles the prefill and `extend` once per
    bucket (16, 32, ..., 512 tokens; 1 for a sampled token), not once per length. Later
    turns go in pieces of at most `decoding.EXTEND_CHUNK` tokens."""
    if self._cache is None:
      tokens, lengths = self._padded(ids, min(sampler.bucket(len(ids)), self.max_length))
      logits, self._cache = self.decoding.prefill(
          self.params, tokens, lengths, cache_length=self.max_length,
          cache_dtype=self.cache_dtype)
    else:
      for start in range(0, len(ids), decoding_lib.EXTEND_CHUNK):
        piece = ids[start:start + decoding_lib.EXTEND_CHUNK]
        tokens, lengths = self._padded(piece, 1 if len(piece) == 1 else sampler.bucket(len(piece)))
        logits, self._cache = self.decoding.extend(self.params, tokens, self._cache, lengths)
    self.fed_chunks.append(len(ids))
    self._logits = logits

  @property
  def logits(self) -> Optional[jax.Array]:
    """[V] float32 after the last token computed (None before the first turn)."""
    return None if self._logits is None else self._logits[0]

  def _padded(self, ids: np.ndarray, width: int):
    """(`ids` right-padded to [1, width], lengths [1])."""
    tokens = np.full((1, width), self.tokenizer.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    return jnp.asarray(tokens), jnp.asarray([len(ids)], jnp.int32)

  def send(self, text: str, *, max_new_tokens: int = 256, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Iterator[str]:
    """The model's reply to the user's `text`, yielded as text pieces while it is
    generated (a piece is held back while it ends inside a multi-byte character).
    `text` is encoded as text: a marker typed in it ("<end_of_turn>") is not one.

    The turn is checked and computed here, at the call; the reply is sampled as it is
    read. A reply read in part (the loop left early) ends the turn where it was left: the
    next turn follows the last token sampled.

    Raises:
      ValueError: a sampling option out of range, `max_new_tokens` < 1, or a turn that
        would take the conversation past `max_length` positions.
    """
    options = sampling.Sampling.of(temperature, top_k, top_p, self.config.model.vocab_size)
    sampler.check_max_new_tokens(max_new_tokens)
    if self._pending is not None:   # the last reply stopped (KeyboardInterrupt) reading it
      self.ids.append(int(np.asarray(self._pending)[0]))
      self._pending = None
    turn = self._turn_ids(text)
    needed = len(self.ids) + len(turn) + max_new_tokens
    if needed > self.max_length:
      fixes = ["lower max_new_tokens", "raise max_length"]
      if self.ids:
        fixes.insert(0, "reset the conversation")
      raise ValueError(f"this turn needs {needed} positions (conversation {len(self.ids)} + "
                       f"this message {len(turn)} + max_new_tokens {max_new_tokens}), more "
                       f"than max_length={self.max_length}: {', '.join(fixes[:-1])} or "
                       f"{fixes[-1]}")
    self._feed(np.asarray(([] if self._unfed is None else [self._unfed]) + turn.tolist(),
                          np.int32))
    self.ids += turn.tolist()
    self._unfed = None
    return self._reply(max_new_tokens, jax.random.key(seed), options)

  def _reply(self, max_new_tokens: int, rng: jax.Array,
             options: sampling.Sampling) -> Iterator[str]:
    """Samples the reply token by token. Each token sampled is in `ids` and, until the
    cache holds it, in `_unfed`, so wherever the reader stops, `ids` and the cache agree.

    The step that feeds a token (and chooses the next) is dispatched before the token is
    read back: its dispatch overlaps the step before it, and the token's text is decoded
    while it runs, where the device used to sit idle through both. So a reply's last
    token is already fed where the reply ends at a stop id or the reader leaves early,
    except the `max_new_tokens`-th, whose step is never dispatched. A token fed but not
    yet read is `_pending`, and goes into `ids` at the next turn should its read be
    interrupted (KeyboardInterrupt in a notebook)."""
    stream = text_stream.TextStream(self.tokenizer)
    self.reply_cut = False
    rng, key = jax.random.split(rng)
    chosen = _choose(self._logits, key, options)       # [1], fed back as it is
    while True:
      last = len(stream.ids) + 1 == max_new_tokens
      if not last:
        following, self._logits, self._cache, rng = _feed_and_choose(
            self.decoding, self.params, chosen, self._cache, rng, options)
        self.fed_chunks.append(1)
        self._pending = chosen
      token = int(np.asarray(chosen)[0])
      self.ids.append(token)
      self._pending = None
      self._unfed = token if last else None
      if token in self.tokenizer.stop_ids:
        break
      piece = stream.add(token)
      if piece:
        yield piece
      if last:
        self.reply_cut = True
        break
      chosen = following
    piece = stream.flush()
    if piece:
      yield piece
