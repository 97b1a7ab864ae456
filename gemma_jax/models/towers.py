"""Which vision tower a model has, by its block type: Gemma 3's SigLIP
(gemma_jax/models/gemma3/vision.py; images are pixels [B, I, S, S, C] from
gemma_jax.models.gemma3.images) or Gemma 4's (gemma_jax/models/gemma4/vision.py; images are
`gemma4_images.ImagePatches` [B, I, P, ...]). The decoder, `Transformed.apply`,
prefill and the Sampler go through here, never to one family directly.
"""

from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax.models.gemma3 import images as image_inputs
from gemma_jax.models.gemma3 import vision
from gemma_jax.models.gemma4 import images as gemma4_images
from gemma_jax.models.gemma4 import vision as gemma4_vision


class _Tower(NamedTuple):
  """One family's tower and what surrounds it."""
  module: Callable[..., nn.Module]    # a vision.TowerModule with out_width D
  inputs: Callable[[Any], tuple]      # images -> the tower's arguments
  blank: Callable[[Any, Any], tuple]  # (vision section, dtype) -> arguments for init
  # (embeddings, tokens, tower output, vision section) -> embeddings with soft tokens
  merge: Callable[..., jax.Array]
  check: Callable[..., None]          # (tokens, images or None, vision section)
  # (prompt rows, images per row, vision section, the tokenizer's encode or None) ->
  # (rows with spans, model images)
  prompts: Callable[..., Tuple[list, Any]]


_TOWERS = {
    "gemma3": _Tower(
        module=vision.VisionTower,
        inputs=lambda images: (images,),
        blank=lambda v, dtype: (jnp.zeros((1, v.image_size, v.image_size, v.num_channels),
                                          dtype),),
        merge=lambda x, tokens, soft, v: vision.merge_soft_tokens(x, tokens, soft,
                                                                  v.image_token_id),
        check=vision.check_image_inputs,
        prompts=image_inputs.prompts_with_images),
    "gemma4": _Tower(
        module=gemma4_vision.Gemma4VisionTower,
        inputs=tuple,
        blank=lambda v, dtype: (jnp.zeros((1, v.pooling_kernel ** 2, 3 * v.patch_size ** 2),
                                          dtype),
                                jnp.zeros((1, v.pooling_kernel ** 2, 2), jnp.int32)),
        merge=lambda x, tokens, out, v: gemma4_vision.merge_soft_tokens(
            x, tokens, *out, v.image_token_id),
        check=gemma4_vision.check_image_inputs,
        # Gemma 4's spans hold no newlines to merge: the tokenizer is not needed.
        prompts=lambda rows, images, v, encode: gemma4_images.prompts_with_images(
            rows, images, v)),
}


def _module(model: config_dict.ConfigDict, **name) -> nn.Module:
  """The tower of `model` (its config section)."""
  return _TOWERS[model.block_type].module(
      model.vision, jnp.dtype(model.dtype), jnp.dtype(model.param_dtype), model.scan_layers,
      model.remat_policy, model.attention_kernel, out_width=model.d_model, **name)


def embed_images(model: config_dict.ConfigDict, x: jax.Array, tokens: jax.Array, images: Any,
                 initializing: bool) -> jax.Array:
  """Inside the decoder's compact call: the tower "vision" of `model` (its config
  section) turns `images` into soft tokens that replace the placeholders' embeddings x
  [B, T, D]. Without images, x is returned; at init the tower still makes its
  parameters."""
  tower = _TOWERS[model.block_type]
  module = _module(model, name="vision")
  if images is not None:
    return tower.merge(x, tokens, module(*tower.inputs(images)), model.vision)
  if initializing:
    module(*tower.blank(model.vision, jnp.dtype(model.dtype)))
  return x


def soft_embeddings(model: config_dict.ConfigDict, vision_params: dict, tokens: jax.Array,
                    images: Any) -> jax.Array:
  """What the decoder's embedding takes from `images` at the placeholders of tokens
  [B, T]: [B, T, D] soft tokens there, zeros elsewhere (`Decoder`'s `soft_tokens`, for
  a prompt computed in chunks). `vision_params`: the parameters' "vision" entry, in
  the layout `model.scan_layers` says."""
  tower = _TOWERS[model.block_type]
  out = _module(model).apply({"params": vision_params}, *tower.inputs(images))
  zeros = jnp.zeros(tokens.shape + (model.d_model,), jnp.dtype(model.dtype))
  return tower.merge(zeros, tokens, out, model.vision)


def check_image_inputs(tokens: Any, images: Any, model: config_dict.ConfigDict) -> None:
  """Raises ValueError naming what is wrong with `images` for tokens [B, T] of `model`
  (the config's model section): images for a model without vision, or what the family's
  check finds (shapes; with concrete ids, spans that do not fit the images)."""
  if images is None and not model.vision.enabled:
    return
  if not model.vision.enabled:
    raise ValueError("images were given to a model without vision "
                     "(config.model.vision.enabled is False)")
  _TOWERS[model.block_type].check(tokens, images, model.vision)


def prompts_with_images(rows: Sequence[np.ndarray], images: Sequence[Sequence],
                        model: config_dict.ConfigDict, encode: Optional[Callable] = None
                        ) -> Tuple[list, Any]:
  """Prompt ids [BOS, ...] per row and images per row -> (rows with each image's span,
  the model's `images`); see the family's `prompts_with_images`. `encode`: the
  tokenizer's (texts -> ids), for the ids transformers' processor gives."""
  if not model.vision.enabled:
    raise ValueError("images were given to a model without vision "
                     "(config.model.vision.enabled is False)")
  if len(images) != len(rows):
    raise ValueError(f"images must hold one list per prompt: {len(rows)} prompts, got "
                     f"{len(images)} lists")
  for b, row_images in enumerate(images):
    if not isinstance(row_images, (list, tuple)):   # an image itself: [img], not [[img]]
      raise ValueError(f"images[{b}] must be a list of prompt {b}'s images, got "
                       f"{type(row_images).__name__}")
  return _TOWERS[model.block_type].prompts(rows, images, model.vision, encode)
