r"""A real preset on an accelerator: train-step MFU per attention kernel, forward, decoding.

    python benchmarks/accelerator.py                      # gemma3-1b, bfloat16, 4 x 2048
    python benchmarks/accelerator.py --kernels=jax --decode_batch_sizes=1,8,64
    python benchmarks/accelerator.py --loss=chunked --batch_size=8 --decode_batch_sizes=
    python benchmarks/accelerator.py --kernels=jax --segment_ids=none,ones   # cuDNN's mask

For each attention kernel (`config.model.attention_kernel`) it times what a user's own
loop does: a `jax.jit` of `jax.value_and_grad` over the cross-entropy (`--loss`: optax's
over `gj.transform(config).apply`'s logits, or `.loss`, which never forms them whole),
optax's clipped AdamW, params and optimizer state donated; and the
forward pass alone; per `--segment_ids`, without them (one document per row: cuDNN
takes a causal layer's mask by its structure alone) or with them given (as packed rows
are: cuDNN reads the mask array). A kernel that fails (e.g. cuDNN refusing a shape) is reported with
its error and the others still run. Weights (and AdamW's state) are `--param_dtype`,
compute in `--dtype`. The first kernel's logits are the reference for the others' (max
difference printed, with the first step's loss; `--noforward` skips them).

Decoding: greedy, cached (`sampler.generate`, one jitted while loop), weights cast to
`--dtype` as a server holds them, `--prompt_len` prompt tokens then `--new_tokens`, at
each of `--decode_batch_sizes`; tokens/s counts the new tokens of all rows.

XLA's options: `--xla_variants` compiles the step once per set of XLA options
(`Lowered.compile`'s `compiler_options`, the flags XLA_FLAGS would set) in the one
process, after XLA's defaults, and times each in turn on the same state; with
`--combine_faster`, the union of the sets that beat the defaults is timed too. One
process for all: one init and one lowering, where a process per flag pays them each time
(a gemma3-1b step at 12 x 2048 needs ~140 s from a cold start on an H100).

Memory: XLA's planned temporaries of the compiled step, and the device's peak bytes in
use once its steps ran (the process's peak so far: it includes the kernels and variants
before it; none on a CPU).

MFU = tokens/s x model FLOPs per token (`gemma_jax.training.flops`: 6 per matmul
parameter, attention over the keys each query may see) / the device's peak: the datasheet's
dense bfloat16 rate where the device is known (H100 and H200: 989 TFLOP/s), and, as a
second column, an 8192 x 8192 matmul timed here.
"""

import itertools
import shlex
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
import gemma_jax as gj
from gemma_jax.inference import decoding, sampler
from gemma_jax.layers import chunked_loss, norms
from gemma_jax.training import flops

_PRESET = flags.DEFINE_string("preset", "gemma3-1b", "Preset name.")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows of the train and forward batches.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype.")
_PARAM_DTYPE = flags.DEFINE_string("param_dtype", "float32", "Parameter (and so AdamW "
                                   "state) dtype: float32, or bfloat16 for a step wholly "
                                   "in bfloat16.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Remat policy.")
_UNROLL = flags.DEFINE_string("scan_unroll", "none", "config.model.scan_unroll: 'none' "
                              "keeps the layer loop rolled (26 layers compile in far less time).")
_KERNELS = flags.DEFINE_list("kernels", ["einsum", "jax"], "Attention kernels.")
_SEGMENTS = flags.DEFINE_list("segment_ids", ["none"], "Per kernel, what the step passes as "
                              "segment_ids: 'none' and/or 'ones' (one document's ids).")
_LOSS = flags.DEFINE_enum("loss", "logits", ["logits", "chunked", "chunked_shifted"],
                          "The train step's loss (`common.user_train_step`).")
LOSS_NAMES = {"logits": "optax cross-entropy over apply", "chunked": "model.loss",
              "chunked_shifted": "model.loss over tokens[:, :-1]"}
