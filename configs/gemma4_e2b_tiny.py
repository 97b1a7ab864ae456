"""gemma4-e2b-tiny (per-layer inputs, 5 shared key/value layers with double-wide MLPs:
Gemma 4 E2B's mechanisms at CPU size), byte-level, on the Python standard library's
source."""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma4-e2b-tiny")
  config.data.seq_len = 128
  config.train.steps = 500
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 100
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  # Gemma 4's multiplicative scales (norms, per-layer scalars) start at 1: weight decay
  # would pull them towards 0.
  config.optimizer.no_decay = ("norm", "scale", "scalar")
  config.checkpoint.save_every = 250
  return config
