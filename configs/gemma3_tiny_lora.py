"""LoRA fine-tuning of a trained tiny model on the chat file shipped in configs/data:
about a minute on two CPU cores. The model comes from the checkpoint:

    python experiments/train.py --config=configs/gemma3_tiny_lora.py --workdir=runs/lora \
        --config.train.init_from=runs/tiny_hf
"""

import os

import gemma_jax as gj


def get_config():
  config = gj.get_config("gemma3-tiny")      # replaced by train.init_from's model
  config.data.path = os.path.join(os.path.dirname(__file__), "data", "chat_small.jsonl")
  config.data.format = "chat"
  config.data.seq_len = 256
  config.data.eval_fraction = 0.05
  config.lora.rank = 8
  config.lora.alpha = 16.0
  config.train.steps = 150
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 50
  config.train.eval_batches = 4
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 10
  config.optimizer.weight_decay = 0.0
  config.checkpoint.save_every = 150
  config.sample.max_new_tokens = 0           # chat with it: experiments/chat.py
  return config