_CHUNK = flags.DEFINE_integer("loss_chunk_mib", None, "With --loss=chunked: float32 logits "
                              "per chunk, MiB (`chunked_loss.LOGITS_BYTES`); default the "
                              "library's budget (`chunked_loss.logits_budget`).")
_ONE_PASS = flags.DEFINE_bool("one_pass_log_z", True, "With --loss=chunked: "
                               "`chunked_loss.ONE_PASS_LOG_Z` (off: two reductions).")
_NORM_KERNEL = flags.DEFINE_bool("norm_gradient_kernel", True, "`norms.GRADIENT_KERNEL` "
                                 "(off: XLA's RMSNorm gradient on a GPU too).")
_FORWARD = flags.DEFINE_bool("forward", True, "Also time the forward pass (its own "
                             "compile; the logits compared across kernels).")
_VARIANTS = flags.DEFINE_string(
    "xla_variants", "", "';'-separated sets of XLA options, each timed for the step after "
    "XLA's defaults, e.g. 'xla_gpu_enable_pdl=true; xla_gpu_enable_triton_gemm=false'; a set "
    "is name=value pairs separated by spaces, as in XLA_FLAGS ('--' optional).")
_COMBINE = flags.DEFINE_bool("combine_faster", True, "With --xla_variants: also time the "
                             "union of the sets whose step beat the defaults' by over 0.5%.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed train steps (after one warm-up).")
_DECODE = flags.DEFINE_list("decode_batch_sizes", ["1", "64"], "Decoded prompts per call.")
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Greedy tokens decoded after the prompt.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/accelerator_<backend>.json.")

# Dense bfloat16 FLOP/s by the vendor's datasheet (SXM parts).
DATASHEET_PEAK = {"H100": 989e12, "H200": 989e12}


def datasheet_peak() -> float:
  kind = jax.devices()[0].device_kind
  return next((v for k, v in DATASHEET_PEAK.items() if k in kind), float("nan"))


def model_config(kernel: str):
  config = gj.get_config(_PRESET.value)
  config.model.dtype = _DTYPE.value
  config.model.param_dtype = _PARAM_DTYPE.value
  config.model.remat_policy = _REMAT.value
  config.model.scan_unroll = _UNROLL.value
  config.model.attention_kernel = kernel
  return config


def timed(fn, runs: int) -> float:
  """Median seconds of fn() (blocking) over `runs` calls after one warm-up."""
  fn()
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def xla_options(text: str) -> dict:
  """'name=value name=value' (XLA_FLAGS' syntax) -> {name: bool, int, float or str}."""
  def value(v):
    if v in ("true", "false"):
      return v == "true"
    for kind in (int, float):
      try:
        return kind(v)
      except ValueError:
        pass
    return v
  pairs = [item.lstrip("-").partition("=") for item in shlex.split(text)]
  return {name: value(v) for name, _, v in pairs}


def options_label(options: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in options.items()) or "XLA defaults"


def timed_step(step, state: list, tokens, options: dict) -> dict:
  """Compile the step with XLA `options`, run it on `state` ([params, opt_state], which
  it updates) and time it."""
  start = time.perf_counter()
  compiled = step.lower(state[0], state[1], tokens).compile(options or None)
  compile_s = time.perf_counter() - start
  losses = []

  def run_step():
    state[0], state[1], value = compiled(state[0], state[1], tokens)
    losses.append(value)

  synced_s = timed(lambda: float(run_step() or losses[-1]), _STEPS.value)
  jax.block_until_ready(losses)
  start = time.perf_counter()
  for _ in range(_STEPS.value):
    run_step()
  jax.block_until_ready(losses)
  step_s = (time.perf_counter() - start) / _STEPS.value
  stats = jax.devices()[0].memory_stats() or {}      # None on a CPU
  return {"xla_options": options_label(options), "first_loss": float(losses[0]),
          "compile_s": compile_s, "train_step_s": step_s, "train_step_synced_s": synced_s,
          "planned_temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 30,
          "peak_gib": stats.get("peak_bytes_in_use", float("nan")) / 2 ** 30}


