"""Gemma 3's vision tower and projector <-> transformers' tensors.

Our paths are below the tower (`params["vision"]`, encoder layers unrolled as
`encoder/layers_{i}`); transformers' names are given in one canonical form,
"vision_tower.<SigLIP name>" and "multi_modal_projector.<name>", to which every layout
maps (`canonical_name`): transformers 5 in memory ("model.vision_tower.encoder..."), its
saved files ("vision_tower.encoder..."), and transformers 4 and the published
checkpoints, where SigLIP keeps its own "vision_model." ("vision_tower.vision_model.").
`to_hf` writes the published layout. Linear weights are [out, in] there, the patch
convolution [W, C, p, p]; the projection is a bare [W, D] matrix, copied as is.
"""

from typing import Mapping

from ml_collections import config_dict

from gemma_jax.checkpoints.config_fields import COUNT, POSITIVE, POSITIVE_INT, Section, one_of
from gemma_jax.checkpoints.tower_layout import Tensor as _Tensor, TowerLayout

_TOWER, _PROJECTOR = "vision_tower.", "multi_modal_projector."

# Our path below one encoder layer -> its tensor below `vision_tower.encoder.layers.{i}.`.
_LAYER_NAMES = {
    ("pre_attn_norm", "scale"): _Tensor("layer_norm1.weight", "copy"),
    ("pre_attn_norm", "bias"): _Tensor("layer_norm1.bias", "copy"),
    ("attn", "q", "kernel"): _Tensor("self_attn.q_proj.weight", "linear"),
    ("attn", "q", "bias"): _Tensor("self_attn.q_proj.bias", "copy"),
    ("attn", "k", "kernel"): _Tensor("self_attn.k_proj.weight", "linear"),
    ("attn", "k", "bias"): _Tensor("self_attn.k_proj.bias", "copy"),
    ("attn", "v", "kernel"): _Tensor("self_attn.v_proj.weight", "linear"),
    ("attn", "v", "bias"): _Tensor("self_attn.v_proj.bias", "copy"),
    ("attn", "out", "kernel"): _Tensor("self_attn.out_proj.weight", "linear", in_dims=2),
    ("attn", "out", "bias"): _Tensor("self_attn.out_proj.bias", "copy"),
    ("pre_mlp_norm", "scale"): _Tensor("layer_norm2.weight", "copy"),
    ("pre_mlp_norm", "bias"): _Tensor("layer_norm2.bias", "copy"),
    ("mlp", "up", "kernel"): _Tensor("mlp.fc1.weight", "linear"),
    ("mlp", "up", "bias"): _Tensor("mlp.fc1.bias", "copy"),
    ("mlp", "down", "kernel"): _Tensor("mlp.fc2.weight", "linear"),
    ("mlp", "down", "bias"): _Tensor("mlp.fc2.bias", "copy"),
}
# Our paths outside the encoder layers -> transformers' tensors.
_TOP_NAMES = {
    ("encoder", "patch_embed", "kernel"): _Tensor(_TOWER + "embeddings.patch_embedding.weight",
                                                  "conv"),
    ("encoder", "patch_embed", "bias"): _Tensor(_TOWER + "embeddings.patch_embedding.bias",
                                                "copy"),
    ("encoder", "pos_embed"): _Tensor(_TOWER + "embeddings.position_embedding.weight", "copy"),
    ("encoder", "final_norm", "scale"): _Tensor(_TOWER + "post_layernorm.weight", "copy"),
    ("encoder", "final_norm", "bias"): _Tensor(_TOWER + "post_layernorm.bias", "copy"),
    ("projector", "norm", "scale"): _Tensor(_PROJECTOR + "mm_soft_emb_norm.weight", "copy"),
    ("projector", "proj", "kernel"): _Tensor(_PROJECTOR + "mm_input_projection_weight", "copy"),
}
# Stored prefix -> canonical prefix, longest first.
_PREFIXES = (("model.vision_tower.vision_model.", _TOWER), ("model.vision_tower.", _TOWER),
             ("vision_tower.vision_model.", _TOWER), ("vision_tower.", _TOWER),
             ("model.multi_modal_projector.", _PROJECTOR), (_PROJECTOR, _PROJECTOR))


# Our vision field -> (transformers' SiglipVisionConfig key, its default there, its kind).
_CONFIG_KEYS = {"width": ("hidden_size", 768, POSITIVE_INT),
                "mlp_dim": ("intermediate_size", 3072, POSITIVE_INT),
                "num_layers": ("num_hidden_layers", 12, POSITIVE_INT),
                "num_heads": ("num_attention_heads", 12, POSITIVE_INT),
                "num_channels": ("num_channels", 3, POSITIVE_INT),
                "image_size": ("image_size", 224, POSITIVE_INT),
                "patch_size": ("patch_size", 16, POSITIVE_INT),
                "layer_norm_eps": ("layer_norm_eps", 1e-6, POSITIVE)}
# Our token id field -> (transformers' Gemma3Config key, its default there).
_ID_KEYS = {"boi_token_id": ("boi_token_index", 255_999),
            "eoi_token_id": ("eoi_token_index", 256_000),
            "image_token_id": ("image_token_index", 262_144)}


# Our vision fields a transformers config holds (the others are Gemma 4's).
FIELDS = ("enabled", "activation", "tokens_per_image") + tuple(_CONFIG_KEYS) + tuple(_ID_KEYS)


def config_from_hf(hf: dict, activations: Mapping[str, str]) -> dict:
  """A transformers Gemma3Config dict -> our vision fields (`activations`: transformers'
  activation name -> ours). Raises config_fields.FieldError (a ValueError) naming a field
  missing or of the wrong kind."""
  root = Section(hf)
  v = root.section("vision_config")   # (its vision_use_head: Gemma 3 never runs that head)
  fields = {ours: v.read(key, kind, default)
            for ours, (key, default, kind) in _CONFIG_KEYS.items()}
  fields.update({ours: root.read(key, COUNT, default)
                 for ours, (key, default) in _ID_KEYS.items()})
  activation = v.read("hidden_act", one_of(activations), "gelu_pytorch_tanh")
  return dict(fields, enabled=True, activation=activations[activation],
              tokens_per_image=root.read("mm_tokens_per_image", POSITIVE_INT, 256))


def config_to_hf(config: config_dict.ConfigDict, activations: Mapping[str, str]) -> dict:
  """Our vision section -> the keys of a transformers Gemma3Config beside text_config
  (`activations`: ours -> transformers' name)."""
  vision_config = {key: config[ours] for ours, (key, *_) in _CONFIG_KEYS.items()}
  vision_config.update(model_type="siglip_vision_model", vision_use_head=False,
                       hidden_act=activations[config.activation])
  return dict({key: config[ours] for ours, (key, _) in _ID_KEYS.items()},
              vision_config=vision_config, mm_tokens_per_image=config.tokens_per_image)


def _saved_name(name: str) -> str:
  """The published layout keeps SigLIP's own "vision_model." below the tower."""
  if name.startswith(_TOWER):
    return _TOWER + "vision_model." + name[len(_TOWER):]
  return name


LAYOUT = TowerLayout(_LAYER_NAMES, _TOP_NAMES, _TOWER + "encoder.layers.", _PREFIXES,
                     _saved_name)
