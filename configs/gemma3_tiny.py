"""A CPU-sized preset, byte-level, on the Python standard library's source: about three
minutes on two CPU cores. gemma3-tiny by default; any *-tiny preset by name:

    --config=configs/gemma3_tiny.py:gemma4-moe-tiny    8 experts, top 2, beside a shared
        MLP, with the load-balancing and router z-losses (metrics.jsonl logs
        aux/load_balance_loss, aux/router_z_loss and each expert's aux/expert_load/<e>)
    --config=configs/gemma3_tiny.py:gemma4-e2b-tiny    per-layer inputs, 5 shared key/value
        layers with double-wide MLPs: Gemma 4 E2B's mechanisms at CPU size
"""

import gemma_jax as gj

# Presets trained at fewer layers than they define (the shared-layer model keeps its 10:
# its scanned periods depend on them).
LAYERS = {"gemma3-tiny": 6, "gemma4-moe-tiny": 6}


def get_config(preset: str = "gemma3-tiny"):
  config = gj.get_config(preset)
  config.model.num_layers = LAYERS.get(preset, config.model.num_layers)
  if config.model.num_experts:
    config.model.load_balance_loss_weight = 0.01
    config.model.router_z_loss_weight = 1e-3
  config.data.seq_len = 128
  config.train.steps = 500
  config.train.batch_size = 16
  config.train.log_every = 25
  config.train.eval_every = 100
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 20
  config.checkpoint.save_every = 250
  return config
