r"""Serving many requests: our engine against static batches and transformers' continuous
batching, on the same requests and the same weights.

    python benchmarks/serving.py                  # 64 requests, all three systems
    python benchmarks/serving.py --num_requests=8 --max_prompt=64 --max_output=16

The requests: `--num_requests` prompts of random tokens, lengths uniform in
16..`--max_prompt`, each asking for a number of tokens uniform in 16..`--max_output`
(seeded), decoded greedily with no stop ids, so that each produces exactly what it asks
(checked). They arrive all at once, then as a Poisson process of `--rate` requests a
second. The systems, over the same random weights of `--shape` in float32:

- engine: `gemma_jax.serving.Engine` (continuous batching over paged caches), stepped
  on this thread, each request submitted between steps once its arrival time has
  passed. A fresh engine per arrival pattern, so that no prompt finds its pages cached.
- static: today's path, `sampler.generate` over batches of `--num_slots` requests in
  arrival order, prompts padded to `Sampler`'s bucket of the batch's longest, each batch
  run to its longest output (a batch short of requests is filled with one-token rows, so
  that one program serves a bucket). One batch runs at a time. It starts when the
  previous one ends, with the requests waiting then (at most `--num_slots`); when none
  wait, and for the first batch, once `--num_slots` requests wait (the trace's last
  ones: once the last arrives). Each batch is timed to its first token (limit 1) and to
  its end, on a clock of those times rather than the wall's; its tokens are placed on
  it as if the loop streamed them, one every (end - first) / (longest output - 1), which
  favours it: the program returns them all at its end.
- transformers: `generate_batch`'s loop (`continuous_batching_context_manager`, then
  `add_request` with each request's `max_new_tokens`, which `generate_batch` cannot
  take per request) on `AutoModelForCausalLM` of the same weights, each request
  submitted at its arrival time, token times from its `record_timestamps`. Its limits
  are ours: `--num_slots` requests a batch, `--prefill_chunk` + `--num_slots` tokens a
  forward, a cache of `--num_slots` full contexts (its default takes 60% of host
  memory). A fresh manager per pattern.

Per system and pattern: throughput (tokens generated / seconds from the first arrival to
the last token), time to first token (from arrival) and the gaps between a request's
tokens, p50 / p90 / p99, and the warm-up (compile) time apart; whether each request's
tokens equal the engine's. The cache: the pages the engine's requests hold at their peak
(counted at each step's first output; pages only its prefix cache keeps left out) times a
page's bytes, per attention type, against the rings the static path holds for batches of
`--num_slots` consecutive requests: rows x (longest prompt + longest output - 1)
positions on global layers, at most the window on local ones (`decoding.ring_sizes`),
the largest batch's. The targets are checked on the all-at-once pattern: under Poisson
arrivals throughput follows the arrival rate.
`--output`: default benchmarks/results/serving_<backend>.json.
"""

import collections
import tempfile
import time
from typing import Dict, List, NamedTuple

from absl import app
from absl import flags
import jax
import numpy as np

import common
import gemma_jax as gj
from gemma_jax.inference import decoding, sampler, sampling
from gemma_jax.serving import paged_model
from gemma_jax.serving.engine import Engine
from gemma_jax.serving.requests import Request, SamplingOptions

SYSTEMS = ("engine", "static", "transformers")
GREEDY = SamplingOptions(temperature=0.0)
WARM_PROMPT = (3,) * 17   # the warm-up request: one prefill chunk, two decode steps

_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests served.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt", 512, "Longest prompt (shortest: 16).")
_MAX_OUTPUT = flags.DEFINE_integer("max_output", 256, "Most tokens a request asks (least: 16).")
_SHAPE = flags.DEFINE_string("shape", "gemma3-small",
                             f"Model: {sorted(common.SHAPES)} or a preset name.")
_RATE = flags.DEFINE_float("rate", 1.0, "Poisson arrivals: requests per second.")
_SLOTS = flags.DEFINE_integer("num_slots", 16, "Requests decoded together, every system.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens a page of the engine's pools.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens an engine prefill call "
                              "writes per request.")
_ROWS = flags.DEFINE_integer("prefill_rows", 1, "Requests whose prompt chunks one engine "
                             "step computes together.")
_OUTPUT = flags.DEFINE_string("output", None, "JSON output; default "
                              "benchmarks/results/serving_<backend>.json.")
_SYSTEMS = flags.DEFINE_list("systems", list(SYSTEMS), f"Systems to run, of {SYSTEMS}.")


