"""The serving engine: requests join and leave a fixed set of decode slots at every step.

    engine = Engine(config, params, tokenizer=tokenizer, num_slots=8)
    outputs = engine.generate([Request(prompt=ids, max_tokens=32)])   # no thread
    engine.start(); engine.submit(request, on_output); ...; engine.shutdown(grace_seconds=5)

Each `step`: cancelled requests leave; queued ones are admitted while a slot and pages
are free (a prompt's cached prefix reused, `pages`); up to `prefill_rows` prefilling
requests write their next `prefill_chunk` prompt tokens; then every decoding slot
decodes one token together (`paged_model`). When pages run out, the request admitted
last is preempted: its pages freed, it waits at the queue's head with what it has
generated, and resumes by recomputing them. The decode step compiles once, the prefill
once per power of two of rows up to `prefill_rows` (one program with the default 1).

Dims: S slots, V vocab, M blocks a sequence.
"""

import collections
import contextlib
import itertools
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence as Seq

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
from ml_collections import config_dict

from gemma_jax import sharding
from gemma_jax.inference import decoding as decoding_lib
from gemma_jax.layers import kv_cache
from gemma_jax.serving import images as images_lib
from gemma_jax.serving import paged_model, sampling
from gemma_jax.serving.requests import MAX_LOGPROBS, Output, QueueFull, Request, SamplingOptions
from gemma_jax.serving.sequences import Pages, Sequence
from gemma_jax.serving.stops import StopText

_IDLE = SamplingOptions(temperature=0.0)


