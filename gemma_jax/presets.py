"""Named model shapes. `get_config(name)` gives a locked full config with that model."""

from ml_collections import config_dict

from gemma_jax import config as config_lib

_GEMMA3 = dict(block_type="gemma3", vocab_size=262144, num_kv_heads=1, head_dim=256,
               attention_pattern=("local",) * 5 + ("global",), rope_local_base=10_000.0,
               rope_global_base=1_000_000.0)

PRESETS = {
    "gemma3-270m": dict(_GEMMA3, num_layers=18, d_model=640, num_heads=4, mlp_dim=2048,
                        sliding_window=512, query_pre_attn_scalar=256.0),
    "gemma3-1b": dict(_GEMMA3, num_layers=26, d_model=1152, num_heads=4, mlp_dim=6912,
                      sliding_window=512, query_pre_attn_scalar=256.0),
    "gemma3-4b": dict(_GEMMA3, num_layers=34, d_model=2560, num_heads=8, num_kv_heads=4,
                      mlp_dim=10240, sliding_window=1024, query_pre_attn_scalar=256.0,
                      rope_global_scale=8.0),
    "gemma3-12b": dict(_GEMMA3, num_layers=48, d_model=3840, num_heads=16, num_kv_heads=8,
                       mlp_dim=15360, sliding_window=1024, query_pre_attn_scalar=256.0,
                       rope_global_scale=8.0),
    "gemma3-27b": dict(_GEMMA3, num_layers=62, d_model=5376, num_heads=32, num_kv_heads=16,
                       head_dim=128, mlp_dim=21504, sliding_window=1024,
                       query_pre_attn_scalar=5376 / 32, rope_global_scale=8.0),
    # Small enough to train on two CPU cores: 8 layers = one scanned block + 2 more.
    "gemma3-tiny": dict(_GEMMA3, vocab_size=512, num_layers=8, d_model=128, num_heads=4,
                        num_kv_heads=2, head_dim=32, mlp_dim=512, sliding_window=64),
}


def get_config(name: str) -> config_dict.ConfigDict:
  """The default experiment config with the named preset's model."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  config = config_lib.default_config()
  config.model.update(PRESETS[name])
  config.model.name = name
  return config
