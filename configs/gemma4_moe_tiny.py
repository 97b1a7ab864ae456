"""gemma4-moe-tiny (8 experts, top 2, beside a shared MLP), byte-level, on the Python
standard library's source, with the load-balancing loss; metrics.jsonl logs
aux/load_balance_loss, aux/router_z_loss and each expert's share aux/expert_load/<e>."""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma4-moe-tiny")
  config.model.num_layers = 6
  config.model.load_balance_loss_weight = 0.01
  config.model.router_z_loss_weight = 1e-3
  config.data.seq_len = 128
  config.train.steps = 500
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 100
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 10
  # Gemma 4's multiplicative scales (norms, router, per-expert, per-layer) start at 1:
  # weight decay would pull them towards 0.
  config.optimizer.no_decay = ("norm", "scale", "scalar")
  config.checkpoint.save_every = 250
  return config
