"""Named model shapes. `get_config(name)` gives a locked full config with that model
(and the family's training defaults: Gemma 4 keeps its scales out of weight decay)."""

from ml_collections import config_dict

from gemma_jax import config as config_lib

_GEMMA3 = dict(block_type="gemma3", vocab_size=262144, num_kv_heads=1, head_dim=256,
               attention_pattern=("local",) * 5 + ("global",), rope_local_base=10_000.0,
               rope_global_base=1_000_000.0)

# Gemma 4: norms scale by w (not 1 + w), values RMS-normed, query scale 1, global layers
# with 4x fewer key/value heads, twice the head dim, keys as values and RoPE on a quarter
# of it; the last layer is global; image spans are bidirectional in local layers only.
_GEMMA4 = dict(block_type="gemma4", vocab_size=262144, head_dim=256, global_head_dim=512,
               attention_pattern=("local",) * 5 + ("global",), final_layer_global=True,
               sliding_window=1024, rope_local_base=10_000.0, rope_global_base=1_000_000.0,
               rope_global_fraction=0.25, query_pre_attn_scalar=1.0, final_logit_softcap=30.0,
               norm_plus_one=False, use_value_norm=True, global_k_eq_v=True,
               bidirectional_span_types=("local",))
_GEMMA4_TINY = dict(_GEMMA4, vocab_size=512, num_layers=8, d_model=128, num_heads=4,
                    num_kv_heads=2, head_dim=32, global_head_dim=64, global_num_kv_heads=1,
                    mlp_dim=512, sliding_window=64)

# GPT-3: LayerNorm (1 + scale) with bias before attention and MLP, no post-norms,
# fused biased QKV, no RoPE but learned positions, unscaled tied embedding, plain MLP.
_GPT3 = dict(block_type="gpt3", attention_pattern=("global",), use_qk_norm=False,
             use_post_attn_norm=False, use_post_ffw_norm=False, norm_eps=1e-5,
             activation="gelu_tanh", scale_embeddings=False, trainable_position_size=16384,
             fused_qkv=True)

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
    "gemma4-31b": dict(_GEMMA4, num_layers=60, d_model=5376, num_heads=32, num_kv_heads=16,
                       global_num_kv_heads=4, mlp_dim=21504),
    "gemma4-26b-a4b": dict(_GEMMA4, num_layers=30, d_model=2816, num_heads=16, num_kv_heads=8,
                           global_num_kv_heads=2, mlp_dim=2112, num_experts=128,
                           experts_per_token=8, expert_mlp_dim=704),
    # The small models ("E" for effective size: most of their weights are the per-layer
    # input table, read one row per token): 4 local layers to a global one, window 512,
    # 256-wide per-layer inputs, the last layers reusing earlier keys and values.
    "gemma4-e2b": dict(_GEMMA4, num_layers=35, d_model=1536, num_heads=8, num_kv_heads=1,
                       mlp_dim=6144, attention_pattern=("local",) * 4 + ("global",),
                       sliding_window=512, global_k_eq_v=False, per_layer_input_dim=256,
                       num_kv_shared_layers=20, double_wide_mlp=True,
                       bidirectional_span_types=()),
    "gemma4-e4b": dict(_GEMMA4, num_layers=42, d_model=2560, num_heads=8, num_kv_heads=2,
                       mlp_dim=10240, sliding_window=512, global_k_eq_v=False,
                       per_layer_input_dim=256, num_kv_shared_layers=18,
                       bidirectional_span_types=()),
    "gemma4-tiny": _GEMMA4_TINY,
    # A CPU-sized small model: per-layer inputs, 5 shared key/value layers (a scanned
    # period), double-wide MLPs there.
    "gemma4-e2b-tiny": dict(_GEMMA4_TINY, num_layers=10,
                            attention_pattern=("local",) * 4 + ("global",), num_kv_heads=1,
                            global_num_kv_heads=None, global_k_eq_v=False, mlp_dim=256,
                            per_layer_input_dim=16, num_kv_shared_layers=5,
                            double_wide_mlp=True, bidirectional_span_types=()),
    "gpt3-52k": dict(_GPT3, num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, head_dim=8,
                     mlp_dim=64, vocab_size=1024, trainable_position_size=2048),
    "gpt3-6b": dict(_GPT3, num_layers=48, d_model=3072, num_heads=12, num_kv_heads=12,
                    head_dim=256, mlp_dim=12288, vocab_size=32768),
    "gpt3-22b": dict(_GPT3, num_layers=48, d_model=6144, num_heads=24, num_kv_heads=24,
                     head_dim=256, mlp_dim=24576, vocab_size=32768),
    "gpt3-175b": dict(_GPT3, num_layers=96, d_model=12288, num_heads=96, num_kv_heads=96,
                      head_dim=128, mlp_dim=49152, vocab_size=50304),
    # The generic parallel block (attention and gated MLP from one RMSNorm), CPU-sized.
    "parallel-tiny": dict(block_type="parallel", vocab_size=512, num_layers=4, d_model=128,
                          num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=512,
                          activation="silu", attention_pattern=("global",),
                          rope_global_base=10_000.0, use_qk_norm=False, norm_plus_one=False,
                          use_post_attn_norm=False, use_post_ffw_norm=False),
    "gemma4-moe-tiny": dict(_GEMMA4_TINY, mlp_dim=256, num_experts=8, experts_per_token=2,
                            expert_mlp_dim=128),
}

