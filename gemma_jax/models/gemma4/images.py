"""What an image becomes before Gemma 4's vision tower: patches, their positions, and
placeholder ids in the prompt.

Dims: p patch side, k pooling kernel, B the soft-token budget (`max_soft_tokens`),
P = B * k^2 patch slots per image, n soft tokens of one image.

Pixels, as transformers' Gemma4ImageProcessor makes them (its Pillow backend,
`Gemma4ImageProcessorPil`, the one transformers uses without torchvision): RGB (alpha
composited on white, grey repeated, see `image_inputs.to_rgb`), resized with Pillow's
bicubic filter to the largest size that keeps the aspect ratio, has sides that are
multiples of k * p and holds at most P patches (`resized_size`; an image of that size
already is not resampled), rescaled to [0, 1] (not normalised: the tower maps them to
[-1, 1]), cut into p x p patches in row-major order, each flattened as (row, column,
channel), and padded with zero patches to P:

    uint8 [H, W, 3] -> [h, w, 3] -> patches [P, 3 p^2] float32,
                                    positions [P, 2] int32: (column, row), (-1, -1) padding

The image gets n = (h / (p k)) * (w / (p k)) soft tokens (`num_soft_tokens`,
`ImagePatches.num_soft_tokens`). The resize
is Pillow's algorithm written in numpy, bit-exact for uint8 images, so arrays need no
Pillow; Pillow is used (lazily) only to decode image files other than `.npy`.

Prompt: every image marker (the image token itself, "<|image|>") becomes the span
Gemma4Processor writes, with no newlines around it:

    <|image> <|image|> x n <image|>

at the text level (`expand_image_markers`, then tokenize) or on token ids
(`insert_image_placeholders`; `prompts_with_images` does it for a batch of prompts and
stacks their images for the model). n differs per image.
"""

import math
import os
from typing import Any, NamedTuple, Sequence, Tuple, Union

import numpy as np

from gemma_jax.models.gemma3 import images as image_inputs

BICUBIC_A = -0.5                  # Pillow's cubic convolution parameter


class ImagePatches(NamedTuple):
  """Preprocessed images, any leading dims (one image: none; a batch for the model:
  [B, I]); a pytree, so it passes through `jax.jit` as the model's `images`."""
  patches: Any                    # [..., P, 3 p^2] float32 in [0, 1]; zeros past n k^2
  positions: Any                  # [..., P, 2] int32 (column, row); (-1, -1) on padding

  def num_soft_tokens(self, pooling_kernel: int) -> np.ndarray:
    """n per image [...]: its patches (not padding) / k^2."""
    real = np.all(np.asarray(self.positions) >= 0, axis=-1)
    return real.sum(axis=-1) // pooling_kernel ** 2


# ----------------------------------------------------------------------------- sizes


def resized_size(height: int, width: int, *, patch_size: int = 16, pooling_kernel: int = 3,
                 max_soft_tokens: int = 280) -> Tuple[int, int]:
  """The size an [height, width] image is resized to: (h, w), multiples of k * p with
  h * w <= P p^2, the largest such for the aspect ratio (transformers'
  `get_aspect_ratio_preserving_size`).

  Both sides are scaled by sqrt(P p^2 / (height * width)) and rounded down to multiples
  of k * p. A side that rounds to 0 becomes k * p and the other floor(ratio) * k * p,
  at most B * k * p.

  Raises:
    ValueError when both sides round to 0 or the result exceeds the budget.
  """
  side = pooling_kernel * patch_size
  max_patches = max_soft_tokens * pooling_kernel ** 2
  target_pixels = max_patches * patch_size ** 2
  factor = math.sqrt(target_pixels / (height * width))
  h = int(math.floor(factor * height / side)) * side
  w = int(math.floor(factor * width / side)) * side
  if h == 0 and w == 0:
    raise ValueError(f"a {height} x {width} image resizes to 0 x 0 (sides are multiples of "
                     f"pooling_kernel * patch_size = {side})")
  longest = max_soft_tokens * side
  if h == 0:
    h, w = side, min(int(math.floor(width / height)) * side, longest)
  elif w == 0:
    h, w = min(int(math.floor(height / width)) * side, longest), side
  if h * w > target_pixels:
    raise ValueError(f"a {height} x {width} image resizes to {h} x {w}, more than "
                     f"{max_patches} patches of {patch_size} x {patch_size}")
  return h, w