def timed_variants(step, state: list, tokens, reinit) -> list:
  """`timed_step` under XLA's defaults, then each of `--xla_variants` (and, with
  `--combine_faster`, the union of those faster than the defaults by over 0.5%). A set
  that fails is reported with its error, the state made anew by `reinit()` where its
  buffers were donated to a step that failed."""
  variants = [{}] + [xla_options(v) for v in _VARIANTS.value.split(";") if v.strip()]
  results = []

  def run(options):
    try:
      results.append(timed_step(step, state, tokens, options))
    except Exception as e:  # pylint: disable=broad-except
      results.append({"xla_options": options_label(options),
                      "error": f"{type(e).__name__}: {str(e)[:2000]}"})
      if any(x.is_deleted() for x in jax.tree.leaves(state)):
        state[:] = reinit()
    print(f"  {results[-1]}", flush=True)

  for options in variants:
    run(options)
  if _COMBINE.value and len(variants) > 2:
    base = results[0].get("train_step_s", float("inf"))
    faster = [o for o, r in zip(variants[1:], results[1:])
              if r.get("train_step_s", base) < 0.995 * base]
    if len(faster) > 1:
      run({k: v for o in faster for k, v in o.items()})
  return results


def train_and_forward(kernel: str, segments: str, tokens: jax.Array) -> list:
  """The user loop's step (per set of XLA options) and the forward pass of one kernel,
  with segment_ids or not: a result per set."""
  config = model_config(kernel)
  model = gj.transform(config)
  with_ids = {"none": False, "ones": True}[segments]
  make = lambda: common.user_train_step(config, tokens, loss=_LOSS.value,
                                        segment_ids=with_ids)
  step, params, opt_state = make()

  @jax.jit
  def forward(params, tokens):
    return model.apply(params, tokens, segment_ids=jnp.ones_like(tokens) if with_ids else None)

  start = time.perf_counter()
  logits = (np.asarray(forward(params, tokens)[0, :64].astype(jnp.float32))
            if _FORWARD.value else None)
  forward_first_s = time.perf_counter() - start     # its compile, mostly
  state = [params, opt_state]
  results = timed_variants(step, state, tokens, reinit=lambda: list(make()[1:]))
  params = state[0]
  forward_s = (timed(lambda: jax.block_until_ready(forward(params, tokens)), _STEPS.value)
               if _FORWARD.value else float("nan"))
  return [dict(r, kernel=kernel, segment_ids=segments, logits=logits,
               forward_first_call_s=forward_first_s, forward_s=forward_s) for r in results]


