"""Gemma 3's vision tower: a SigLIP encoder, soft-token pooling and the projection into
the text width, and the helpers that merge its soft tokens into the text stream.
Its config section is `config.model.vision` (gemma_jax/config.py); its transformers
tensor names are in gemma_jax/checkpoints/gemma3_tower.py.

Dims: N images (any leading dims flattened), S image side in pixels, C channels,
p patch side, G = S / p patches per side, P = G * G patches, W encoder width,
A attention heads, Hv = W / A head dim, F encoder MLP width, M soft tokens per
image (a square, m = sqrt(M) per side), D text model width.

    pixels [N, S, S, C] -> conv p x p, stride p -> [N, P, W] + position embedding
      -> scanned encoder layers (LayerNorm, attention with biases, GELU MLP)
      -> final LayerNorm                                     (`VisionEncoder`)
      -> average pooling G x G -> m x m, RMSNorm (1 + scale), x [W, D] -> [N, M, D]

Parameter names (scanned: encoder layers stacked on a leading "layers" axis):

  encoder/patch_embed/{kernel [p, p, C, W], bias [W]}, encoder/pos_embed [P, W],
  encoder/layers/... (scanned) or encoder/layers_{i}/... (unrolled), where a layer is
    pre_attn_norm/{scale, bias}, attn/{q, k, v}/{kernel [W, A, Hv], bias [A, Hv]},
    attn/out/{kernel [A, Hv, W], bias [W]}, pre_mlp_norm/{scale, bias},
    mlp/up/{kernel [W, F], bias [F]}, mlp/down/{kernel [F, W], bias [W]},
  encoder/final_norm/{scale, bias}, projector/norm/scale [W], projector/proj/kernel [W, D].
`decoder.stack_layers` / `decoder.unstack_layers` convert between the two layer layouts.

Merge helpers: `image_span_ids` (span ids for `attention_mask(..., q_spans, kv_spans)`)
and `merge_soft_tokens`.
"""

import dataclasses
import math
from typing import Any, Tuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.layers.attention import Attention
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.mlp import Mlp
from gemma_jax.layers.norms import RMSNorm

# ----------------------------------------------------------------------------- modules


def _layer_norm(eps: float, param_dtype: Any, name: str) -> nn.LayerNorm:
  """LayerNorm over the last axis with a bias; computed in float32."""
  return nn.LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                              ("norm",)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                             ("norm",)),
                      name=name)


class VisionLayer(nn.Module):
  """x + attn(ln(x)), then x + mlp(ln(x)); returns (x, None) to serve as a scan body.
  The attention is the text model's, with biases, no RoPE or norms, and every patch
  seeing every patch; the MLP is the plain one with biases."""
  config: config_dict.ConfigDict
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention_kernel: str = "einsum"

  @nn.compact
  def __call__(self, x: jax.Array) -> Tuple[jax.Array, None]:
    """x: [N, P, W] -> ([N, P, W], None)."""
    c = self.config
    head_dim = c.width // c.num_heads
    norm = lambda name: lambda y: _layer_norm(c.layer_norm_eps, self.param_dtype, name)(y).astype(self.dtype)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    attn = Attention(c.num_heads, c.num_heads, head_dim, query_scale=head_dim ** -0.5,
                     use_rope=False, use_qk_norm=False, use_bias=True,
                     kernel=self.attention_kernel, dtype=self.dtype,
                     param_dtype=self.param_dtype, name="attn")
    x = x + attn(norm("pre_attn_norm")(x), None, None)
    x = x + Mlp(c.mlp_dim, c.activation, use_bias=True, dtype=self.dtype,
                param_dtype=self.param_dtype, name="mlp")(norm("pre_mlp_norm")(x))
    return x, None


def encoder_layers(encoder: "TowerModule", layer_cls: type, x: jax.Array,
                   *context) -> jax.Array:
  """Inside a tower encoder's compact call: its `config.num_layers` layers of `layer_cls`
  (fields config, dtype, param_dtype, attention_kernel; called as (x, *context) ->
  (x, None)) over x, rematted by `encoder.remat_policy` and scanned (parameters
  "layers", stacked) or unrolled ("layers_{i}") by `encoder.scan_layers`."""
  if remat.is_remat(encoder.remat_policy):
    layer_cls = nn.remat(layer_cls, policy=remat.POLICIES[encoder.remat_policy],
                         prevent_cse=not encoder.scan_layers)
  fields = (encoder.config, encoder.dtype, encoder.param_dtype, encoder.attention_kernel)
  if encoder.scan_layers:
    x, _ = nn.scan(layer_cls, variable_axes={"params": 0},
                   split_rngs={"params": True, "dropout": True},
                   in_axes=(nn.broadcast,) * len(context), length=encoder.config.num_layers,
                   metadata_params={nn.PARTITION_NAME: "layers"})(
                       *fields, name="layers")(x, *context)
    return x
  for i in range(encoder.config.num_layers):
    x, _ = layer_cls(*fields, name=f"layers_{i}")(x, *context)
  return x