def num_soft_tokens(height: int, width: int, *, patch_size: int = 16, pooling_kernel: int = 3,
                    max_soft_tokens: int = 280) -> int:
  """n, the soft tokens of an [height, width] image: (h / (p k)) * (w / (p k))."""
  h, w = resized_size(height, width, patch_size=patch_size, pooling_kernel=pooling_kernel,
                      max_soft_tokens=max_soft_tokens)
  side = pooling_kernel * patch_size
  return (h // side) * (w // side)


# ----------------------------------------------------------------------------- resize


def _cubic(x: np.ndarray) -> np.ndarray:
  """Pillow's bicubic kernel (a = -0.5), its float64 expression order kept."""
  x = np.abs(x)
  a = BICUBIC_A
  near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * a
  return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


BICUBIC = image_inputs.Filter(_cubic, 2.0)


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Pillow's `Image.resize((width, height), BICUBIC)` of a uint8 [H, W, C] image, in
  numpy: its 8-bit fixed-point arithmetic (bit-exact), antialiased when shrinking (see
  `image_inputs.pillow_resize`)."""
  image = np.asarray(image)
  if image.dtype != np.uint8:
    raise ValueError(f"resize_bicubic takes uint8 pixels, got {image.dtype}")
  return image_inputs.pillow_resize(image, height, width, BICUBIC)


# ----------------------------------------------------------------------------- patches


def preprocess_image(image: Union[str, os.PathLike, np.ndarray, Any], *, patch_size: int = 16,
                     pooling_kernel: int = 3, max_soft_tokens: int = 280) -> ImagePatches:
  """An image file, PIL image or integer array ([H, W], [H, W, 1|3|4], values in
  [0, 255]) -> its `ImagePatches` (P = max_soft_tokens * pooling_kernel^2 slots).

  Float arrays are refused: transformers' processor would read them as 0..255 values.
  """
  if isinstance(image, (str, os.PathLike)):
    image = image_inputs.load_image(image)
  image = image_inputs.to_rgb(image)
  if not (np.issubdtype(image.dtype, np.integer) or image.dtype == bool):
    raise ValueError(f"pixels must be integers in [0, 255] (e.g. uint8), got {image.dtype}")
  if image.min() < 0 or image.max() > 255:
    raise ValueError(f"integer pixels must lie in [0, 255], got [{image.min()}, {image.max()}]")
  height, width = resized_size(*image.shape[:2], patch_size=patch_size,
                               pooling_kernel=pooling_kernel, max_soft_tokens=max_soft_tokens)
  pixels = resize_bicubic(image.astype(np.uint8), height, width)
  pixels = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)

  rows, cols, p = height // patch_size, width // patch_size, patch_size
  patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
  col, row = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
  positions = np.stack([col, row], axis=-1).reshape(rows * cols, 2).astype(np.int32)

  slots = max_soft_tokens * pooling_kernel ** 2
  padding = slots - rows * cols
  return ImagePatches(np.pad(patches, ((0, padding), (0, 0))),
                      np.pad(positions, ((0, padding), (0, 0)), constant_values=-1))


def preprocess_images(images: Sequence[Any], *, patch_size: int = 16, pooling_kernel: int = 3,
                      max_soft_tokens: int = 280) -> ImagePatches:
  """Several images (files, PIL images or arrays) -> `ImagePatches` stacked on I (I may
  be 0)."""
  if not images:
    slots = max_soft_tokens * pooling_kernel ** 2
    return ImagePatches(np.zeros((0, slots, 3 * patch_size ** 2), np.float32),
                        np.zeros((0, slots, 2), np.int32))
  each = [preprocess_image(image, patch_size=patch_size, pooling_kernel=pooling_kernel,
                           max_soft_tokens=max_soft_tokens) for image in images]
  return ImagePatches(np.stack([e.patches for e in each]), np.stack([e.positions for e in each]))


# ----------------------------------------------------------------------------- prompts


def expand_image_markers(text: str, num_soft_tokens: Sequence[int], *,
                         image_token: str = "<|image|>", boi_token: str = "<|image>",
                         eoi_token: str = "<image|>") -> str:
  """Replaces the i-th `image_token` of `text` by Gemma4Processor's span for image i,
  boi + image_token * num_soft_tokens[i] + eoi.

  Raises:
    ValueError when the markers and the images differ in number.
  """
  pieces = text.split(image_token)
  if len(pieces) - 1 != len(num_soft_tokens):
    raise ValueError(f"the text holds {len(pieces) - 1} {image_token} markers for "
                     f"{len(num_soft_tokens)} images")
  spans = [f"{boi_token}{image_token * int(n)}{eoi_token}" for n in num_soft_tokens]
  return "".join(piece + span for piece, span in zip(pieces, spans + [""]))


def insert_image_placeholders(ids: Sequence[int], num_soft_tokens: Sequence[int], *,
                              image_token_id: int, boi_token_id: int,
                              eoi_token_id: int) -> list:
  """Token ids with image markers (`image_token_id`) -> ids with the i-th marker expanded
  into [boi, image x num_soft_tokens[i], eoi], as tokenizing `expand_image_markers`'s
  text gives (the markers are special tokens: the text around them tokenizes alike).

  Raises:
    ValueError when the markers and the images differ in number.
  """
  markers = sum(int(token) == image_token_id for token in ids)
  if markers != len(num_soft_tokens):
    raise ValueError(f"the ids hold {markers} image markers for {len(num_soft_tokens)} images")
  counts, out = iter(num_soft_tokens), []
  for token in ids:
    if int(token) == image_token_id:
      out.extend([boi_token_id] + [image_token_id] * int(next(counts)) + [eoi_token_id])
    else:
      out.append(int(token))
  return out


def prompts_with_images(rows: Sequence[np.ndarray], images: Sequence[Sequence],
                        vision: Any) -> Tuple[list, ImagePatches]:
  """Prompt ids [BOS, ...] per row and images per row (files, PIL images or arrays) ->
  (rows with each image marker expanded into its span, `ImagePatches` [B, I, P, ...]
  padded with empty images). `vision` is the config's vision section. A row without
  markers gets one per image after its BOS; otherwise markers and images must match one
  to one.

  Raises:
    ValueError naming the prompt whose markers and images differ.
  """
  budget = dict(patch_size=vision.patch_size, pooling_kernel=vision.pooling_kernel,
                max_soft_tokens=vision.max_soft_tokens)
  slots = vision.max_soft_tokens * vision.pooling_kernel ** 2
  most = max([1] + [len(row_images) for row_images in images])
  patches = np.zeros((len(rows), most, slots, 3 * vision.patch_size ** 2), np.float32)
  positions = np.full((len(rows), most, slots, 2), -1, np.int32)
  expanded = []
  for b, (row, row_images) in enumerate(zip(rows, images)):
    row = image_inputs.with_markers(row, len(row_images), vision.image_token_id, b,
                                    "image_token_id")
    counts = []
    if row_images:
      each = preprocess_images(row_images, **budget)
      patches[b, :len(row_images)], positions[b, :len(row_images)] = each
      counts = each.num_soft_tokens(vision.pooling_kernel)
    expanded.append(np.asarray(insert_image_placeholders(
        row, counts, image_token_id=vision.image_token_id, boi_token_id=vision.boi_token_id,
        eoi_token_id=vision.eoi_token_id), np.int32))
  return expanded, ImagePatches(patches, positions)
