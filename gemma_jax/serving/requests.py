"""What a client asks the engine for, and what it gets back, token by token.

    request = Request(prompt=[2, 651, 6037], max_tokens=64,
                      sampling=SamplingOptions(temperature=0.7, top_p=0.9), seed=0)
    request_id = engine.submit(request, on_output)   # on_output(Output) per token

Every field is checked by `Request.check` before the request is queued, so a bad value
is one `ValueError` naming the field, never a failure inside a compiled step.
"""

import dataclasses
from typing import Optional, Tuple

import numpy as np

MAX_LOGPROBS = 20   # top alternatives a request may ask for per token (OpenAI's bound)


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """How each token is picked. temperature 0: greedy (argmax after the penalties).

  top_k: keep the k likeliest (0: all). top_p: then the smallest set of the likeliest
  whose probability reaches p (1: all). min_p: drop tokens whose probability is below
  min_p times the likeliest's (0: none). repetition_penalty: logits of tokens seen in
  the prompt or output divided by it where positive, multiplied where negative (1:
  none; transformers' rule). presence_penalty, frequency_penalty: subtracted from the
  logits of tokens already generated, once / per occurrence (0: none; OpenAI's rule).
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0

  def check(self, vocab_size: Optional[int] = None) -> None:
    """Raises ValueError naming the first option out of range."""
    need = _checker()
    need(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
    need(isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0, "top_k",
         f"must be an integer >= 0, got {self.top_k!r}")
    need(vocab_size is None or self.top_k <= vocab_size, "top_k",
         f"exceeds the vocabulary of {vocab_size} tokens")
    need(0 < self.top_p <= 1, "top_p", f"must lie in (0, 1], got {self.top_p}")
    need(0 <= self.min_p <= 1, "min_p", f"must lie in [0, 1], got {self.min_p}")
    need(self.repetition_penalty > 0, "repetition_penalty",
         f"must be > 0, got {self.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(self, name)
      need(-2 <= value <= 2, name, f"must lie in [-2, 2], got {value}")


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation.

  prompt: token ids (BOS included where the model wants one). max_tokens: new tokens at
  most. stop_ids: ids that end it (the id is emitted, finish "stop"). stop_strings:
  texts that end it (the text up to the first one is emitted; needs the engine's
  detokenizer). seed: the same seed gives the same tokens whatever else runs (None: a
  fresh one). logprobs: also return the chosen token's log-probability and this many
  top alternatives (0..MAX_LOGPROBS; None: none). images: for a model with vision, the
  prompt's images (files, PIL images or arrays), each filling the prompt's next image
  marker, or placed after its BOS when it has none (`towers.prompts_with_images`).
  """
  prompt: Tuple[int, ...]
  max_tokens: int
  sampling: SamplingOptions = SamplingOptions()
  stop_ids: Tuple[int, ...] = ()
  stop_strings: Tuple[str, ...] = ()
  seed: Optional[int] = None
  logprobs: Optional[int] = None
  images: Tuple = dataclasses.field(default=(), compare=False)

  def check(self, vocab_size: int, max_length: int) -> None:
    """Raises ValueError naming the first field out of range for a model of `vocab_size`
    tokens and `max_length` positions per sequence."""
    need = _checker()
    need(len(self.prompt) >= 1, "prompt", "must hold at least one token")
    bad = [t for t in self.prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
    need(not bad, "prompt", f"token id {bad[0] if bad else None!r} is outside [0, {vocab_size})")
    need(isinstance(self.max_tokens, (int, np.integer)) and self.max_tokens >= 1,
         "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
    need(len(self.prompt) < max_length, "prompt",
         f"of {len(self.prompt)} tokens leaves no room in the context of {max_length}")
    need(len(self.prompt) + self.max_tokens <= max_length, "max_tokens",
         f"{self.max_tokens} after a prompt of {len(self.prompt)} tokens exceeds the "
         f"context of {max_length}")
    need(all(isinstance(t, (int, np.integer)) and 0 <= t < vocab_size for t in self.stop_ids),
         "stop_ids", f"must be token ids in [0, {vocab_size})")
    need(all(isinstance(s, str) and s for s in self.stop_strings), "stop_strings",
         "must be non-empty strings")
    need(self.seed is None or isinstance(self.seed, (int, np.integer)), "seed",
         f"must be an integer or None, got {self.seed!r}")
    need(self.logprobs is None or (isinstance(self.logprobs, (int, np.integer))
                                   and 0 <= self.logprobs <= MAX_LOGPROBS),
         "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
    self.sampling.check(vocab_size)


@dataclasses.dataclass(frozen=True)
class Output:
  """One step of a request's output.

  token: the new token id (None on a finish without one: cancelled, or a stop string
  inside earlier tokens). text: the text this step adds (with a detokenizer; "" else).
  logprob: the token's log-probability; top: [(id, log-probability)] alternatives,
  likeliest first (with `logprobs`). finish: None while running; "stop", "length",
  "cancelled" or "error" (the engine failed, see `Engine.failure`) on the last output.
  """
  token: Optional[int]
  text: str = ""
  logprob: Optional[float] = None
  top: Tuple[Tuple[int, float], ...] = ()
  finish: Optional[str] = None


def _checker():
  def need(ok: bool, field: str, message: str) -> None:
    if not ok:
      raise ValueError(f"{field} {message}")
  return need


class QueueFull(Exception):
  """The engine's queue is full: try again later (HTTP 429)."""
