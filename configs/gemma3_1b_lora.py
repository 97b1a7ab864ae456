"""LoRA fine-tuning of a published Gemma 3 1B on chat data, for an accelerator.

    python experiments/train.py --config=configs/gemma3_1b_lora.py --workdir=runs/g1b_lora \
        --config.train.init_from=path/to/gemma-3-1b-it --config.data.path='my_chats/*.jsonl'

The model and tokenizer come from the checkpoint directory (a transformers
save_pretrained download); only the adapters and their optimizer state are trained and
saved (plan it: experiments/plan.py --config=configs/gemma3_1b_lora.py).
"""

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma3-1b")        # replaced by train.init_from's model
  config.model.dtype = "bfloat16"
  config.model.remat_policy = "save_dot_except_mlp"
  config.data.format = "chat"
  config.data.seq_len = 1024
  config.lora.rank = 16
  config.lora.alpha = 32.0
  config.lora.dropout = 0.05
  config.train.steps = 1000
  config.train.batch_size = 16
  config.optimizer.grad_accum_steps = 4   # micro-batches of 4 x 1024 tokens
  config.train.log_every = 20
  config.train.eval_every = 200
  config.train.eval_batches = 4
  config.optimizer.learning_rate = 2e-4
  config.optimizer.warmup_steps = 50
  config.optimizer.weight_decay = 0.0
  config.checkpoint.save_every = 200
  config.sample.max_new_tokens = 0           # chat with it: experiments/chat.py
  return config
