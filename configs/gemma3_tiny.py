"""gemma3-tiny, byte-level, on the Python standard library's source: about five
minutes on two CPU cores."""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma3-tiny")
  config.model.num_layers = 6
  config.data.seq_len = 128
  config.train.steps = 500
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 100
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  config.checkpoint.save_every = 250
  return config
