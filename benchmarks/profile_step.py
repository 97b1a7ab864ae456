r"""Where a user loop's train step spends its device time, by kernel, with HLO op names.

    python benchmarks/profile_step.py --preset=gemma3-1b --dtype=bfloat16   # on a GPU
    python benchmarks/profile_step.py --preset=gemma3-tiny --batch_size=2 --seq_len=256
    python benchmarks/profile_step.py --preset=gemma3-long --batch_size=1 --seq_len=8192 \
      --dtype=float32 --forward                                             # apply alone

Times the step of `benchmarks/accelerator.py` (apply, or `--loss=chunked` model.loss, then
optax AdamW under `jax.jit`, state donated), then traces two steps with `jax.profiler`
and sums the device's events by kernel name: on a GPU the kernels of the device streams (XLA's fusions are named after
their HLO instructions; cuBLAS and cuDNN kernels keep their library names), on a CPU
XLA's thunks. Each kernel is joined with its HLO instruction's shape and `op_name`
(which layer and operation it comes from). Events carry the CUDA-graph command buffer
they ran in as `hlo_op`, so a sum by `hlo_op` only splits the step into those graphs:
this script keys by kernel name instead. It also reports where the device sat idle
between kernels (`idle_gaps`: the step's time less its kernels'). On a CPU thunks run
concurrently, so their sum exceeds the step's time and each one's duration is inflated:
read it as a ranking only.
"""

import collections
import glob
import gzip
import json
import re
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import common
import gemma_jax as gj

_PRESET = flags.DEFINE_string("preset", "gemma3-1b", "Preset name, or a shape of "
                               "common.SHAPES (e.g. gemma4-moe-16x4).")
_BATCH = flags.DEFINE_integer("batch_size", 4, "Rows.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype.")
_PARAM_DTYPE = flags.DEFINE_string("param_dtype", "float32", "Parameter dtype.")
_KERNEL = flags.DEFINE_string("attention_kernel", "einsum", "Attention kernel.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Remat policy.")
_UNROLL = flags.DEFINE_string("scan_unroll", "none", "config.model.scan_unroll.")
_LOSS = flags.DEFINE_enum("loss", "logits", ["logits", "chunked", "chunked_shifted"],
                          "The step's loss (`common.user_train_step`).")
_SEGMENT_IDS = flags.DEFINE_bool("segment_ids", False, "Pass one document's segment_ids "
                                 "(as packed rows do) instead of none.")
_FORWARD = flags.DEFINE_bool("forward", False, "Profile the forward pass (`apply`'s "
                             "logits under `jax.jit`) instead of the train step.")
_TOP = flags.DEFINE_integer("top", 60, "Kernels listed.")
_HLO = flags.DEFINE_string("hlo_out", None, "Also write the compiled step's HLO text here "
                           "(gzipped), to attribute kernels offline.")
_OUT = flags.DEFINE_string("out", None, "JSON output; default "
                           "benchmarks/results/profile_step_<backend>.json.")

LIBRARY_KERNELS = ("gemm", "cublas", "cutlass", "nvjet", "xmma", "cudnn", "flash")


def hlo_instructions(text: str) -> dict:
  """{instruction name: (shape, opcode, op_name)} of compiled HLO text (a multi-output
  fusion's shape is a tuple)."""
  out = {}
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\([^()]*\)|\S+) ([\w\-]+)\(", line)
    if m:
      op_name = re.search(r'op_name="([^"]*)"', line)
      out[m.group(1)] = (m.group(2), m.group(3), op_name.group(1) if op_name else "")
  return out


def device_events(trace_dir: str, instructions: dict) -> list:
  """The traced device events: a GPU's streams, or a CPU's XLA thunks."""
  path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  on_cpu = jax.default_backend() == "cpu"
  return [e for e in events if e.get("ph") == "X" and "dur" in e and (
      "GPU" in processes.get(e["pid"], "") or (on_cpu and e["name"] in instructions))]


def instruction_of(kernel: str, instructions: dict):
  """A kernel's HLO instruction: its own name, or with its last "_N" read as ".N"."""
  for name in (kernel, re.sub(r"_(\d+)$", r".\1", kernel)):
    if name in instructions:
      return instructions[name]
  return ("", "", "")


def idle_gaps(events: list, top: int) -> dict:
  """Where the device waited between its kernels, over the traced span: total idle
  microseconds, those in gaps under 20 us (launch latency between back-to-back
  kernels), the number of gaps, and the `top` longest as (us, kernel before, kernel
  after): a host sync (a while loop's condition, a conditional's predicate, the step's
  own dispatch) shows as a long gap."""
  spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events)
  gaps, end, last = [], spans[0][1], spans[0][2]
  for start, stop, name in spans[1:]:
    if start > end:
      gaps.append((start - end, last, name))
    if stop > end:
      end, last = stop, name
  return {"idle_us": sum(g[0] for g in gaps),
          "idle_us_in_short_gaps": sum(g[0] for g in gaps if g[0] < 20),
          "gaps": len(gaps), "longest": sorted(gaps, reverse=True)[:top]}


