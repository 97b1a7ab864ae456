"""Gemma 4's vision tower: patches of an image of any aspect ratio -> soft tokens in the
text width. Its inputs come from gemma_jax/models/gemma4/images.py; its transformers tensor
names are in gemma_jax/checkpoints/gemma4_tower.py.

Dims: N images (any leading dims flattened), P patch slots per image (padding
included), p patch side, W encoder width, A query heads, K key/value heads, H head dim,
F MLP width, S position table size, k pooling kernel, M = P / k^2 soft-token slots, D
text model width. The config section is `config.model.vision` (gemma_jax/config.py, the
fields read by Gemma 4's tower).

    patches [N, P, 3 p^2] in [0, 1], positions [N, P, 2] (column, row; (-1, -1) padding)
      -> (2 x - 1) . [3 p^2, W] + pos_embed[0][column] + pos_embed[1][row]
         (no position on padding)                               (`Gemma4VisionEncoder`)
      -> encoder layers: x + post_norm(attn(pre_norm(x))), x + post_norm(mlp(pre_norm(x)))
           attention: RMSNorm on q, k (with scale) and v (without), 2-D RoPE (the first
           H/2 channels rotate by column, the last H/2 by row), scale 1, padding
           patches hidden as keys; gated GELU MLP
      -> padding zeroed; mean over each k x k block of patch positions (`pool_patches`)
         into M slots; x sqrt(W); (x - std_bias) * std_scale if `standardize`  (float32)
      -> RMSNorm without scale, x [W, D] -> soft tokens [N, M, D], valid [N, M]

A slot is valid when a patch falls in it; for the processor's images these are the
first n = (h / (p k)) * (w / (p k)) slots. transformers drops the others
(`Gemma4VisionModel` returns only valid tokens); here they stay, marked invalid.

With `use_clipped_linears` every projection clamps its input to [input_min, input_max]
and its output to [output_min, output_max] (transformers' Gemma4ClippableLinear). Those
bounds and the standardize statistics are buffers in transformers: here they are
parameters the gradient does not reach (an optimizer's weight decay still would: keep
them out of it).

Parameter names (scanned: encoder layers stacked on a leading "layers" axis):

  encoder/patch_embed/kernel [3 p^2, W], encoder/pos_embed [2, S, W],
  encoder/layers/... (scanned) or encoder/layers_{i}/... (unrolled), where a layer is
    pre_attn_norm/scale, post_attn_norm/scale, pre_mlp_norm/scale, post_mlp_norm/scale [W],
    attn/q/kernel [W, A, H], attn/{k, v}/kernel [W, K, H], attn/out/kernel [A, H, W],
    attn/{q_norm, k_norm}/scale [H], mlp/{gate, up}/kernel [W, F], mlp/down/kernel [F, W],
    with clipped linears also attn/{q, k, v, out}_clip/... and mlp/{gate, up, down}_clip/...
    holding {input_min, input_max, output_min, output_max} [],
  standardize/{bias, scale} [W] (with `standardize`), projector/kernel [W, D].
"""

import dataclasses
import math
from typing import Any, Callable, Sequence, Tuple

import chex
import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax.layers.attention import dot_product_attention
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.mlp import gated_activation
from gemma_jax.layers.norms import RMSNorm
from gemma_jax.layers.rope import apply_rope
from gemma_jax.models.gemma3 import vision
from gemma_jax.models.gemma4.images import ImagePatches


# ----------------------------------------------------------------------------- pieces


class ClipBounds(nn.Module):
  """A clippable projection's bounds: scalars, initialised to +-inf (no clipping)."""
  param_dtype: Any = jnp.float32

  def setup(self):
    bound = lambda name, value: jax.lax.stop_gradient(self.param(
        name, nn.with_logical_partitioning(nn.initializers.constant(value), ()), (),
        self.param_dtype))
    self.input_min, self.input_max = bound("input_min", -jnp.inf), bound("input_max", jnp.inf)
    self.output_min, self.output_max = (bound("output_min", -jnp.inf),
                                        bound("output_max", jnp.inf))

  def inputs(self, x: jax.Array) -> jax.Array:
    """x clamped to [input_min, input_max]."""
    return jnp.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))

  def outputs(self, y: jax.Array) -> jax.Array:
    """y clamped to [output_min, output_max]."""
    return jnp.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


