"""What every benchmark shares: timing, the machine it ran on, a table and a JSON file.

Benchmarks are scripts, not tests: each prints a markdown table and writes its numbers
with `write_json`, by default under benchmarks/results/ (`output_path`), so a README
figure can always be traced to a run.
"""

import json
import os
import platform
import resource
import time
from typing import Callable, Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gemma_jax as gj
from gemma_jax.training import optimizer, steps


# Small Gemma 3 and Gemma 4-MoE shapes at d_model 512 (CPU-sized); gemma3-small,
# gemma4-moe-16x4 and gemma3-long are issue 21's target shapes.
_D512 = dict(vocab_size=4096, num_layers=6, d_model=512, num_heads=8, num_kv_heads=4,
             head_dim=64, sliding_window=128)
_MOE = dict(_D512, global_head_dim=128, global_num_kv_heads=2, mlp_dim=1024,
            expert_mlp_dim=512)
SHAPES = {
    "gemma3": ("gemma3-tiny", dict(_D512, mlp_dim=2048)),
    "gemma4-moe": ("gemma4-moe-tiny", dict(_MOE, num_experts=8, experts_per_token=2)),
    "gemma3-small": ("gemma3-tiny", dict(_D512, mlp_dim=2048, num_layers=12,
                                         sliding_window=256)),
    "gemma4-moe-16x4": ("gemma4-moe-tiny", dict(_MOE, num_experts=16, experts_per_token=4)),
    # Long rows: the published window (512), e.g. --batch_size=1 --seq_len=8192.
    "gemma3-long": ("gemma3-tiny", dict(_D512, mlp_dim=2048, sliding_window=512)),
}


def shape_config(name: str):
  """The config of a shape of SHAPES, or of the preset of that name."""
  preset, shape = SHAPES.get(name, (name, {}))
  config = gj.get_config(preset)
  config.model.update(shape)
  return config


def median_seconds(fn: Callable[[], object], *, min_runs: int = 3,
                   min_seconds: float = 1.0) -> float:
  """Median wall time of fn() (which must block until its work is done), after one
  warm-up call; at least `min_runs` runs and `min_seconds` of timing."""
  fn()
  times, start = [], time.perf_counter()
  while len(times) < min_runs or time.perf_counter() - start < min_seconds:
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def alternating_medians(fns: Dict[str, Callable[[], object]], rounds: int,
                        quiet_rounds: int = 3, max_warmup_rounds: int = 20
                        ) -> Dict[str, float]:
  """Median seconds of each fn over `rounds` rounds that run every fn once in turn, so
  that a slow phase of the machine falls on all of them alike. Warm-up rounds first, until
  `quiet_rounds` rounds in a row in which no fn faults in more than 1000 pages (or
  `max_warmup_rounds`): the host heap grows over a CPU train step's first calls
  (docs/architecture.md), and the steady state is what a long loop sees. It does not
  grow steadily: XLA's threads free and allocate in an order that varies, so a step can
  fault in 300k pages after one that faulted none (the MoE shape's user loop: ~10
  steps before it stops), and one quiet round was not the end of it."""
  quiet = 0
  for _ in range(max_warmup_rounds):
    quiet = quiet + 1 if max(minor_page_faults(fn) for fn in list(fns.values())) <= 1000 else 0
    if quiet == quiet_rounds:
      break
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  return {name: float(np.median(ts)) for name, ts in times.items()}


def minor_page_faults(fn: Callable[[], object]) -> int:
  """Minor page faults of this process (pages mapped in on first touch) during one
  fn(), which must block until its work is done."""
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  fn()
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def machine() -> dict:
  """Where the numbers come from."""
  return {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
          "devices": jax.device_count(), "cpus": os.cpu_count(),
          "processor": platform.processor() or platform.machine(), "jax": jax.__version__}


def print_table(title: str, columns: Sequence[str], rows: List[Sequence]) -> None:
  """A markdown table under a title line; floats with 3 significant digits."""
  cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  print(f"\n{title}")
  print("| " + " | ".join(columns) + " |")
  print("|" + "---|" * len(columns))
  for row in rows:
    print("| " + " | ".join(cell(v) for v in row) + " |")


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def output_path(out, name: str) -> str:
  """`out` if given, else benchmarks/results/<name>_<backend>.json wherever the script
  is run from."""
  return out or os.path.join(RESULTS, f"{name}_{jax.default_backend()}.json")


def write_json(path: str, payload: dict) -> None:
  """payload plus `machine()`, written to path (directories created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"machine": machine(), **payload}, f, indent=1)
  print(f"wrote {path}")


def abstract_train_step(config, batch_size: int, seq_len: int):
  """(the jitted train step of `config` with donated state, its abstract state and
  batch): lower it with `.lower(state, batch)` without allocating anything."""
  model = gj.transform(config)
  schedule = optimizer.learning_rate_schedule(config.optimizer, config.train.steps)
  tx = optimizer.make_optimizer(config.optimizer, schedule)
  state = jax.eval_shape(lambda: steps.init_state(model, tx, seed=0, seq_len=seq_len))
  rows = jax.ShapeDtypeStruct((batch_size, seq_len), np.int32)
  batch = dict(tokens=rows, segment_ids=rows, positions=rows, targets=rows,
               weights=jax.ShapeDtypeStruct((batch_size, seq_len), np.float32))
  step = jax.jit(steps.make_train_step(steps.model_forward(model), tx, schedule),
                 donate_argnums=0)
  return step, state, batch


def user_train_step(config, tokens, loss: str = "logits", abstract: bool = False,
                    segment_ids: bool = False):
  """What a user's own loop compiles: (a jitted step(params, opt_state, tokens) ->
  (params, opt_state, loss) with params and optimizer state donated, params, opt_state).
  The step is `jax.value_and_grad` over the next-token cross-entropy, then optax's
  clipped AdamW; nothing else of ours. `loss` "logits": optax's cross-entropy over
  `gj.transform(config).apply`'s logits; "chunked": `gj.transform(config).loss` with its
  default next-token targets (rows of T tokens stay T long); "chunked_shifted": the same
  over `tokens[:, :-1]` and `tokens[:, 1:]` (T - 1 long, as the loss was called before).
  `abstract`: params and opt_state as shapes only (tokens may be a ShapeDtypeStruct),
  for lowering without allocating. `segment_ids`: passes one document's ids per row, as
  a loop over packed rows does (a fused attention kernel then reads a mask array)."""
  model, o = gj.transform(config), config.optimizer
  tx = optax.chain(optax.clip_by_global_norm(o.max_grad_norm),
                   optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                               weight_decay=o.weight_decay))
  init = lambda: model.init(jax.random.key(0), np.zeros(tokens.shape, np.int32))
  params = jax.eval_shape(init) if abstract else init()
  opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)

  def objective(params, tokens):
    ids = lambda t: jnp.ones_like(t) if segment_ids else None
    if loss == "chunked":
      sums = model.loss(params, tokens, segment_ids=ids(tokens))
      return sums.cross_entropy / sums.weight
    if loss == "chunked_shifted":
      sums = model.loss(params, tokens[:, :-1], tokens[:, 1:], segment_ids=ids(tokens[:, :-1]))
      return sums.cross_entropy / sums.weight
    logits = model.apply(params, tokens, segment_ids=ids(tokens))
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                           tokens[:, 1:]).mean()

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(objective)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, donate_argnums=(0, 1)), params, opt_state