def decode(batch_size: int, params) -> dict:
  config = model_config("einsum")
  tokens = np.random.default_rng(1).integers(3, config.model.vocab_size,
                                             (batch_size, _PROMPT.value)).astype(np.int32)
  dec = decoding.make_decoding(config)
  run = lambda: np.asarray(sampler.generate(
      dec, params, jnp.asarray(tokens), jnp.full((batch_size,), _PROMPT.value, jnp.int32),
      jax.random.key(0), jnp.zeros((0,), jnp.int32), max_new_tokens=_NEW.value,
      cache_length=_PROMPT.value + _NEW.value,
      cache_dtype=decoding.default_cache_dtype(config)))
  seconds = timed(run, 3)
  return {"batch_size": batch_size, "seconds": seconds,
          "tokens_per_s": batch_size * _NEW.value / seconds}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  b, t = _BATCH.value, _SEQ.value
  if _CHUNK.value:
    chunked_loss.LOGITS_BYTES = _CHUNK.value << 20
  chunked_loss.ONE_PASS_LOG_Z = _ONE_PASS.value
  norms.GRADIENT_KERNEL = _NORM_KERNEL.value
  m = model_config("einsum").model
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, m.vocab_size, (b, t)), jnp.int32)
  flops_per_token = flops.training_flops_per_token(m, t)
  matmul, matmul_flop = flops.square_matmul(8192 if jax.default_backend() != "cpu" else 1024,
                                            _DTYPE.value)
  measured_peak = matmul_flop / timed(matmul, 10)
  peak = datasheet_peak()
  print(f"{jax.devices()[0].device_kind}: {_PRESET.value}, {flops_per_token / 1e9:.2f} "
        f"GFLOP per trained token; matmul {measured_peak / 1e12:.0f} TFLOP/s", flush=True)

  results, rows, reference, decodes = [], [], None, []

  def save():    # after each measurement, so that a run stopped at a time limit keeps them
    common.write_json(common.output_path(_OUT.value, "accelerator"),
                      {"preset": _PRESET.value, "dtype": _DTYPE.value,
                       "param_dtype": _PARAM_DTYPE.value,
                       "one_pass_log_z": _ONE_PASS.value,
                       "norm_gradient_kernel": _NORM_KERNEL.value, "batch_size": b,
                       "seq_len": t, "loss": _LOSS.value, "loss_chunk_mib": _CHUNK.value,
                       "remat_policy": _REMAT.value, "scan_unroll": _UNROLL.value,
                       "flops_per_token": flops_per_token, "datasheet_peak": peak,
                       "measured_matmul_flops": measured_peak, "train": results,
                       "decode": decodes})

  for kernel, segments in itertools.product(_KERNELS.value, _SEGMENTS.value):
    try:
      kernel_results = train_and_forward(kernel, segments, tokens)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{kernel}, segment_ids {segments}: failed: {type(e).__name__}: {str(e)[:2000]}",
            flush=True)
      results.append({"kernel": kernel, "segment_ids": segments,
                      "error": f"{type(e).__name__}: {str(e)[:2000]}"})
      save()
      continue
    for r in kernel_results:
      logits = r.pop("logits")
      results.append(r)
      if "error" in r:
        continue
      reference = logits if reference is None else reference
      r["max_logit_difference_vs_first"] = (float(np.abs(logits - reference).max())
                                             if _FORWARD.value else float("nan"))
      r["train_tokens_per_s"] = b * t / r["train_step_s"]
      r["train_mfu"] = r["train_tokens_per_s"] * flops_per_token / peak
      r["train_mfu_of_matmul"] = r["train_tokens_per_s"] * flops_per_token / measured_peak
      r["forward_tokens_per_s"] = b * t / r["forward_s"]
      rows.append([kernel, segments, r["xla_options"], r["train_step_s"] * 1e3,
                   r["train_tokens_per_s"], f"{r['train_mfu']:.1%}",
                   f"{r['train_mfu_of_matmul']:.1%}", r["forward_tokens_per_s"],
                   r["compile_s"], r["first_loss"], r["max_logit_difference_vs_first"],
                   r["planned_temp_gib"], r["peak_gib"]])
      print(rows[-1], flush=True)
    save()

  config = model_config("einsum")
  params = gj.transform(config).init(jax.random.key(0), tokens[:1, :8])
  params = jax.tree.map(lambda p: p.astype(_DTYPE.value), params)
  for size in _DECODE.value:
    decodes.append(decode(int(size), params))
    save()

  device = jax.devices()[0].device_kind
  common.print_table(
      f"{device}, {_PRESET.value} in {_DTYPE.value}, train and forward {b} x {t} tokens "
      f"(user loop: {LOSS_NAMES[_LOSS.value]}, optax AdamW, jax.jit), remat {_REMAT.value}",
      ["attention kernel", "segment_ids", "XLA options", "step ms", "train tok/s", "MFU (datasheet)", "MFU (matmul)",
       "forward tok/s", "compile s", "first loss", "max logit diff", "planned temp GiB",
       "device peak GiB"], rows)
  common.print_table(
      f"{device}, {_PRESET.value} greedy decoding, {_PROMPT.value} prompt + {_NEW.value} new "
      f"tokens, weights in {_DTYPE.value}",
      ["batch", "seconds", "new tokens/s"],
      [[d["batch_size"], d["seconds"], d["tokens_per_s"]] for d in decodes])


if __name__ == "__main__":
  app.run(main)