def projection(config: config_dict.ConfigDict, out_shape: Sequence[int], axes: Sequence[str],
               name: str, in_dims: int = 1, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32) -> Callable[[jax.Array], jax.Array]:
  """A bias-free `Linear` named `name`, clamped by `ClipBounds` named `{name}_clip` when
  the config uses clipped linears. Call it inside a compact method."""
  linear = Linear(out_shape, axes, in_dims=in_dims, dtype=dtype, param_dtype=param_dtype,
                  name=name)
  if not config.use_clipped_linears:
    return linear
  clip = ClipBounds(param_dtype, name=f"{name}_clip")
  return lambda x: clip.outputs(linear(clip.inputs(x)))


def rope_2d(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """x [N, P, A, H], positions [N, P, 2] -> x with channels [0, H/2) rotated by the
  column and [H/2, H) by the row, each half as 1-D RoPE of dim H/2 ("rotate half")."""
  half = x.shape[-1] // 2
  return jnp.concatenate([apply_rope(x[..., :half], positions[..., 0], base=base),
                          apply_rope(x[..., half:], positions[..., 1], base=base)], axis=-1)


def pool_patches(x: jax.Array, positions: jax.Array, kernel: int) -> Tuple[jax.Array, jax.Array]:
  """Average pooling by position: x [N, P, W], positions [N, P, 2] -> (sum over each
  slot's patches / k^2 [N, M, W] float32, valid [N, M]).

  Slot of a patch: column // k + (width // k) * (row // k), width = the image's largest
  column + 1. Padding patches count as position (0, 0), as in transformers: they make
  slot 0 valid but add nothing (the caller zeroes them).
  """
  n, p, _ = x.shape
  slots = p // kernel ** 2
  clamped = jnp.maximum(positions, 0)
  width = clamped[..., 0].max(axis=-1, keepdims=True) + 1
  block = clamped // kernel
  index = block[..., 0] + (width // kernel) * block[..., 1]                   # [N, P]
  segment_sum = jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=slots))
  pooled = segment_sum(x.astype(jnp.float32), index) / kernel ** 2
  valid = segment_sum(jnp.ones((n, p), jnp.int32), index) > 0
  return pooled, valid


class Standardize(nn.Module):
  """(x - bias) * scale over the last axis, in float32: transformers' std_bias and
  std_scale buffers (bias zero-, scale ones-initialised; the gradient stops here)."""
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    stat = lambda name, init: jax.lax.stop_gradient(self.param(
        name, nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],),
        self.param_dtype)).astype(jnp.float32)
    bias = stat("bias", nn.initializers.zeros_init())
    return (x.astype(jnp.float32) - bias) * stat("scale", nn.initializers.ones_init())


# ----------------------------------------------------------------------------- modules


class Gemma4VisionAttention(nn.Module):
  """Bidirectional attention over an image's patches: x [N, P, W] -> [N, P, W]."""
  config: config_dict.ConfigDict
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention_kernel: str = "einsum"

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    """positions [N, P, 2], mask [N, P, P] (which keys each patch sees)."""
    c = self.config
    a, kv, h = c.num_heads, c.num_kv_heads, c.head_dim
    dense = lambda shape, axes, name, in_dims=1: projection(
        c, shape, axes, name, in_dims, self.dtype, self.param_dtype)
    norm = lambda name, with_scale=True: RMSNorm(
        c.layer_norm_eps, with_scale=with_scale, plus_one=False, axis_name="head_dim",
        param_dtype=self.param_dtype, name=name)
    q = checkpoint_name(dense((a, h), ("embed", "heads", "head_dim"), "q")(x), "query_proj")
    k = checkpoint_name(dense((kv, h), ("embed", "kv_heads", "head_dim"), "k")(x), "key_proj")
    v = checkpoint_name(dense((kv, h), ("embed", "kv_heads", "head_dim"), "v")(x), "value_proj")
    q = rope_2d(norm("q_norm")(q), positions, c.rope_base)
    k = rope_2d(norm("k_norm")(k), positions, c.rope_base)
    v = norm("v_norm", with_scale=False)(v)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))
    out = dot_product_attention(q, k, v, mask, kernel=self.attention_kernel)
    out = dense((x.shape[-1],), ("heads", "head_dim", "embed"), "out", in_dims=2)(out)
    return checkpoint_name(out, "out_proj")