class Engine:
  """Continuous batching over paged KV caches for one model (see the module docstring).

  Args:
    config, params: the model (params in either layer layout).
    tokenizer: decodes output text and stop strings (None: token ids only).
    num_slots: S, requests decoded together.
    page_size: P, tokens a page.
    num_pages: pages of the global pool (default: enough for every slot's full context;
      fewer: requests share them, preempted when they run out); the local pool gets
      every slot's window and a chunk more for each prefilling request, plus
      `local_cache_pages`. Pages no request holds keep cached prefixes until needed (a
      prefix is reused only while its last window's local pages are kept).
    prefill_chunk, prefill_rows: prompt tokens a prefill call writes per request, and
      requests it writes.
    max_length: positions a sequence may take (prompt plus output).
    max_queue: requests waiting at most; more raise `QueueFull`.
    cache_dtype: the pools' dtype (`kv_cache.CACHE_DTYPES`, int8 with scales).
    top_k_limit: the largest top_k a request may ask for.
    mesh: a device mesh (`sharding.make_mesh(config.mesh)`): weights on their logical
      axes, the pools' key/value heads over the tensor axis, rows over data; None: one
      device.
  """

  def __init__(self, config: config_dict.ConfigDict, params, *, tokenizer=None,
               num_slots: int = 8, page_size: int = 16, num_pages: Optional[int] = None,
               prefill_chunk: int = 64, prefill_rows: int = 1, max_length: int = 1024,
               max_queue: int = 256, cache_dtype: Optional[str] = None,
               top_k_limit: int = 64, mesh: Optional[Mesh] = None,
               local_cache_pages: int = 0):
    model = self._model = config.model
    self._check(model, num_slots, page_size, num_pages, prefill_chunk, prefill_rows,
                max_length, max_queue, top_k_limit)
    self.tokenizer, self.max_length, self.vocab_size = tokenizer, max_length, model.vocab_size
    self.max_queue, self.top_k_limit = max_queue, min(top_k_limit, model.vocab_size)
    max_blocks = -(-max_length // page_size)
    kinds = sorted(set(decoding_lib.layer_types(model)))
    sizes = {kind: num_pages or num_slots * max_blocks for kind in kinds}
    if "local" in kinds:   # every slot's window, and a chunk more for each prefilling row
      window, chunk = (paged_model.view_blocks(model, "local", page_size, max_blocks, n)
                       for n in (1, prefill_chunk))
      sizes["local"] = num_slots * window + prefill_rows * (chunk - window) + local_cache_pages
    self.shape = paged_model.Shape(page_size, sizes, max_blocks, num_slots, prefill_rows,
                                   prefill_chunk, self.top_k_limit, MAX_LOGPROBS)
    self.programs = paged_model.PagedModel(config, self.shape)
    self.mesh = mesh
    dtype = kv_cache.check_dtype(cache_dtype or decoding_lib.default_cache_dtype(config))
    with self._on_mesh():
      if mesh is not None:
        params = jax.device_put(params, sharding.param_shardings(config, mesh))
      self.params = self.programs.decoding.unrolled(params)
      self._pools = self.programs.pools(self.params, dtype)
      if mesh is not None:
        self._pools = jax.device_put(self._pools, paged_model.pool_shardings(self._pools, mesh))
    self.pages = Pages(sizes, page_size, model.sliding_window if "local" in kinds else None)
    self._seen = jnp.zeros((num_slots, model.vocab_size), bool)
    self._counts = jnp.zeros((num_slots, model.vocab_size), jnp.int32)
    self._reset_row = jax.jit(_reset_row, donate_argnames=("seen", "counts"))
    self._slots: List[Optional[Sequence]] = [None] * num_slots
    self._queue: "collections.deque[Sequence]" = collections.deque()
    self._running: List[Sequence] = []          # in admission order
    self._cancelled: set = set()
    self._ids = itertools.count()
    self._lock = threading.Condition()
    self._thread: Optional[threading.Thread] = None
    self._admitting, self._stopping = True, False
    self.failure: Optional[str] = None    # what stopped the engine thread, if anything
    self.stats = collections.Counter()
    self._started = time.monotonic()
    self._ttft_sum = 0.0   # seconds from submission to first token, summed over requests

  def _on_mesh(self):
    """The context the programs run in: the mesh's, where there is one."""
    return sharding.activate(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  @staticmethod
  def _check(model, num_slots, page_size, num_pages, prefill_chunk, prefill_rows, max_length,
             max_queue, top_k_limit) -> None:
    for name, value in (("num_slots", num_slots), ("page_size", page_size),
                        ("prefill_chunk", prefill_chunk), ("prefill_rows", prefill_rows),
                        ("max_length", max_length), ("max_queue", max_queue),
                        ("top_k_limit", top_k_limit)):
      if not (isinstance(value, (int, np.integer)) and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if num_pages is not None and num_pages * page_size < max_length:
      raise ValueError(f"num_pages={num_pages} of page_size={page_size} hold fewer than "
                       f"max_length={max_length} positions: one sequence would not fit")
    if model.trainable_position_size and max_length > model.trainable_position_size:
      raise ValueError(f"max_length={max_length} exceeds the model's trainable_position_size="
                       f"{model.trainable_position_size}")

  # ------------------------------------------------------------------ the client's side

  def submit(self, request: Request, on_output: Callable[[Output], None]) -> int:
    """Queues `request`; `on_output` gets each `Output` (from the engine's thread once
    started). Raises ValueError naming a bad field, or QueueFull."""
    request.check(self.vocab_size, self.max_length)
    if request.sampling.top_k > self.top_k_limit:
      raise ValueError(f"top_k {request.sampling.top_k} exceeds the engine's top_k_limit="
                       f"{self.top_k_limit}")
    if request.stop_strings and self.tokenizer is None:
      raise ValueError("stop_strings need the engine's tokenizer")
    seed = request.seed if request.seed is not None else int(np.random.randint(2 ** 31))
    tokens, model_images, salt = list(request.prompt), None, b""
    if request.images:
      tokens, model_images, salt = images_lib.prepare(tokens, request.images, self._model,
                                                      self.tokenizer, self.shape.prefill_chunk)
      if len(tokens) + request.max_tokens > self.max_length:
        raise ValueError(f"max_tokens {request.max_tokens} after a prompt of {len(tokens)} "
                         f"tokens with its images' spans exceeds the context of "
                         f"{self.max_length}")
    else:
      images_lib.check_text(tokens, self._model)
    with self._lock:
      if self.failure:
        raise RuntimeError(f"the serving engine stopped: {self.failure}")
      if not self._admitting or len(self._queue) >= self.max_queue:
        raise QueueFull(f"{len(self._queue)} requests wait (max_queue={self.max_queue})"
                        if self._admitting else "the engine is shutting down")
      seq = Sequence(next(self._ids), request, on_output, seed, tokens,
                     StopText(self.tokenizer, request.stop_strings) if self.tokenizer else None,
                     images=model_images, salt=salt)
      self._queue.append(seq)
      self.stats["prompt_tokens"] += len(request.prompt)
      self._lock.notify_all()
    return seq.id

  def cancel(self, request_id: int) -> None:
    """Ends the request: its slot and pages are freed at the next step."""
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify_all()

  def generate(self, requests: Seq[Request]) -> List[List[Output]]:
    """Runs `requests` to their ends on the calling thread (not with `start`): each
    one's outputs."""
    outputs: List[List[Output]] = [[] for _ in requests]
    for i, request in enumerate(requests):
      self.submit(request, outputs[i].append)
    while self.busy:
      self.step()
    return outputs

  @property
  def busy(self) -> bool:
    """Whether requests wait or run."""
    with self._lock:
      return bool(self._queue or self._running or self._cancelled)

  def metrics(self) -> Dict[str, float]:
    """Counts and rates for monitoring."""
    with self._lock:
      in_use = sum(pool.in_use for pool in self.pages.pools.values())
      cached = sum(pool.cached_only for pool in self.pages.pools.values())
      total = sum(pool.num_pages for pool in self.pages.pools.values())
      elapsed = max(time.monotonic() - self._started, 1e-9)
      return {"queued": len(self._queue), "running": len(self._running),
              "pages_in_use": in_use, "pages_cached": cached, "pages_total": total,
              "tokens_per_second": self.stats["generated_tokens"] / elapsed,
              "time_to_first_token_seconds": self._ttft_sum / max(self.stats["first_tokens"], 1),
              "requests_finished": self.stats["requests_finished"],
              "prompt_tokens": self.stats["prompt_tokens"],
              "generated_tokens": self.stats["generated_tokens"],
              "preemptions": self.stats["preemptions"],
              "prefix_tokens_reused": self.stats["prefix_tokens_reused"]}

  def start(self) -> None:
    """Runs `step` on a thread of its own until `shutdown`."""
    self._thread = threading.Thread(target=self._loop, name="gemma_jax-engine", daemon=True)
    self._thread.start()

  def shutdown(self, grace_seconds: float = 10.0) -> None:
    """Stops admitting; lets running and queued requests finish for `grace_seconds`,
    cancels the rest, and stops the thread."""
    with self._lock:
      self._admitting = False
    deadline = time.monotonic() + grace_seconds
    while self.busy and time.monotonic() < deadline:
      time.sleep(0.01)
    with self._lock:
      self._cancelled.update(s.id for s in itertools.chain(self._queue, self._running))
      self._lock.notify_all()
    while self.busy and self._thread is not None and self._thread.is_alive():
      time.sleep(0.01)
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    if self._thread is not None:
      self._thread.join()

  def _loop(self) -> None:
    while True:
      with self._lock:
        while not self._stopping and not (self._queue or self._running or self._cancelled):
          self._lock.wait()
        if self._stopping:
          return
      try:
        self.step()
      except Exception as error:   # pylint: disable=broad-except
        self._fail(error)
        return

  def _fail(self, error: Exception) -> None:
    """The engine thread's step raised: every request ends with finish "error", and
    the engine takes no more (submit raises RuntimeError naming the error)."""
    logging.exception("the serving engine stopped: %s", error)
    with self._lock:
      self.failure = f"{type(error).__name__}: {error}"
      self._admitting = False
      for seq in list(itertools.chain(self._queue, self._running)):
        self._finish(seq, Output(None, finish="error"))
      self._cancelled.clear()

  # ------------------------------------------------------------------ one step

  def step(self) -> None:
    """Cancels, admits, prefills one chunk per prefilling request (up to prefill_rows),
    and decodes one token in every decoding slot."""
    with self._lock:
      self._drop_cancelled()
      self._admit()
      prefilling = [s for s in self._running if s.prefilling][:self.shape.prefill_rows]
    with self._on_mesh():
      if prefilling:
        self._prefill(prefilling)
      decoding = [s for s in self._running if not s.prefilling]
      if decoding:
        self._decode(decoding)

  def _drop_cancelled(self) -> None:
    for seq in [s for s in itertools.chain(self._queue, self._running)
                if s.id in self._cancelled]:
      self._finish(seq, Output(None, _flush(seq)[0], finish="cancelled"))
    self._cancelled.clear()

  def _admit(self) -> None:
    while self._queue and None in self._slots:
      seq = self._queue[0]
      seq.filled = self.pages.reuse_prefix(seq)
      end = min(seq.filled + self.shape.prefill_chunk, len(seq.tokens))
      if not self.pages.fits(seq, seq.filled, end):
        self.pages.release(seq)
        return
      self._queue.popleft()
      self.stats["prefix_tokens_reused"] += seq.filled
      seq.slot, seq.admitted = self._slots.index(None), time.monotonic()
      self._slots[seq.slot] = seq
      self._running.append(seq)
      if seq.images is not None and seq.soft is None:
        self._soft_tokens(seq)
      given = len(seq.tokens) - seq.generated        # the prompt, image spans included
      prompt = np.full((self.max_length,), self.vocab_size, np.int32)   # past V: padding
      prompt[:given] = seq.tokens[:given]
      done = np.full((self.max_length,), self.vocab_size, np.int32)
      done[:seq.generated] = seq.tokens[given:]
      with self._on_mesh():
        self._seen, self._counts = self._reset_row(self._seen, self._counts, seq.slot, prompt,
                                                   done)

  def _soft_tokens(self, seq: Sequence) -> None:
    """seq's placeholder embeddings, computed once from its images."""
    tokens = np.zeros((1, self.max_length), np.int32)
    tokens[0, :len(seq.tokens)] = seq.tokens[:self.max_length]
    with self._on_mesh():
      soft = self.programs.soft(self.params, tokens, seq.images)
    seq.soft = jnp.pad(soft, ((0, self.shape.prefill_chunk), (0, 0)))

  def _chunk_soft_tokens(self, chunks, rows: int) -> Optional[jax.Array]:
    """[rows, chunk, D] placeholder embeddings of the chunks (zeros for text and padding
    rows), or None for a model without vision."""
    if not self._model.vision.enabled:
      return None
    c, d = self.shape.prefill_chunk, self._model.d_model
    soft = [jax.lax.dynamic_slice_in_dim(seq.soft, seq.filled, c) if seq.soft is not None
            else jnp.zeros((c, d), jnp.dtype(self._model.dtype)) for seq, _ in chunks]
    padding = [jnp.zeros((c, d), jnp.dtype(self._model.dtype))] * (rows - len(chunks))
    return jnp.stack(soft + padding)

  def _room(self, seq: Sequence, end: int) -> bool:
    """Pages for seq's positions up to `end`, preempting the requests admitted after it
    (latest first) while a pool runs out; False when seq itself must wait."""
    while not self.pages.allocate(seq, seq.filled, end):
      victim = self._running[-1]
      self._preempt(victim)
      if victim is seq:
        return False
    return True

  def _preempt(self, seq: Sequence) -> None:
    with self._lock:
      self.pages.release(seq)
      self._running.remove(seq)
      self._slots[seq.slot], seq.slot, seq.filled = None, None, 0
      self._queue.appendleft(seq)
      self.stats["preemptions"] += 1

  def _tables(self, rows: List[Optional[Sequence]]) -> dict:
    m = self.shape.max_blocks
    return {kind: np.asarray([self.pages.table_row(s, kind, m) if s else [0] * m
                              for s in rows], np.int32) for kind in self.pages.pools}

  def _prefill(self, prefilling: List[Sequence]) -> None:
    c = self.shape.prefill_chunk
    chunks = []
    for seq in prefilling:   # a row may lose its slot to the room an earlier one needs
      end = images_lib.chunk_end(seq.tokens, seq.filled,
                                 min(seq.filled + c, len(seq.tokens) - 1), self._model)
      if seq.slot is not None and self._room(seq, end):
        chunks.append((seq, end))   # rooms preempt only later rows: it keeps its slot
    if not chunks:
      return
    # Rows for the chunks at hand, a power of two (at most prefill_rows): a prefill call
    # computes every row it is given, padding ones too.
    rows = min(1 << (len(chunks) - 1).bit_length(), self.shape.prefill_rows)
    tokens = np.zeros((rows, c), np.int32)
    starts, counts = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
    for r, (seq, end) in enumerate(chunks):
      tokens[r, :end - seq.filled] = seq.tokens[seq.filled:end]
      starts[r], counts[r] = seq.filled, end - seq.filled
    table_rows = [seq for seq, _ in chunks] + [None] * (rows - len(chunks))
    self._pools = self.programs.prefill(self.params, self._pools, tokens, starts, counts,
                                        self._tables(table_rows),
                                        self._chunk_soft_tokens(chunks, rows))
    for seq, end in chunks:
      seq.filled = end
      self.pages.cache_full_blocks(seq)
      self.pages.release_behind(seq, seq.filled)

  def _decode(self, decoding: List[Sequence]) -> None:
    for seq in decoding:
      if seq.slot is not None:   # not preempted for a request admitted before it
        self._room(seq, seq.filled + 1)
    rows = list(self._slots)   # _emit frees the slots of the requests it finishes
    active = [s is not None and not s.prefilling for s in rows]
    if not any(active):
      return
    tokens = np.array([s.tokens[-1] if a else 0 for s, a in zip(rows, active)], np.int32)
    positions = np.array([s.filled if a else 0 for s, a in zip(rows, active)], np.int32)
    seeds = np.array([s.seed if a else 0 for s, a in zip(rows, active)], np.uint32)
    indices = np.array([s.generated if a else 0 for s, a in zip(rows, active)], np.int32)
    options = sampling.RowOptions.of([s.request.sampling if a else _IDLE
                                      for s, a in zip(rows, active)])
    choice, self._pools, self._counts = self.programs.decode(
        self.params, self._pools, tokens, positions, np.asarray(active), self._tables(rows),
        options, self._seen, self._counts, seeds, indices)
    choice = jax.device_get(choice)   # the one host sync of a step: the new tokens
    for slot, seq in enumerate(rows):
      if active[slot]:
        self._emit(seq, choice, slot)

  def _emit(self, seq: Sequence, choice: sampling.Choice, slot: int) -> None:
    """seq's new token: recorded, sent out, and the request finished where it ends."""
    token = int(choice.tokens[slot])
    seq.filled += 1
    seq.tokens.append(token)
    seq.generated += 1
    self.pages.cache_full_blocks(seq)
    self.pages.release_behind(seq, seq.filled)
    self.stats["generated_tokens"] += 1
    if seq.first_token is None:
      seq.first_token = time.monotonic()
      self._ttft_sum += seq.first_token - seq.submitted
      self.stats["first_tokens"] += 1
    logprob, top = None, ()
    if seq.request.logprobs is not None:
      logprob = float(choice.logprobs[slot])
      n = seq.request.logprobs
      top = tuple((int(i), float(p)) for i, p in zip(choice.top_ids[slot][:n],
                                                      choice.top_logprobs[slot][:n]))
    finish, text = None, ""
    if token in seq.request.stop_ids:
      finish, text = "stop", _flush(seq)[0]
    elif seq.stops:
      text, stopped = seq.stops.add(token)
      finish = "stop" if stopped else None
    if finish is None and (seq.generated >= seq.request.max_tokens
                           or len(seq.tokens) >= self.max_length):
      more, stopped = _flush(seq)
      text, finish = text + more, "stop" if stopped else "length"
    output = Output(token, text, logprob, top, finish)
    if finish:
      with self._lock:
        self._finish(seq, output)
    else:
      seq.on_output(output)

  def _finish(self, seq: Sequence, output: Output) -> None:
    """Frees seq's slot and pages and sends its last output (the lock held)."""
    self.pages.release(seq)
    if seq in self._running:
      self._running.remove(seq)
      self._slots[seq.slot] = None
    elif seq in self._queue:
      self._queue.remove(seq)
    seq.slot = None
    self.stats["requests_finished"] += 1
    seq.on_output(output)


def _flush(seq: Sequence) -> tuple:
  """(seq's held text, whether it ends in a stop string): ("", False) without text."""
  return seq.stops.flush() if seq.stops else ("", False)


def _reset_row(seen, counts, slot, prompt, generated):
  """Slot `slot`'s rows of the penalties' state: the tokens of `prompt` [max_length] seen,
  each of `generated` [max_length] counted (ids past the vocabulary: padding)."""
  vocab = seen.shape[1]
  row_seen = jnp.zeros((vocab,), bool).at[prompt].set(True, mode="drop")
  row_counts = jnp.zeros((vocab,), jnp.int32).at[generated].add(1, mode="drop")
  return seen.at[slot].set(row_seen), counts.at[slot].set(row_counts)
