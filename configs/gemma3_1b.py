"""gemma3-1b from scratch, for an accelerator: bfloat16 compute over float32 weights.

Byte-level by default so it runs anywhere; with Gemma's tokenizer pass
--config.data.tokenizer=/path/to/tokenizer.model (262144 ids, the model's vocabulary).
"""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma3-1b")
  config.model.dtype = "bfloat16"
  config.model.remat_policy = "save_dot_except_mlp"
  config.data.seq_len = 1024
  config.train.steps = 20_000
  config.train.batch_size = 64
  config.optimizer.grad_accum_steps = 8   # micro-batches of 8 x 1024 tokens (model.loss
                                          # holds 2 GiB of logits at a time, not the batch's)
  config.train.log_every = 100
  config.train.eval_every = 1000
  config.train.eval_batches = 16
  config.train.z_loss = 1e-4
  config.optimizer.learning_rate = 3e-4
  config.optimizer.warmup_steps = 1000
  config.checkpoint.save_every = 1000
  return config
