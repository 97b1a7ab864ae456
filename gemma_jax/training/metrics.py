"""What a run reports: metrics.jsonl, TensorBoard events, the loss plot, and the
unigram entropy that the eval loss is measured against."""

import collections
import json
import os
from typing import Dict, Iterable, List, Optional

import matplotlib
import numpy as np
import tensorboardX

from gemma_jax import workdir as workdir_lib

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
  appears once, as the run that kept it logged it."""

  def __init__(self, workdir: str, step: int = 0):
    path = os.path.join(workdir, METRICS_FILE)
    self.dropped = _drop_records_after(path, step)
    self._jsonl = open(path, "a", encoding="utf-8")
    self._events = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"),
                                              purge_step=step + 1 if step else None)

  def write(self, step: int, scalars: Dict[str, float]) -> None:
    record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for name, value in scalars.items():
      self._events.add_scalar(name, float(value), int(step))
    self._events.flush()

  def close(self) -> None:
    self._jsonl.close()
    self._events.close()


def read_records(workdir: str) -> List[dict]:
  """The records of workdir/metrics.jsonl, in the order written."""
  with open(os.path.join(workdir, METRICS_FILE), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _drop_records_after(path: str, step: int) -> int:
  """Rewrites the metrics file `path` without its records of steps after `step` (all of
  them when `step` is 0); -> how many it dropped."""
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  kept = [line for line in lines if step and json.loads(line)["step"] <= step]
  if len(kept) < len(lines):
    workdir_lib.write_atomically(path, "".join(kept))
  return len(lines) - len(kept)


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
  figure.savefig(path, dpi=100)
  pyplot.close(figure)