# The step's parts, by the first of these words its op_name holds.
PARTS = ("mlp", "attn", "embed", "norm", "cross_entropy", "softmax", "adam", "clip")


def part_of(op_name: str) -> str:
  """'forward/<part>' or 'backward/<part>' ('other' where no word of PARTS is in it);
  'unattributed' for a kernel with no HLO instruction of its name (a GPU's cuBLAS and
  cuDNN kernels)."""
  if not op_name:
    return "unattributed"
  part = next((p for p in PARTS if p in op_name), "other")
  return ("backward/" if "transpose(" in op_name else "forward/") + part


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = common.shape_config(_PRESET.value)
  config.model.update(dtype=_DTYPE.value, param_dtype=_PARAM_DTYPE.value,
                      remat_policy=_REMAT.value, scan_unroll=_UNROLL.value,
                      attention_kernel=_KERNEL.value)
  b, t = _BATCH.value, _SEQ.value
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.model.vocab_size, (b, t)),
                       jnp.int32)
  step, params, opt_state = common.user_train_step(config, tokens, loss=_LOSS.value,
                                                   segment_ids=_SEGMENT_IDS.value)
  if _FORWARD.value:
    ids = jnp.ones_like(tokens) if _SEGMENT_IDS.value else None
    forward = jax.jit(lambda p, x: gj.transform(config).apply(p, x, segment_ids=ids))
    compiled = forward.lower(params, tokens).compile()
  else:
    compiled = step.lower(params, opt_state, tokens).compile()
  text = compiled.as_text()
  if _HLO.value:
    with gzip.open(_HLO.value, "wt") as f:
      f.write(text)
  state = [params, opt_state]

  def run():
    if _FORWARD.value:
      return compiled(state[0], tokens).block_until_ready()
    state[0], state[1], value = compiled(state[0], state[1], tokens)
    return float(value)

  for _ in range(3):
    run()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  step_ms = float(np.median(times)) * 1e3
  instructions = hlo_instructions(text)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(2):
        run()
    events = device_events(trace_dir, instructions)

  per_step = collections.Counter()
  calls = collections.Counter()
  for e in events:
    per_step[e["name"]] += e["dur"] / 1e3 / 2
    calls[e["name"]] += 1
  busy = sum(per_step.values())
  idle = idle_gaps(events, top=12)
  library = sum(v for k, v in per_step.items() if any(w in k.lower() for w in LIBRARY_KERNELS))
  parts = collections.Counter()
  for name, ms in per_step.items():
    parts[part_of(instruction_of(name, instructions)[2])] += ms
  kernels = []
  for name, ms in per_step.most_common(_TOP.value):
    shape, opcode, op_name = instruction_of(name, instructions)
    op_name = re.sub(r".*closed_call/", "", re.sub(r"jit\([^)]*\)/", "", op_name))
    kernels.append({"kernel": name, "ms_per_step": ms, "calls_per_step": calls[name] // 2,
                    "shape": shape, "opcode": opcode, "op_name": op_name})
  common.print_table(
      f"{jax.devices()[0].device_kind}: {_PRESET.value} {_DTYPE.value} {b} x {t}, step "
      f"{step_ms:.1f} ms, device busy {busy:.1f} ms/step (cuBLAS/cuDNN kernels "
      f"{library:.1f})", ["ms/step", "calls", "kernel", "shape", "op_name (tail)"],
      [[k["ms_per_step"], k["calls_per_step"], k["kernel"][:40], k["shape"][:30],
        k["op_name"][-90:]] for k in kernels])
  common.print_table("device time by part of the step (op_name)", ["part", "ms/step"],
                     [[p, ms] for p, ms in parts.most_common()])
  common.print_table(
      f"device idle over the 2 traced steps: {idle['idle_us'] / 1e3:.1f} ms in "
      f"{idle['gaps']} gaps ({idle['idle_us_in_short_gaps'] / 1e3:.1f} ms in gaps under "
      f"20 us); the longest", ["us", "after", "before"],
      [[us, before[:60], after[:60]] for us, before, after in idle["longest"]])
  common.write_json(common.output_path(_OUT.value, "profile_step"),
                    {"preset": _PRESET.value, "dtype": _DTYPE.value,
                     "param_dtype": _PARAM_DTYPE.value, "batch_size": b,
                     "seq_len": t, "attention_kernel": _KERNEL.value,
                     "remat_policy": _REMAT.value, "scan_unroll": _UNROLL.value,
                     "loss": _LOSS.value, "segment_ids": _SEGMENT_IDS.value,
                     "program": "forward" if _FORWARD.value else "train step",
                     "step_ms": step_ms, "device_busy_ms": busy,
                     "library_kernel_ms": library, "parts": dict(parts), "idle": idle,
                     "kernels": kernels})


if __name__ == "__main__":
  app.run(main)
