"""Gemma 4's vision tower (gemma_jax/models/gemma4_tower.py) <-> transformers' tensors.

Canonical names are "vision_tower.<name>" and "embed_vision.<name>", to which
Gemma4ForConditionalGeneration's names in memory and in its saved files
("model.vision_tower.", "model.embed_vision.") and Gemma4Model's (without "model.")
map; `LAYOUT.to_hf` writes the saved ones.

Linear weights are [out, in] there, the tower's below ".linear." (Gemma4ClippableLinear);
the clip bounds are scalars beside it ("q_proj.input_min"); the position table [2, S, W],
the norms' weights and the standardize buffers (std_bias, std_scale) are copied as they
are. The value norm and the projector's norm have no weight.
"""

from typing import Mapping

from ml_collections import config_dict

from gemma_jax.checkpoints.config_fields import COUNT, FLAG, POSITIVE, POSITIVE_INT, Section, one_of
from gemma_jax.checkpoints.tower_layout import Tensor, TowerLayout

_TOWER, _EMBED = "vision_tower.", "embed_vision."
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
# Our projection below one encoder layer -> transformers' clippable linear there.
_PROJECTIONS = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
                ("attn", "v"): "self_attn.v_proj", ("attn", "out"): "self_attn.o_proj",
                ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
                ("mlp", "down"): "mlp.down_proj"}

# Our path below one encoder layer -> its tensor below `vision_tower.encoder.layers.{i}.`.
_LAYER_NAMES = {
    ("pre_attn_norm", "scale"): Tensor("input_layernorm.weight"),
    ("post_attn_norm", "scale"): Tensor("post_attention_layernorm.weight"),
    ("pre_mlp_norm", "scale"): Tensor("pre_feedforward_layernorm.weight"),
    ("post_mlp_norm", "scale"): Tensor("post_feedforward_layernorm.weight"),
    ("attn", "q_norm", "scale"): Tensor("self_attn.q_norm.weight"),
    ("attn", "k_norm", "scale"): Tensor("self_attn.k_norm.weight"),
    **{(module, proj, "kernel"): Tensor(f"{name}.linear.weight", "linear",
                                        in_dims=2 if proj == "out" else 1)
       for (module, proj), name in _PROJECTIONS.items()},
    **{(module, f"{proj}_clip", bound): Tensor(f"{name}.{bound}")
       for (module, proj), name in _PROJECTIONS.items() for bound in _BOUNDS},
}
# Our paths outside the encoder layers -> transformers' tensors.
_TOP_NAMES = {
    ("encoder", "patch_embed", "kernel"): Tensor(_TOWER + "patch_embedder.input_proj.weight",
                                                 "linear"),
    ("encoder", "pos_embed"): Tensor(_TOWER + "patch_embedder.position_embedding_table"),
    ("standardize", "bias"): Tensor(_TOWER + "std_bias"),
    ("standardize", "scale"): Tensor(_TOWER + "std_scale"),
    ("projector", "kernel"): Tensor(_EMBED + "embedding_projection.weight", "linear"),
}
LAYOUT = TowerLayout(
    _LAYER_NAMES, _TOP_NAMES, _TOWER + "encoder.layers.",
    prefixes=(("model.vision_tower.", _TOWER), (_TOWER, _TOWER),
              ("model.embed_vision.", _EMBED), (_EMBED, _EMBED)),
    saved_name=lambda name: "model." + name)

# Our field -> (transformers' Gemma4VisionConfig key, its default there, its kind).
_CONFIG_KEYS = {"width": ("hidden_size", 768, POSITIVE_INT),
                "mlp_dim": ("intermediate_size", 3072, POSITIVE_INT),
                "num_layers": ("num_hidden_layers", 16, POSITIVE_INT),
                "num_heads": ("num_attention_heads", 12, POSITIVE_INT),
                "num_kv_heads": ("num_key_value_heads", 12, POSITIVE_INT),
                "head_dim": ("head_dim", 64, POSITIVE_INT),
                "patch_size": ("patch_size", 16, POSITIVE_INT),
                "pooling_kernel": ("pooling_kernel_size", 3, POSITIVE_INT),
                "position_embedding_size": ("position_embedding_size", 10_240, POSITIVE_INT),
                "layer_norm_eps": ("rms_norm_eps", 1e-6, POSITIVE),
                "standardize": ("standardize", False, FLAG),
                "use_clipped_linears": ("use_clipped_linears", False, FLAG)}
