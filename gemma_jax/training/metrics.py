"""What a run reports: its records (`train_record`), log lines and progress bar,
metrics.jsonl, TensorBoard events, the loss plot, and the unigram entropy that the eval
loss is measured against."""

import collections
import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

from absl import logging
import jax
import matplotlib
import numpy as np
import tensorboardX
import tqdm

from gemma_jax.training import workdir as workdir_lib

matplotlib.use("Agg")
from matplotlib import pyplot  # pylint: disable=wrong-import-position

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsWriter:
  """Appends one JSON object per record to workdir/metrics.jsonl and writes the same
  scalars as TensorBoard events under workdir/tensorboard.

  A run that starts at `step` (its restored checkpoint's; 0 for a new run) logs every
  later step again, so the records an interrupted run wrote past it are dropped from
  metrics.jsonl (rewritten atomically) and purged from TensorBoard's view: each step
  appears once, as the run that kept it logged it.

  A record is one write of a whole line: one that the OS cuts short (a full disk, a
  file size limit) is cut off the file again and raised as that OSError, so the file
  holds whole records only; the torn last line a killed run may leave is dropped with a
  warning."""

  def __init__(self, workdir: str, step: int = 0):
    self._path = os.path.join(workdir, METRICS_FILE)
    self.dropped = _drop_records_after(self._path, step)
    self._jsonl = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    self._events = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"),
                                              purge_step=step + 1 if step else None)

  def write(self, step: int, scalars: Dict[str, float]) -> None:
    record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    line = (json.dumps(record) + "\n").encode()
    end = os.lseek(self._jsonl, 0, os.SEEK_END)
    try:
      while line:   # a second write only after a short one: it raises what cut that
        line = line[os.write(self._jsonl, line):]
    except OSError as error:
      os.ftruncate(self._jsonl, end)
      raise OSError(error.errno, error.strerror, self._path) from None
    for name, value in scalars.items():
      self._events.add_scalar(name, float(value), int(step))
    self._events.flush()

  def close(self) -> None:
    os.close(self._jsonl)
    self._events.close()


def final_report(eval_loss: float, entropy: float) -> str:
  """The eval loss against the eval split's unigram entropy (both nats/token)."""
  line = f"final eval loss {eval_loss:.4f} nats/token vs eval unigram entropy {entropy:.4f}"
  if not entropy:
    return line
  gap = 1 - eval_loss / entropy
  return f"{line} ({abs(gap):.1%} {'below' if gap >= 0 else 'above'})"


def train_record(fetched: List[dict], seconds: float, tokens: int, flops_per_token: float,
                  peak_flops: Optional[float]) -> Dict[str, float]:
  """The means of the steps' metrics (the last learning rate), tokens/s and, with a peak,
  MFU."""
  record = {k: float(np.mean([f[k] for f in fetched])) for k in fetched[-1]}
  record["learning_rate"] = float(fetched[-1]["learning_rate"])
  record["tokens_per_s"] = tokens / seconds
  if peak_flops:
    record["mfu"] = (record["tokens_per_s"] * flops_per_token
                     / (peak_flops * jax.device_count()))
  return record


class Progress:
  """The progress bar, counting steps as the device finishes them rather than as they
  are dispatched (dispatch runs ahead: its rate read 74 steps/s at a real 2.5)."""

  def __init__(self, bar: tqdm.tqdm):
    self.bar, self._running = bar, collections.deque()

  def dispatched(self, step_metrics: dict) -> None:
    self._running.append(step_metrics["loss"])
    while self._running and self._running[0].is_ready():
      self._running.popleft()
      self.bar.update()

  def all_finished(self) -> None:
    """The steps dispatched so far are done (their metrics were fetched)."""
    self.bar.update(len(self._running))
    self._running.clear()