class TowerModule(nn.Module):
  """The settings every vision tower and encoder module takes (both families').

  Attributes:
    config: the vision section (`config.model.vision`).
    dtype, param_dtype: compute and storage dtypes (norms and pooling in float32).
    scan_layers: nn.scan over the encoder layers (parameters on a "layers" axis).
    remat_policy: encoder layer remat, a name from gemma_jax.remat.POLICIES.
    attention_kernel: "einsum" or "jax", see `attention.dot_product_attention`.
  """
  config: config_dict.ConfigDict
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  scan_layers: bool = True
  remat_policy: str = "none"
  attention_kernel: str = "einsum"

  def settings(self) -> tuple:
    """The fields above in order: a sub-encoder's first arguments."""
    return (self.config, self.dtype, self.param_dtype, self.scan_layers, self.remat_policy,
            self.attention_kernel)


class VisionEncoder(TowerModule):
  """SigLIP: pixels [N, S, S, C] -> patch features [N, P, W] after the final LayerNorm."""

  @nn.compact
  def __call__(self, pixels: jax.Array) -> jax.Array:
    c = self.config
    s, p, w = c.image_size, c.patch_size, c.width
    chex.assert_shape(pixels, (None, s, s, c.num_channels))
    grid = s // p
    conv_init = nn.initializers.lecun_normal()
    # The patch rows, columns and channels have no logical name: they stay whole.
    x = nn.Conv(w, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=nn.with_logical_partitioning(conv_init, (None, None, None, "embed")),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                name="patch_embed")(pixels.astype(self.dtype))            # [N, G, G, W]
    x = x.reshape(x.shape[0], grid * grid, w)                              # row-major patches
    pos = self.param("pos_embed", nn.with_logical_partitioning(
        nn.initializers.normal(stddev=w ** -0.5), ("length", "embed")), (grid * grid, w),
                     self.param_dtype)
    x = x + pos.astype(self.dtype)[None]

    x = encoder_layers(self, VisionLayer, x)
    x = _layer_norm(c.layer_norm_eps, self.param_dtype, "final_norm")(x).astype(self.dtype)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


def pool_patches(x: jax.Array, tokens_per_image: int) -> jax.Array:
  """Average pooling of the row-major patch grid: [N, P, W] -> [N, M, W] (in float32)."""
  n, p, w = x.shape
  grid, side = math.isqrt(p), math.isqrt(tokens_per_image)
  k = grid // side
  x = x.astype(jnp.float32).reshape(n, side, k, side, k, w)
  return x.mean(axis=(2, 4)).reshape(n, side * side, w)


class VisionProjector(nn.Module):
  """Patch features [N, P, W] -> soft tokens [N, M, D]: pool, RMSNorm (1 + scale), x [W, D]."""
  config: config_dict.ConfigDict
  out_width: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    x = pool_patches(x, c.tokens_per_image)
    x = RMSNorm(c.layer_norm_eps, plus_one=True, param_dtype=self.param_dtype, name="norm")(x)
    # One array cannot name "embed" twice: the vision width stays whole here.
    x = Linear((self.out_width,), (None, "embed"), dtype=self.dtype,
               param_dtype=self.param_dtype, name="proj")(x.astype(self.dtype))
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class VisionTower(TowerModule):
  """Images -> soft tokens in the text width; fields of `TowerModule`, and out_width (D,
  the text model's width; keyword only)."""
  out_width: int = dataclasses.field(kw_only=True)

  def setup(self):
    self.encoder = VisionEncoder(*self.settings())
    self.projector = VisionProjector(self.config, self.out_width, self.dtype, self.param_dtype)

  def __call__(self, pixels: jax.Array) -> jax.Array:
    """pixels [..., S, S, C] (normalised, see image_inputs) -> soft tokens [..., M, D]."""
    c = self.config
    chex.assert_axis_dimension(pixels, -1, c.num_channels)
    chex.assert_axis_dimension(pixels, -2, c.image_size)
    chex.assert_axis_dimension(pixels, -3, c.image_size)
    x = self.projector(self.encoder(pixels.reshape((-1,) + pixels.shape[-3:])))
    return x.reshape(pixels.shape[:-3] + x.shape[1:])


# ----------------------------------------------------------------------------- merge helpers