class Workload(NamedTuple):
  """The requests: prompts (int32 arrays), tokens each asks, and per arrival pattern
  the second each arrives (ascending)."""
  prompts: List[np.ndarray]
  outputs: List[int]
  arrivals: Dict[str, np.ndarray]


class Served(NamedTuple):
  """One system's run of one pattern: each request's token ids and their times (seconds
  from the first arrival), and the warm-up's seconds."""
  tokens: List[List[int]]
  times: List[np.ndarray]
  compile_s: float


def make_workload(vocab_size: int) -> Workload:
  rng = np.random.default_rng(0)
  n, top_prompt, top_output = _REQUESTS.value, _MAX_PROMPT.value, _MAX_OUTPUT.value
  lengths = rng.integers(min(16, top_prompt), top_prompt + 1, n)
  outputs = [int(k) for k in rng.integers(min(16, top_output), top_output + 1, n)]
  prompts = [rng.integers(3, vocab_size, k).astype(np.int32) for k in lengths]
  poisson = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / _RATE.value, n - 1))])
  return Workload(prompts, outputs, {"all at once": np.zeros(n), "poisson": poisson})


def percentiles(values) -> List[float]:
  return [float(v) for v in np.percentile(values, [50, 90, 99])]


def summary(work: Workload, arrivals: np.ndarray, served: Served, reference) -> dict:
  """The figures of one run; raises unless every request got the tokens it asked.
  reference: the engine's tokens of the same pattern (None: not compared)."""
  got = [len(t) for t in served.times]
  if got != work.outputs or [len(t) for t in served.tokens] != got:
    raise RuntimeError(f"requests produced {got} tokens, asked {work.outputs}")
  wall = max(float(t[-1]) for t in served.times)
  return {"generated_tokens": sum(got), "wall_s": wall, "tokens_per_s": sum(got) / wall,
          "ttft_s": percentiles([t[0] - a for t, a in zip(served.times, arrivals)]),
          "inter_token_s": percentiles(np.concatenate([np.diff(t) for t in served.times])),
          "compile_s": served.compile_s,
          "same_tokens_as_engine": None if reference is None else
          sum(a == b for a, b in zip(served.tokens, reference))}


# ---------------------------------------------------------------------- engine

class EngineRun:
  """A trace through a fresh engine on this thread: what it served, the most pages its
  requests held per type, and its steps' seconds, with a prefill call or without."""

  def __init__(self, config, params, cache_dtype: str):
    self.engine = Engine(config, params, num_slots=_SLOTS.value, page_size=_PAGE.value,
                         prefill_chunk=_CHUNK.value, prefill_rows=_ROWS.value,
                         max_length=_MAX_PROMPT.value + _MAX_OUTPUT.value,
                         cache_dtype=cache_dtype)
    self.peak_pages = collections.Counter()
    self.peak_in_use = collections.Counter()   # the prefix cache's pages too
    self.step_seconds = {"with prefill": [], "decode only": []}
    self.prefills = 0
    prefill = self.engine.programs.prefill

    def counted(*args, **kwargs):
      self.prefills += 1
      return prefill(*args, **kwargs)
    self.engine.programs.prefill = counted

  def count_pages(self) -> None:
    for kind, pool in self.engine.pages.pools.items():
      self.peak_pages[kind] = max(self.peak_pages[kind], pool.num_pages - pool.available)
      self.peak_in_use[kind] = max(self.peak_in_use[kind], pool.in_use + pool.cached_only)

  def serve(self, work: Workload, arrivals: np.ndarray) -> Served:
    t = time.perf_counter()
    self.engine.generate([Request(prompt=WARM_PROMPT, max_tokens=2, sampling=GREEDY, seed=0)])
    compile_s = time.perf_counter() - t
    n = len(work.prompts)
    tokens, times = [[] for _ in range(n)], [[] for _ in range(n)]
    counted = [False]   # whether this step's pages were counted: at its first output

    def on_output(i: int):
      def record(output):
        times[i].append(time.perf_counter() - start)
        tokens[i].append(output.token)
        if not counted[0]:
          counted[0] = True
          self.count_pages()
      return record

    start, submitted = time.perf_counter(), 0
    while submitted < n or self.engine.busy:
      now = time.perf_counter() - start
      while submitted < n and arrivals[submitted] <= now:
        self.engine.submit(Request(prompt=tuple(int(t) for t in work.prompts[submitted]),
                                   max_tokens=work.outputs[submitted], sampling=GREEDY,
                                   seed=0), on_output(submitted))
        submitted += 1
      if not self.engine.busy:
        time.sleep(max(arrivals[submitted] - now, 0.0))
        continue
      counted[0], prefills, t = False, self.prefills, time.perf_counter()
      self.engine.step()
      kind = "with prefill" if self.prefills > prefills else "decode only"
      self.step_seconds[kind].append(time.perf_counter() - t)
    return Served(tokens, [np.asarray(t) for t in times], compile_s)

  def page_bytes(self, config, cache_dtype: str) -> Dict[str, float]:
    """{attention type: bytes of one page over all its layers}, from the pools' shapes."""
    pools = jax.eval_shape(lambda p: self.engine.programs.pools(p, cache_dtype),
                           self.engine.params)
    types = decoding.layer_types(config.model)
    total = collections.Counter()
    for name, layer in pools.items():
      total[types[int(name.split("_")[-1])]] += paged_model.pool_bytes(layer)
    return {kind: b / self.engine.shape.num_pages[kind] for kind, b in total.items()}

  def profile(self) -> dict:
    seconds = self.step_seconds
    return {"steps": {k: len(v) for k, v in seconds.items()},
            "mean_step_s": {k: float(np.mean(v)) if v else 0.0 for k, v in seconds.items()},
            "peak_pages": dict(self.peak_pages), "peak_in_use": dict(self.peak_in_use),
            "pool_pages": dict(self.engine.shape.num_pages),
            "preemptions": self.engine.metrics()["preemptions"]}


