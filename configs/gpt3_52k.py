"""gpt3-52k (one layer, d 16: a smoke model), byte-level, on the Python standard
library's source; each layer's activation mean, std and fraction of zeros are logged
to metrics.jsonl as aux/activation_mean/layer_<i>, ..."""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gpt3-52k")
  config.model.record_internal_nn_metrics = True
  config.data.seq_len = 128
  config.train.steps = 1000
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 250
  config.optimizer.learning_rate = 1e-2
  config.optimizer.warmup_steps = 20
  # LayerNorm scales and biases, and every projection's bias, are not decayed.
  config.optimizer.no_decay = ("norm", "bias")
  config.checkpoint.save_every = 500
  return config