class Gemma4VisionMlp(nn.Module):
  """down(act(gate(x)) * up(x)): [N, P, W] -> [N, P, W], projections clippable."""
  config: config_dict.ConfigDict
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    dense = lambda shape, axes, name: projection(c, shape, axes, name, 1, self.dtype,
                                                 self.param_dtype)
    gate = checkpoint_name(dense((c.mlp_dim,), ("embed", "mlp"), "gate")(x), "mlpwi_0")
    up = checkpoint_name(dense((c.mlp_dim,), ("embed", "mlp"), "up")(x), "mlpwi_1")
    hidden = nn.with_logical_constraint(gated_activation(c.activation, gate, up),
                                        ("batch", "length", "mlp"))
    return checkpoint_name(dense((x.shape[-1],), ("mlp", "embed"), "down")(hidden), "mlpwo")


class Gemma4VisionLayer(nn.Module):
  """x + post_norm(attn(pre_norm(x))), then x + post_norm(mlp(pre_norm(x))); returns
  (x, None) to serve as a scan body."""
  config: config_dict.ConfigDict
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention_kernel: str = "einsum"

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array,
               mask: jax.Array) -> Tuple[jax.Array, None]:
    """x [N, P, W], positions [N, P, 2], mask [N, P, P] -> ([N, P, W], None)."""
    c = self.config
    norm = lambda name: RMSNorm(c.layer_norm_eps, plus_one=False,
                                param_dtype=self.param_dtype, name=name)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    attn = Gemma4VisionAttention(c, self.dtype, self.param_dtype, self.attention_kernel,
                                 name="attn")
    x = x + norm("post_attn_norm")(attn(norm("pre_attn_norm")(x), positions, mask))
    mlp = Gemma4VisionMlp(c, self.dtype, self.param_dtype, name="mlp")
    x = x + norm("post_mlp_norm")(mlp(norm("pre_mlp_norm")(x)))
    return x, None