# ---------------------------------------------------------------------- static batches

class StaticBatches:
  """`sampler.generate` over padded batches of `--num_slots` rows (see the module
  docstring), one compiled program per prompt bucket."""

  def __init__(self, config, params, cache_dtype: str):
    self.decoding = decoding.make_decoding(config)
    self.params = self.decoding.unrolled(params)
    self.cache_dtype = cache_dtype
    self.new_tokens = sampler.bucket(_MAX_OUTPUT.value)
    self.compiled = {}
    self.compile_s = 0.0

  def run(self, prompts: List[np.ndarray], limit: int):
    """(seconds to the first token, seconds to `limit` tokens, the tokens [rows, limit])
    of one batch."""
    rows = _SLOTS.value
    width = sampler.bucket(max(len(p) for p in prompts))
    tokens = np.zeros((rows, width), np.int32)
    tokens[:, 0] = 3
    lengths = np.ones((rows,), np.int32)
    for r, prompt in enumerate(prompts):
      tokens[r, :len(prompt)], lengths[r] = prompt, len(prompt)
    args = lambda n: (self.params, tokens, lengths, jax.random.key(0),
                      np.zeros((0,), np.int32), None, np.int32(n), sampling.GREEDY)
    if width not in self.compiled:   # compiled, then run once
      t = time.perf_counter()
      self.compiled[width] = sampler.generate.lower(
          self.decoding, *args(1), max_new_tokens=self.new_tokens, pad_id=0,
          cache_length=width + self.new_tokens - 1, cache_dtype=self.cache_dtype).compile()
      np.asarray(self.compiled[width](*args(1)))
      self.compile_s += time.perf_counter() - t
    seconds = []
    for n in (1, limit):
      t = time.perf_counter()
      out = np.asarray(self.compiled[width](*args(n)))
      seconds.append(time.perf_counter() - t)
    return seconds[0], seconds[1], out[:len(prompts), :limit]

  def serve(self, work: Workload, arrivals: np.ndarray) -> Served:
    n, rows = len(work.prompts), _SLOTS.value
    tokens, times = [None] * n, [None] * n
    clock, i, compiled = None, 0, self.compile_s
    while i < n:
      if clock is None or arrivals[i] > clock:   # none waits: starts once full
        batch = list(range(i, min(i + rows, n)))
        start = arrivals[batch[-1]]
      else:                                      # those waiting when the last one ends
        batch = [j for j in range(i, min(i + rows, n)) if arrivals[j] <= clock]
        start = clock
      longest = max(work.outputs[j] for j in batch)
      first, total, out = self.run([work.prompts[j] for j in batch], longest)
      step = (total - first) / max(longest - 1, 1)
      for r, j in enumerate(batch):
        tokens[j] = out[r, :work.outputs[j]].tolist()
        times[j] = start + first + step * np.arange(work.outputs[j])
      clock, i = start + total, i + len(batch)
    return Served(tokens, times, self.compile_s - compiled)


# ---------------------------------------------------------------------- transformers