def log_line(step: int, total: int, record: Dict[str, float]) -> str:
  names = (("loss", "loss", ".4f"), ("eval_loss", "eval_loss", ".4f"),
           ("learning_rate", "lr", ".2e"), ("grad_norm", "grad_norm", ".3f"),
           ("tokens_per_s", "tokens/s", ".0f"), ("mfu", "mfu", ".2%"))
  fields = [f"{label} {record[key]:{fmt}}" for key, label, fmt in names if key in record]
  return f"step {step}/{total} | " + " | ".join(fields)


def read_records(workdir: str) -> List[dict]:
  """The records of workdir/metrics.jsonl, in the order written (a torn last line, one
  being written, left out)."""
  return [record for _, record in _parse(os.path.join(workdir, METRICS_FILE))[0]]


def _parse(path: str) -> Tuple[List[Tuple[str, dict]], str]:
  """([(line, record), ...], torn) of the metrics file `path`: its whole records, and
  the text after its last one that is not a record (a write cut short; usually "").

  Raises:
    WorkdirError: a line before the last is not a record (the file was edited or
      damaged otherwise than by a torn write).
  """
  with open(path, "rb") as f:
    lines = f.read().split(b"\n")
  parsed = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
        raise ValueError("not an object with an int step")
    except ValueError as error:
      if number == len(lines):   # after the last newline: a write cut short
        return parsed, line.decode("utf-8", "replace")
      raise workdir_lib.WorkdirError(
          f"{path}, line {number}: not a metrics record ({error}): remove or mend the "
          "line") from None
    parsed.append((line.decode() + "\n", record))
  return parsed, ""


def _drop_records_after(path: str, step: int) -> int:
  """Rewrites the metrics file `path` without its records of steps after `step` (all of
  them when `step` is 0) and without a torn last line (with a warning); -> how many
  records it dropped."""
  if not os.path.exists(path):
    return 0
  if not step:   # a new run: every line goes, whatever it holds
    with open(path, "rb") as f:
      dropped = sum(1 for line in f if line.strip())
    if dropped:
      workdir_lib.write_atomically(path, "")
    return dropped
  records, torn = _parse(path)
  if torn:
    logging.warning("%s ends in a torn record, a write cut short when its run stopped: "
                    "dropped %r", path, torn[:80])
  kept = "".join(line for line, record in records if record["step"] <= step)
  if len(kept) != os.path.getsize(path):   # also a last record short of its newline
    workdir_lib.write_atomically(path, kept)
  return sum(record["step"] > step for _, record in records)


def unigram_entropy(batches: Iterable[dict]) -> float:
  """Entropy in nats of the weighted target tokens' frequencies: the loss of the best
  model that ignores context."""
  counts = collections.Counter()
  for batch in batches:
    mask = batch["weights"] > 0
    ids, n = np.unique(batch["targets"][mask], return_counts=True)
    counts.update(dict(zip(ids.tolist(), n.tolist())))
  p = np.array(list(counts.values()), np.float64)
  p /= p.sum()
  return float(-np.sum(p * np.log(p)))


def plot_losses(records: List[dict], path: str, reference: Optional[float] = None) -> None:
  """Train and eval loss against step (the last record of each step wins), with an
  optional horizontal reference line (the unigram entropy)."""
  latest = {}
  for record in records:
    latest.setdefault(record["step"], {}).update(record)
  steps = sorted(latest)
  figure, axes = pyplot.subplots(figsize=(7, 4))
  for key, style in (("loss", "-"), ("eval_loss", "o-")):
    points = [(s, latest[s][key]) for s in steps if key in latest[s]]
    if points:
      axes.plot(*zip(*points), style, label=key, markersize=3)
  if reference is not None:
    axes.axhline(reference, color="gray", linestyle="--", label="eval unigram entropy")
  axes.set_xlabel("step")
  axes.set_ylabel("loss (nats per token)")
  axes.legend()
  axes.grid(alpha=0.3)
  figure.tight_layout()
  # Through a staging file: an interrupted run leaves the old plot or the new, whole.
  staging = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
  try:
    figure.savefig(staging, format=os.path.splitext(path)[1][1:] or "png", dpi=100)
    os.replace(staging, path)
  finally:
    pyplot.close(figure)
    if os.path.exists(staging):
      os.remove(staging)