class Gemma4VisionEncoder(vision.TowerModule):
  """Patches [N, P, 3 p^2] and positions [N, P, 2] -> features [N, P, W] (padding rows
  hold anything)."""

  @nn.compact
  def __call__(self, patches: jax.Array, positions: jax.Array) -> jax.Array:
    c = self.config
    padding = jnp.all(positions == -1, axis=-1)                               # [N, P]
    # The patch pixels have no logical name: they stay whole.
    x = Linear((c.width,), (None, "embed"), dtype=self.dtype, param_dtype=self.param_dtype,
               name="patch_embed")(2 * (patches - 0.5))
    table = self.param("pos_embed", nn.with_logical_partitioning(
        nn.initializers.normal(stddev=c.width ** -0.5), (None, None, "embed")),
                       (2, c.position_embedding_size, c.width), self.param_dtype)
    clamped = jnp.maximum(positions, 0)
    pos = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]
    x = x + jnp.where(padding[..., None], 0, pos).astype(self.dtype)
    mask = jnp.broadcast_to(~padding[:, None, :], padding.shape + padding.shape[-1:])

    x = vision.encoder_layers(self, Gemma4VisionLayer, x, positions, mask)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class Gemma4VisionTower(vision.TowerModule):
  """Patches -> soft tokens in the text width and which of them are real; fields of
  `vision.TowerModule` (standardize also in float32), and out_width (D, the text model's
  width; keyword only)."""
  out_width: int = dataclasses.field(kw_only=True)

  @nn.compact
  def __call__(self, patches: jax.Array, positions: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """patches [..., P, 3 p^2], positions [..., P, 2] (gemma4_images) -> (soft tokens
    [..., M, D], valid [..., M] bool)."""
    c = self.config
    lead, p = patches.shape[:-2], patches.shape[-2]
    chex.assert_axis_dimension(patches, -1, 3 * c.patch_size ** 2)
    chex.assert_shape(positions, lead + (p, 2))
    if p % c.pooling_kernel ** 2:
      raise ValueError(f"{p} patches do not pool into {c.pooling_kernel} x "
                       f"{c.pooling_kernel} blocks")
    patches = patches.reshape((-1,) + patches.shape[-2:])
    positions = positions.reshape((-1, p, 2))
    x = Gemma4VisionEncoder(*self.settings(), name="encoder")(patches, positions)
    padding = jnp.all(positions == -1, axis=-1)
    x, valid = pool_patches(jnp.where(padding[..., None], 0, x), positions, c.pooling_kernel)
    x = x * math.sqrt(c.width)
    if c.standardize:
      x = Standardize(self.param_dtype, name="standardize")(x)
    x = RMSNorm(c.layer_norm_eps, with_scale=False)(x.astype(self.dtype))
    # One array cannot name "embed" twice: the vision width stays whole here.
    x = Linear((self.out_width,), (None, "embed"), dtype=self.dtype,
               param_dtype=self.param_dtype, name="projector")(x)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x.reshape(lead + x.shape[1:]), valid.reshape(lead + valid.shape[1:])


# ----------------------------------------------------------------------------- merge helpers


def merge_soft_tokens(embeddings: jax.Array, tokens: jax.Array, soft_tokens: jax.Array,
                      valid: jax.Array, image_token_id: int) -> jax.Array:
  """Replaces each row's placeholders by its valid soft tokens, in order (transformers'
  masked_scatter of the tokens it keeps).

  embeddings [B, T, D], tokens [B, T], soft_tokens [B, I, M, D], valid [B, I, M]: row b's
  j-th placeholder takes the j-th valid token of its images in order.
  """
  b, d = soft_tokens.shape[0], soft_tokens.shape[-1]
  order = jnp.argsort(~valid.reshape(b, -1), axis=1, stable=True)   # valid first, in order
  flat = jnp.take_along_axis(soft_tokens.reshape(b, -1, d), order[..., None], axis=1)
  return vision.merge_soft_tokens(embeddings, tokens, flat[:, None], image_token_id)


def check_image_inputs(tokens, images: ImagePatches, config: config_dict.ConfigDict) -> None:
  """Raises ValueError naming what is wrong with `images` (patches [B, I, P, 3 p^2],
  positions [B, I, P, 2]) for tokens [B, T]: the type, a shape or dtype, patches outside
  [0, 1] or positions outside the table (when concrete), or (when the ids and
  positions are concrete) a placeholder span whose length is not its image's soft-token
  count, a row with more spans than images, or an image with no span. `config` is the
  vision section."""
  b, pixels = tokens.shape[0], 3 * config.patch_size ** 2
  slots = config.pooling_kernel ** 2
  if images is not None:
    if not isinstance(images, ImagePatches):
      raise ValueError(f"images of a Gemma 4 model are gemma4_images.ImagePatches (patches, "
                       f"positions), got {type(images).__name__}")
    patches, positions = images
    if (patches.ndim != 4 or patches.shape[0] != b or patches.shape[-1] != pixels
        or patches.shape[2] % slots):
      raise ValueError(f"images.patches must be [batch={b}, images, patches (a multiple of "
                       f"{slots}), {pixels}], got shape {patches.shape}")
    if positions.shape != patches.shape[:3] + (2,):
      raise ValueError(f"images.positions must be {patches.shape[:3] + (2,)} (column, row of "
                       f"each patch), got shape {positions.shape}")
    if not jnp.issubdtype(patches.dtype, jnp.floating):
      raise ValueError(f"images.patches must hold float pixels in [0, 1], got dtype "
                       f"{patches.dtype}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"images.positions must hold integer columns and rows, got dtype "
                       f"{positions.dtype}")
    vision.check_value_range(patches, 0.0, 1.0, "images.patches",
                             "gemma4_images.preprocess_images maps 0..255 to [0, 1]")
    vision.check_value_range(positions, -1, config.position_embedding_size - 1,
                             "images.positions", "-1 marks padding; the position table "
                             f"holds config.model.vision.position_embedding_size="
                             f"{config.position_embedding_size} columns and rows")
  if any(isinstance(a, jax.core.Tracer) for a in (tokens,) + tuple(images or ())):
    return
  spans = np.asarray(vision.image_span_ids(jnp.asarray(tokens), config.image_token_id))
  counts = (np.zeros((b, 0), int) if images is None
            else ImagePatches(*images).num_soft_tokens(config.pooling_kernel))
  for row in range(b):
    count = int(spans[row].max(initial=0))
    lengths = np.bincount(spans[row], minlength=count + 1)[1:]
    if count > counts.shape[1]:
      raise ValueError(f"tokens row {row} holds {count} image placeholder spans but "
                       f"{counts.shape[1]} images were given")
    for k, length in enumerate(lengths):
      if length != counts[row, k]:
        raise ValueError(f"tokens row {row}: image placeholder span {k} holds {length} "
                         f"image_token_id ids, but image {k} of the row gives "
                         f"{counts[row, k]} soft tokens")
    unused = np.flatnonzero(counts[row, count:]) + count
    if unused.size:
      raise ValueError(f"tokens row {row} holds {count} image placeholder spans, but its "
                       f"image {unused[0]} is no padding: images without markers")