class TheirBatching:
  """transformers' continuous batching on the PyTorch model of the same weights."""

  def __init__(self, config, params):
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    self.transformers = transformers
    with tempfile.TemporaryDirectory() as path:
      gj.hf.save(path, config, params)
      self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

  def serve(self, work: Workload, arrivals: np.ndarray) -> Served:
    t = self.transformers
    page = t.ContinuousBatchingConfig.page_size
    context = _MAX_PROMPT.value + _MAX_OUTPUT.value
    limits = t.ContinuousBatchingConfig(
        num_blocks=_SLOTS.value * -(-context // page), max_requests_per_batch=_SLOTS.value,
        max_batch_tokens=_CHUNK.value + _SLOTS.value)
    generation = t.GenerationConfig(do_sample=False, max_new_tokens=_MAX_OUTPUT.value,
                                    eos_token_id=-1, pad_token_id=0)
    begun = time.perf_counter()
    with self.model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=limits) as manager:
      manager.add_request(list(WARM_PROMPT), max_new_tokens=2)
      manager.get_result(timeout=600)
      compile_s = time.perf_counter() - begun
      n, index = len(work.prompts), {}
      start = time.perf_counter()
      for i, prompt in enumerate(work.prompts):
        time.sleep(max(start + arrivals[i] - time.perf_counter(), 0.0))
        index[manager.add_request(prompt.tolist(), max_new_tokens=work.outputs[i],
                                  record_timestamps=True)] = i
      results = {}
      while len(results) < n:
        result = manager.get_result(timeout=600)
        if result is None:
          raise RuntimeError(f"transformers served {len(results)} of {n} requests")
        if result.is_finished():
          results[index[result.request_id]] = result
    ordered = [results[i] for i in range(n)]
    return Served([list(r.generated_tokens) for r in ordered],
                  [np.asarray(r.timestamps) - start for r in ordered], compile_s)


# ---------------------------------------------------------------------- the cache

def contiguous_bytes(config, work: Workload, per_page: Dict[str, float]) -> Dict[str, float]:
  """{attention type: bytes} of the static path's rings for its largest batch of
  `--num_slots` consecutive requests (decoding.py's ring sizes)."""
  per_token = {kind: b / _PAGE.value for kind, b in per_page.items()}
  rows, n, largest = _SLOTS.value, len(work.prompts), {}
  for i in range(0, n, rows):
    batch = range(i, min(i + rows, n))
    length = (max(len(work.prompts[j]) for j in batch) + max(work.outputs[j] for j in batch)
              - 1)
    held = {kind: len(batch) * size * per_token[kind]
            for kind, size in decoding.ring_sizes(config.model, length).items()}
    if sum(held.values()) > sum(largest.values()):
      largest = held
  return largest


def cache_rows(engine: dict, contiguous: Dict[str, float]) -> List[list]:
  """Table rows per pattern and type, and all types together: the engine's peak bytes
  against the static path's."""
  mib, rows = 2.0 ** -20, []
  for pattern, run in engine.items():
    peak = {kind: pages * run["page_bytes"][kind]
            for kind, pages in run["peak_pages"].items()}
    for kind in sorted(peak):
      rows.append([pattern, kind, run["peak_pages"][kind], run["page_bytes"][kind] / 1024,
                   peak[kind] * mib, contiguous[kind] * mib, peak[kind] / contiguous[kind]])
    total, static = sum(peak.values()), sum(contiguous.values())
    rows.append([pattern, "all", "", "", total * mib, static * mib, total / static])
  return rows


def ms(values: List[float]) -> str:
  return " / ".join(f"{1000 * v:.0f}" for v in values)


def serve_all(config, params, work: Workload, cache_dtype: str):
  """({(system, pattern): figures}, {pattern: the engine's profile}) of the systems asked."""
  results, engine, reference = {}, {}, {}
  if "engine" in _SYSTEMS.value:
    for pattern, arrivals in work.arrivals.items():
      run = EngineRun(config, params, cache_dtype)
      served = run.serve(work, arrivals)
      reference[pattern] = served.tokens
      results["engine", pattern] = summary(work, arrivals, served, None)
      engine[pattern] = dict(run.profile(), page_bytes=run.page_bytes(config, cache_dtype))
  servers = {"static": lambda: StaticBatches(config, params, cache_dtype),
             "transformers": lambda: TheirBatching(config, params)}
  for system, make in servers.items():
    if system in _SYSTEMS.value:
      server = make()
      for pattern, arrivals in work.arrivals.items():
        results[system, pattern] = summary(work, arrivals, server.serve(work, arrivals),
                                           reference.get(pattern))
  return results, engine