# Gemma 3 4B, 12B and 27B as published (Gemma3ForConditionalGeneration): the text model
# with those checkpoints' 262208-entry vocabulary, plus the SigLIP tower at 896 px whose
# 256 soft tokens per image replace the prompt's placeholders (config.model.vision).
PRESETS.update({f"gemma3-{size}-vision": dict(PRESETS[f"gemma3-{size}"], vocab_size=262_208,
                                             vision=dict(enabled=True))
                for size in ("4b", "12b", "27b")})
# A CPU-sized image model: 56 px images, 4 x 4 patches pooled to 2 x 2 soft tokens.
PRESETS["gemma3-tiny-vision"] = dict(
    PRESETS["gemma3-tiny"], vision=dict(
        enabled=True, image_size=56, patch_size=14, width=64, num_layers=2, num_heads=2,
        mlp_dim=128, tokens_per_image=4, boi_token_id=508, eoi_token_id=509,
        image_token_id=510, double_newline_token_id=511))

# Gemma 4's image tower (transformers' Gemma4VisionConfig defaults: the small models'
# ~150M-parameter one): 16-pixel patches of an image kept at its aspect ratio, 3 x 3 of
# them pooled into each of at most 280 soft tokens.
_GEMMA4_VISION = dict(enabled=True, width=768, num_layers=16, num_heads=12, num_kv_heads=12,
                      head_dim=64, mlp_dim=3072, patch_size=16, pooling_kernel=3,
                      max_soft_tokens=280, position_embedding_size=10_240, rope_base=100.0,
                      layer_norm_eps=1e-6, activation="gelu_tanh", standardize=False,
                      use_clipped_linears=False,
                      boi_token_id=255_999, eoi_token_id=258_882, image_token_id=258_880,
                      pad_token_id=0)
PRESETS.update({f"gemma4-{size}-vision": dict(PRESETS[f"gemma4-{size}"], vision=_GEMMA4_VISION)
                for size in ("e2b", "e4b")})
# A CPU-sized Gemma 4 image model: 4-pixel patches pooled 2 x 2, at most 16 soft tokens
# per image, bidirectional in local layers.
PRESETS["gemma4-tiny-vision"] = dict(
    _GEMMA4_TINY, vision=dict(
        _GEMMA4_VISION, width=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
        mlp_dim=64, patch_size=4, pooling_kernel=2, max_soft_tokens=16,
        position_embedding_size=64, boi_token_id=508, eoi_token_id=509, image_token_id=510))


def get_config(name: str) -> config_dict.ConfigDict:
  """The default experiment config with the named preset's model."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  config = config_lib.default_config()
  config.model.update(PRESETS[name])
  config.model.name = name
  if config.model.block_type == "gemma4":
    # Gemma 4's multiplicative scales (norms x scale, router, per-expert, per-layer
    # scalars) start at 1: weight decay would pull them towards 0. The vision tower's
    # clip bounds (+-inf until set) and standardize statistics are constants.
    config.optimizer.no_decay = ("norm", "scale", "scalar", "_clip/", "standardize/")
  return config
