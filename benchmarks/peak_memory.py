r"""Peak host memory of one train step and one forward pass: ours against transformers'.

    python benchmarks/peak_memory.py --shapes=gemma3-long --batch_size=1 --seq_len=8192 \
        --library_path

Shapes and flags are `side_by_side.py`'s; so are the two sides (ours: the training stack,
or with `--library_path` a user's jitted `value_and_grad` + optax loop; theirs:
transformers' eager PyTorch, on the weights we wrote). Each side runs in a process of
its own (this script again, with `--side`), with GEMMA_JAX_KEEP_FREED_MEMORY=0 so that
freed memory goes back to the system. There, after two warm-up calls of each
measurement, it returns the freed memory (`malloc_trim`), resets the kernel's
high-water mark of resident memory (/proc/self/clear_refs), reads the resident memory,
makes one call and reads the high-water mark: the difference is what that call needed
above the model, its optimizer state and the process. Ours also reports what XLA planned
for the same call (`memory_analysis`: temporaries plus outputs not written into donated
inputs), a check on the measured figure.

Linux only (glibc, /proc).
"""

import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
import jax
import numpy as np

import common
import gemma_jax as gj
import side_by_side as sbs

_SIDE = flags.DEFINE_enum("side", None, ["ours", "theirs"],
                          "Measure this side in this process (what the script runs itself "
                          "with); unset: both sides, each in a child process.")
_RESULT = "peak_memory_result:"
FLAGS = flags.FLAGS


def _status_bytes(field: str) -> int:
  """A field of /proc/self/status (reported in kB) in bytes."""
  status = open("/proc/self/status").read()
  return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) * 1024


def peak_growth(fn) -> dict:
  """Resident bytes before one fn() (which must block until its work is done), and by
  how much the resident memory's high-water mark rose above them during it."""
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # resets VmHWM to the current resident size
  before = _status_bytes("VmRSS")
  fn()
  return {"resident_before_bytes": before, "peak_growth_bytes": _status_bytes("VmHWM") - before}


def xla_planned_bytes(compiled) -> int:
  """Temporaries plus outputs of a compiled computation, as XLA planned them, less the
  outputs written into donated inputs."""
  analysis = compiled.memory_analysis()
  return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes)


def measure_side(name: str, side: str) -> dict:
  """This process's measurements of one side of one shape."""
  config = sbs.model_config(name)
  tokens = sbs.random_tokens(config.model.vocab_size, (FLAGS.batch_size, FLAGS.seq_len),
                             seed=0)
  prompts = sbs.random_tokens(config.model.vocab_size, (1, 1), seed=1)
  ours = (sbs.UserLoop if FLAGS.library_path else sbs.Ours)(config, tokens, prompts)
  result = {}
  if side == "ours":
    calls = ours
    step = ours.lowered_train_step()
    forward = jax.jit(lambda p, x: ours.model.apply(p, x)).lower(ours.params, ours.tokens)
    result = {"train_step_xla_planned_bytes": xla_planned_bytes(step.compile()),
              "forward_xla_planned_bytes": xla_planned_bytes(forward.compile())}
  else:
    with tempfile.TemporaryDirectory() as path:
      gj.hf.save(path, config, ours.params)
      calls = sbs.Theirs(path, config, tokens, prompts)
    del ours
  for measurement in ("train_step", "forward"):
    fn = getattr(calls, measurement)
    fn()
    fn()
    for key, value in peak_growth(fn).items():
      result[f"{measurement}_{key}"] = value
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SIDE.value:
    for name in FLAGS.shapes:
      print(_RESULT, json.dumps({name: measure_side(name, _SIDE.value)}), flush=True)
    return

  env = dict(os.environ, GEMMA_JAX_KEEP_FREED_MEMORY="0")
  measured = {}
  for side in ("ours", "theirs"):
    args = [a for a in sys.argv[1:] if not a.startswith(("--side", "--out"))]
    run = subprocess.run([sys.executable, os.path.abspath(__file__), f"--side={side}", *args],
                         env=env, capture_output=True, text=True, check=False)
    if run.returncode:
      sys.exit(f"the {side} process failed:\n{run.stderr[-4000:]}")
    for line in run.stdout.splitlines():
      if line.startswith(_RESULT):
        for name, values in json.loads(line[len(_RESULT):]).items():
          measured.setdefault(name, {})[side] = values

  gib = lambda v: v / 2**30
  rows, results = [], []
  for name in FLAGS.shapes:
    sides = measured[name]
    results.append({"shape": name, "batch_size": FLAGS.batch_size,
                    "seq_len": FLAGS.seq_len, **sides})
    for side, x in sides.items():
      rows.append([name, side, gib(x["train_step_resident_before_bytes"]),
                   gib(x["train_step_peak_growth_bytes"]),
                   gib(x.get("train_step_xla_planned_bytes", np.nan)),
                   gib(x["forward_peak_growth_bytes"]),
                   gib(x.get("forward_xla_planned_bytes", np.nan))])
  common.print_table(
      f"peak host memory, batch {FLAGS.batch_size} x {FLAGS.seq_len}, "
      f"{'library path' if FLAGS.library_path else 'training stack'}",
      ["shape", "who", "resident before GiB", "train step peak growth GiB",
       "XLA planned GiB", "forward peak growth GiB", "XLA planned GiB"], rows)
  common.write_json(common.output_path(FLAGS.out, "peak_memory"),
                    {"library_path": FLAGS.library_path, "dtype": FLAGS.dtype,
                     "results": results})


if __name__ == "__main__":
  app.run(main)