def engine_report(config, work: Workload, results: dict, engine: dict):
  """Prints the engine's steps and cache; returns (the static path's contiguous bytes per
  type, the targets as [name, measured, met])."""
  for pattern, run in engine.items():
    steps, mean = run["steps"], run["mean_step_s"]
    print(f"engine, {pattern}: {steps['with prefill']} steps with a prefill call "
          f"({1000 * mean['with prefill']:.1f} ms each), {steps['decode only']} decode only "
          f"({1000 * mean['decode only']:.1f} ms); peak pages {run['peak_pages']} "
          f"({run['peak_in_use']} with the prefix cache's) of {run['pool_pages']}; "
          f"{run['preemptions']} preemptions")
  saturated = engine["all at once"]
  contiguous = contiguous_bytes(config, work, saturated["page_bytes"])
  rows = cache_rows(engine, contiguous)
  common.print_table(
      "KV cache: the engine's requests at their peak against the static path's rings",
      ["arrivals", "type", "engine peak pages", "KiB / page", "engine peak (MiB)",
       "static contiguous (MiB)", "engine / static"], rows)
  pools = {kind: pages * saturated["page_bytes"][kind]
           for kind, pages in saturated["pool_pages"].items()}
  print(f"the engine's pools as allocated: {sum(pools.values()) / 2 ** 20:.1f} MiB "
        f"({', '.join(f'{k} {v / 2 ** 20:.1f}' for k, v in sorted(pools.items()))})")
  ratio = [r[-1] for r in rows if r[:2] == ["all at once", "all"]][0]
  targets = [["engine peak cache <= 0.5x contiguous", ratio, ratio <= 0.5]]
  ours = results["engine", "all at once"]["tokens_per_s"]
  for system in ("static", "transformers"):
    if (system, "all at once") in results:
      speedup = ours / results[system, "all at once"]["tokens_per_s"]
      targets.append([f"engine throughput >= 2x {system}", speedup, speedup >= 2])
  common.print_table("targets (all at once)", ["target", "measured", "status"],
                     [[name, value, "PASS" if ok else "FAIL"] for name, value, ok in targets])
  return contiguous, targets


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = set(_SYSTEMS.value) - set(SYSTEMS)
  if unknown:
    raise app.UsageError(f"unknown systems {sorted(unknown)}; of {SYSTEMS}")
  config = common.shape_config(_SHAPE.value)
  config.model.dtype = "float32"
  cache_dtype = decoding.default_cache_dtype(config)
  params = gj.transform(config).init(jax.random.key(0), np.zeros((1, 8), np.int32))
  work = make_workload(config.model.vocab_size)
  results, engine = serve_all(config, params, work, cache_dtype)

  n = len(work.prompts)
  common.print_table(
      f"{n} requests (prompts {min(16, _MAX_PROMPT.value)}..{_MAX_PROMPT.value}, outputs "
      f"{min(16, _MAX_OUTPUT.value)}..{_MAX_OUTPUT.value} tokens, greedy), {_SHAPE.value} "
      f"float32, {_SLOTS.value} slots, Poisson at {_RATE.value} requests/s",
      ["system", "arrivals", "tokens/s", "TTFT p50 / p90 / p99 (ms)",
       "inter-token p50 / p90 / p99 (ms)", "wall (s)", "warm-up (s)", "tokens = engine's"],
      [[system, pattern, r["tokens_per_s"], ms(r["ttft_s"]), ms(r["inter_token_s"]),
        r["wall_s"], r["compile_s"],
        "" if r["same_tokens_as_engine"] is None else f"{r['same_tokens_as_engine']}/{n}"]
       for (system, pattern), r in results.items()])
  contiguous, targets = engine_report(config, work, results, engine) if engine else (None, [])
  common.write_json(common.output_path(_OUTPUT.value, "serving"), {
      "shape": _SHAPE.value, "flags": {f: flags.FLAGS[f].value for f in (
          "num_requests", "max_prompt", "max_output", "rate", "num_slots", "page_size",
          "prefill_chunk", "systems")},
      "prompt_lengths": [len(p) for p in work.prompts], "outputs": work.outputs,
      "arrivals": {k: v.tolist() for k, v in work.arrivals.items()},
      "results": [dict(system=s, arrivals=p, **r) for (s, p), r in results.items()],
      "engine": engine, "static_contiguous_bytes": contiguous,
      "targets": [dict(target=name, measured=value, met=bool(ok)) for name, value, ok in targets]})


if __name__ == "__main__":
  app.run(main)