def image_span_ids(tokens: jax.Array, image_token_id: int) -> jax.Array:
  """tokens [B, T] -> [B, T] int32: k > 0 on the k-th run of image placeholders of a row,
  0 elsewhere; the span ids `attention_mask(..., q_spans, kv_spans)` makes bidirectional."""
  is_image = tokens == image_token_id
  starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(is_image, jnp.cumsum(starts, axis=1), 0).astype(jnp.int32)


def merge_soft_tokens(embeddings: jax.Array, tokens: jax.Array, soft_tokens: jax.Array,
                      image_token_id: int) -> jax.Array:
  """Replaces the placeholder positions of each row by that row's soft tokens, in order.

  Args:
    embeddings: [B, T, D] token embeddings (placeholders embedded as anything).
    tokens: [B, T] ids; positions holding `image_token_id` receive soft tokens.
    soft_tokens: [B, I, M, D], the row's images in order; a row's j-th placeholder
      takes soft token j of the row's flattened [I * M, D]. Rows with fewer
      placeholders leave the remaining images unused (padding images).
  Returns:
    [B, T, D] in the embeddings' dtype.
  """
  b, t, d = embeddings.shape
  chex.assert_shape(tokens, (b, t))
  chex.assert_rank(soft_tokens, 4)
  chex.assert_axis_dimension(soft_tokens, 0, b)
  chex.assert_axis_dimension(soft_tokens, 3, d)
  flat = soft_tokens.reshape(b, -1, d)
  is_image = tokens == image_token_id
  index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, flat.shape[1] - 1)
  gathered = jnp.take_along_axis(flat, index[..., None], axis=1)
  return jnp.where(is_image[..., None], gathered.astype(embeddings.dtype), embeddings)


def check_value_range(values: Any, low: float, high: float, name: str, hint: str) -> None:
  """ValueError naming the first row and image of concrete `values` [B, I, ...] that hold
  a value that is not finite or lies outside [low, high] (by more than rounding); nothing
  for traced values."""
  if isinstance(values, jax.core.Tracer):
    return
  v = np.asarray(values, np.float32)
  bad = ~np.isfinite(v) | (v < low - 1e-3) | (v > high + 1e-3)
  if bad.any():
    row, image = np.argwhere(bad.reshape(v.shape[0], v.shape[1], -1).any(-1))[0]
    held = v[row, image]
    finite = held[np.isfinite(held)]
    found = " and ".join(([f"values in [{finite.min():g}, {finite.max():g}]"] if finite.size
                          else []) + (["NaN or inf"] if finite.size < held.size else []))
    raise ValueError(f"{name} row {row}, image {image} holds {found}, where [{low:g}, "
                     f"{high:g}] is expected: {hint}")


def check_image_inputs(tokens: Any, images: Any, config: config_dict.ConfigDict) -> None:
  """Raises ValueError naming what is wrong with images [B, I, S, S, C] for tokens [B, T]:
  the type, the shape, pixels outside [-1, 1] (when concrete), or (when the ids are
  concrete) a placeholder span of the wrong length or a
  row with more spans than images. `config` is the vision section (of a model with
  vision: `towers.check_image_inputs` checks that)."""
  b = tokens.shape[0]
  if images is not None:
    if isinstance(images, tuple) or not hasattr(images, "ndim"):
      raise ValueError(f"images of a Gemma 3 model are pixels [B, I, S, S, C] (gemma_jax."
                       f"image_inputs.preprocess_images), got {type(images).__name__}")
    expected = (b, None, config.image_size, config.image_size, config.num_channels)
    if images.ndim != 5 or any(e not in (None, g) for e, g in zip(expected, images.shape)):
      raise ValueError(f"images must be [batch={b}, images, {config.image_size}, "
                       f"{config.image_size}, {config.num_channels}], got shape {images.shape}")
    if not jnp.issubdtype(images.dtype, jnp.floating):
      raise ValueError(f"images must hold float pixels (gemma_jax.models.gemma3.images), got dtype "
                       f"{images.dtype}")
    check_value_range(images, -1.0, 1.0, "images",
                      "gemma_jax.models.gemma3.images.preprocess_images maps 0..255 to [-1, 1]")
  if isinstance(tokens, jax.core.Tracer):
    return
  spans = np.asarray(image_span_ids(jnp.asarray(tokens), config.image_token_id))
  available = 0 if images is None else images.shape[1]
  for row in range(b):
    count = int(spans[row].max(initial=0))
    lengths = np.bincount(spans[row], minlength=count + 1)[1:]
    if count > available:
      raise ValueError(f"tokens row {row} holds {count} image placeholder spans but "
                       f"{available} images were given")
    for k, length in enumerate(lengths):
      if length != config.tokens_per_image:
        raise ValueError(f"tokens row {row}: image placeholder span {k} holds {length} "
                         f"image_token_id ids, not tokens_per_image={config.tokens_per_image}")