# Our token id field -> (transformers' Gemma4Config key, its default there).
_ID_KEYS = {"boi_token_id": ("boi_token_id", 255_999),
            "eoi_token_id": ("eoi_token_id", 258_882),
            "image_token_id": ("image_token_id", 258_880)}


# Our vision fields a transformers config holds (the others are Gemma 3's, and the resize
# budget max_soft_tokens is the image processor's: `processor_from_hf`).
FIELDS = ("enabled", "activation", "rope_base", "pad_token_id") + tuple(_CONFIG_KEYS) + tuple(
    _ID_KEYS)


def config_from_hf(hf: dict, activations: Mapping[str, str]) -> dict:
  """A transformers Gemma4Config dict -> our vision fields (`activations`: transformers'
  activation name -> ours). Raises config_fields.FieldError (a ValueError) naming a field
  missing, of the wrong kind, or a setting we do not build."""
  root = Section(hf)
  v = root.section("vision_config")
  rope = v.section("rope_parameters")
  rope.read("rope_type", one_of(["axial"]), "axial")   # (the only rotation it builds)
  fields = {ours: v.read(key, kind, default)
            for ours, (key, default, kind) in _CONFIG_KEYS.items()}
  fields.update({ours: root.read(key, COUNT, default)
                 for ours, (key, default) in _ID_KEYS.items()})
  activation = v.read("hidden_activation", one_of(activations), "gelu_pytorch_tanh")
  return dict(fields, enabled=True, activation=activations[activation],
              rope_base=float(rope.read("rope_theta", POSITIVE, 100.0)),
              pad_token_id=root.section("text_config").read("pad_token_id", COUNT, 0))


def processor_from_hf(processor: Section, fields: dict) -> dict:
  """Gemma4ImageProcessor's settings (of preprocessor_config.json, or processor_config.json's
  image_processor) -> our resize budget {"max_soft_tokens": ...} ({} when they set none),
  for the vision `fields` of `config_from_hf`. Raises config_fields.FieldError naming a
  setting of the wrong kind, or patches that differ from the tower's."""
  for ours, key in (("patch_size", "patch_size"), ("pooling_kernel", "pooling_kernel_size")):
    if processor.read(key, POSITIVE_INT, fields[ours]) != fields[ours]:
      raise processor.error(key, f"{processor.read(key, POSITIVE_INT)}, but the vision "
                            f"tower's is {fields[ours]}")
  if "max_soft_tokens" not in processor:
    return {}
  return {"max_soft_tokens": processor.read("max_soft_tokens", POSITIVE_INT)}


def config_to_hf(config: config_dict.ConfigDict, activations: Mapping[str, str]) -> dict:
  """Our vision section -> the keys of a transformers Gemma4Config beside text_config
  (`activations`: ours -> transformers' name)."""
  vision_config = {key: config[ours] for ours, (key, *_) in _CONFIG_KEYS.items()}
  vision_config.update(model_type="gemma4_vision",
                       hidden_activation=activations[config.activation],
                       rope_parameters={"rope_type": "axial", "rope_theta": config.rope_base})
  return dict({key: config[ours] for ours, (key, _) in _ID_KEYS.items()},
              vision_config=vision_config)


def processor_to_hf(config: config_dict.ConfigDict) -> dict:
  """Our vision section -> the preprocessor_config.json of transformers'
  Gemma4ImageProcessor preparing images as gemma_jax.models.gemma4.images does."""
  return {"image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True,
          "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
          "do_normalize": False, "image_mean": [0.0] * 3, "image_std": [1.0] * 3,
          "patch_size": config.patch_size, "pooling_kernel_size": config.pooling_kernel,
          "max_soft_tokens": config.max_soft_tokens}
