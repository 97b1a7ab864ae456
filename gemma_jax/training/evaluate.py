"""A model's loss and perplexity on data, per predicted token: what eval.py reports.

The loss is the training loop's evaluation (`steps.make_eval_step`) summed over every
batch: cross-entropy in nats per weighted target token (for chat data, the model's
turns only), and perplexity exp(loss).
"""

import math
from typing import Dict

import jax
from ml_collections import config_dict
import tqdm

from gemma_jax import transformer
from gemma_jax.training import data, steps


def evaluate(config: config_dict.ConfigDict, params, rows: data.Rows, batch_size: int,
             progress: bool = True) -> Dict[str, float]:
  """{"loss", "perplexity", "tokens" (weighted targets), "rows", "batches"} of the model
  on every row of `rows`, in as few batches of at most `batch_size` rows as hold them,
  all of one size (one compilation), so that the last is padded by fewer rows than there
  are batches (a --batch_size of 64 over 3 rows runs 3 rows, not 64)."""
  if len(rows) == 0:
    raise data.DataError("data.path", "holds no row to evaluate")
  eval_step = jax.jit(steps.make_eval_step(steps.model_forward(transformer.transform(config))))
  num_batches = math.ceil(len(rows) / batch_size)
  per_process = math.ceil(len(rows) / num_batches / jax.process_count())
  batches = data.eval_batches(rows, per_process * jax.process_count(), num_batches)
  cross_entropy = weight = 0.0
  for batch in tqdm.tqdm(batches, desc="eval", unit="batch", disable=not progress,
                         dynamic_ncols=True):
    sums = jax.device_get(eval_step(params, batch))
    cross_entropy += float(sums.cross_entropy)
    weight += float(sums.weight)
  if not weight:
    raise data.DataError("data.path", "holds no token to predict (for chat data: no model "
                         "turn)")
  loss = cross_entropy / weight
  return {"loss": loss, "perplexity": math.exp(loss), "tokens": weight, "rows": len(rows),
          "batches": len(batches)}
