"""What an image becomes before the model: pixels, and placeholder ids in the prompt.

Pixels, as transformers' Gemma 3 image processor makes them: RGB (alpha composited
on white, grey repeated), resized to S x S with Pillow's bilinear filter (antialiased
when shrinking), rescaled to [0, 1], normalised with mean 0.5 and std 0.5 -> float32
[S, S, 3] in [-1, 1], channels last (our `VisionTower` layout; transformers' is
[3, S, S]). The resize is Pillow's algorithm written in numpy, bit-exact for uint8
images, so arrays need no Pillow; Pillow is used (lazily) only to decode image files
other than `.npy`.

Prompt: every image marker (<start_of_image>) becomes the span Gemma 3 was trained on,

    "\n\n" <start_of_image> <image_soft_token> x M <end_of_image> "\n\n"

as transformers' Gemma3Processor writes it, at the text level (`expand_image_markers`,
then tokenize) or on token ids (`insert_image_placeholders`).
"""

import math
import os
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

PRECISION_BITS = 32 - 8 - 2       # Pillow's fixed point for 8-bit resampling
IMAGE_MEAN = (0.5, 0.5, 0.5)      # Gemma 3's processor (IMAGENET_STANDARD_MEAN)
IMAGE_STD = (0.5, 0.5, 0.5)

# ----------------------------------------------------------------------------- pixels


def load_image(path: str) -> np.ndarray:
  """An image file -> uint8 [H, W, 3] (or the array of a `.npy` file, made RGB).

  Raises:
    ImportError when the file is not `.npy` and Pillow is not installed.
    ValueError naming a `.npy` file that holds no plain array (a pickled one is not read:
      loading it could run any code).
  """
  if os.fspath(path).endswith(".npy"):
    try:
      array = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as error:
      raise ValueError(f"{path}: not a .npy file of a plain array ({error})") from None
    return to_rgb(array)
  try:
    from PIL import Image  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError(f"decoding {path} needs Pillow; without it pass a .npy file or an "
                      f"array") from error
  with Image.open(path) as image:
    return to_rgb(image)


def to_rgb(image: Any) -> np.ndarray:
  """A PIL image or an array [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] -> [H, W, 3].

  Transparency is composited onto white, as transformers' `convert_to_rgb` does.
  """
  size = tuple(image.size[::-1] if hasattr(image, "getbands") else np.shape(image)[:2])
  if 0 in size:
    raise ValueError(f"the image is empty: height x width {size}")
  if hasattr(image, "getbands"):  # a PIL image
    from PIL import Image  # pylint: disable=import-outside-toplevel
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      rgba = image.convert("RGBA")
      white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
      return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
    raise ValueError(f"expected an image [H, W], [H, W, 1|3|4], got shape {image.shape}")
  if image.shape[-1] == 1:
    return np.repeat(image, 3, axis=-1)
  if image.shape[-1] == 4:
    white = 255 if np.issubdtype(image.dtype, np.integer) else 1.0
    alpha = image[..., 3:] / white
    rgb = alpha * image[..., :3] + (1 - alpha) * white
    return (np.round(rgb) if white == 255 else rgb).astype(image.dtype)
  return image


class Filter(NamedTuple):
  """A Pillow resampling filter: its kernel (float64 in, float64 out) and support."""
  kernel: Callable[[np.ndarray], np.ndarray]
  support: float


BILINEAR = Filter(lambda x: np.maximum(1.0 - np.abs(x), 0.0), 1.0)   # the triangle


def _coefficients(in_size: int, out_size: int, resample: Filter):
  """Pillow's taps: first index [O], weights [O, K] (float64, rows sum to 1)."""
  scale = in_size / out_size
  filterscale = max(scale, 1.0)
  support = resample.support * filterscale
  ksize = int(math.ceil(support)) * 2 + 1
  center = (np.arange(out_size) + 0.5) * scale
  xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
  count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
  taps = np.arange(ksize)
  x = (taps[None, :] + xmin[:, None] - center[:, None] + 0.5) * (1.0 / filterscale)
  weights = np.where(taps[None, :] < count[:, None], resample.kernel(x), 0.0)
  total = np.zeros(out_size)
  for k in range(ksize):                        # Pillow sums the taps in order
    total = total + weights[:, k]
  weights = np.where(total[:, None] != 0, weights / np.where(total == 0, 1, total)[:, None],
                     weights)
  return xmin, weights


def _resample_axis(image: np.ndarray, axis: int, out_size: int, fixed_point: bool,
                   resample: Filter):
  """One separable pass along `axis` (0 rows, 1 columns) of an [H, W, C] image."""
  in_size = image.shape[axis]
  xmin, weights = _coefficients(in_size, out_size, resample)
  index = np.minimum(xmin[:, None] + np.arange(weights.shape[1])[None, :], in_size - 1)
  if fixed_point:   # rounded half away from zero: a cubic's negative lobes round down
    weights = np.trunc(weights * (1 << PRECISION_BITS) + np.where(weights < 0, -0.5, 0.5))
    weights = weights.astype(np.int64)
    total = np.full((), 1 << (PRECISION_BITS - 1), np.int64)
    source = image.astype(np.int64)
  else:
    total = np.zeros((), np.float64)
    source = image.astype(np.float64)
  for k in range(weights.shape[1]):
    taken = np.take(source, index[:, k], axis=axis)
    w = weights[:, k][:, None, None] if axis == 0 else weights[:, k][None, :, None]
    total = total + taken * w
  if fixed_point:
    return np.clip(total >> PRECISION_BITS, 0, 255).astype(np.uint8)
  return total.astype(np.float32)


def pillow_resize(image: np.ndarray, height: int, width: int, resample: Filter) -> np.ndarray:
  """Pillow's `Image.resize((width, height), filter)` of an [H, W, C] image, in numpy.

  uint8 images go through Pillow's 8-bit fixed-point arithmetic (bit-exact, uint8 out,
  clipped to [0, 255] between the passes); float images as Pillow's mode "F" (float64
  taps, float32 between and after the passes). The pass order is Pillow's (13.0,
  `ImagingResampleInner`): horizontal first, unless the height shrinks by more than
  twice as many pixels as the width does. The order changes the rounding of the 8-bit
  intermediate image.
  """
  image = np.asarray(image)
  fixed_point = image.dtype == np.uint8
  if not fixed_point:
    image = image.astype(np.float32)
  in_height, in_width = image.shape[:2]
  shrink_rows, shrink_cols = in_height - height, in_width - width
  axes = (0, 1) if shrink_rows > 0 and shrink_rows > 2 * shrink_cols else (1, 0)
  for axis in axes:
    size = (height, width)[axis]
    if image.shape[axis] != size:
      image = _resample_axis(image, axis, size, fixed_point, resample)
  return image


def resize_bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """Pillow's `Image.resize((width, height), BILINEAR)`: see `pillow_resize`."""
  return pillow_resize(image, height, width, BILINEAR)


def preprocess_image(image: Union[str, os.PathLike, np.ndarray, Any],
                     image_size: int = 896) -> np.ndarray:
  """An image file, PIL image or array -> normalised float32 pixels [S, S, 3] in [-1, 1].

  Arrays are [H, W], [H, W, 1|3|4]: uint8 (or integers in [0, 255]) as transformers'
  Gemma3ImageProcessor takes them; floats are read as values in [0, 1] and resized
  without quantisation.
  """
  if isinstance(image, (str, os.PathLike)):
    image = load_image(image)
  image = to_rgb(image)
  if np.issubdtype(image.dtype, np.integer) or image.dtype == bool:
    if image.min() < 0 or image.max() > 255:
      raise ValueError(f"integer pixels must lie in [0, 255], got [{image.min()}, {image.max()}]")
    image = image.astype(np.uint8)
    rescale = 1 / 255
  else:
    if image.min() < 0 or image.max() > 1:
      raise ValueError(f"float pixels must lie in [0, 1], got [{image.min()}, {image.max()}]")
    rescale = 1.0
  resized = resize_bilinear(image, image_size, image_size)
  pixels = (resized.astype(np.float64) * rescale).astype(np.float32)
  return (pixels - np.float32(IMAGE_MEAN)) / np.float32(IMAGE_STD)


def preprocess_images(images: Sequence[Any], image_size: int = 896) -> np.ndarray:
  """Several images (files, PIL images or arrays) -> float32 [I, S, S, 3] (I may be 0)."""
  if not images:
    return np.zeros((0, image_size, image_size, 3), np.float32)
  return np.stack([preprocess_image(image, image_size) for image in images])


# ----------------------------------------------------------------------------- prompts


def expand_image_markers(text: str, tokens_per_image: int, *,
                         boi_token: str = "<start_of_image>",
                         eoi_token: str = "<end_of_image>",
                         image_token: str = "<image_soft_token>") -> str:
  """Replaces each `boi_token` in `text` by Gemma3Processor's full image sequence.

  Tokenizing the result with Gemma 3's tokenizer gives exactly transformers' input ids,
  newline merges included.
  """
  span = f"\n\n{boi_token}{image_token * tokens_per_image}{eoi_token}\n\n"
  return text.replace(boi_token, span)


def insert_image_placeholders(ids: Sequence[int], *, boi_token_id: int, eoi_token_id: int,
                              image_token_id: int, tokens_per_image: int,
                              newline_ids: Union[int, Mapping[int, int]]) -> list:
  """Token ids with image markers -> ids with each marker expanded into its span.

  Each `boi_token_id` becomes [nl2, boi, image x M, eoi, nl2], where nl2 is "\\n\\n".
  Gemma3Processor inserts those newlines as text before tokenizing, so a newline run
  already next to the marker merges with them into one longer run (".\\n<boi>" gives
  the "\\n\\n\\n" token). `newline_ids` says which ids are runs: either the id of
  "\\n\\n" alone (no merging), or {run length: id} for the runs the vocabulary holds
  (Gemma 3's tokenizer: the pieces "\\n" * k); a merged run longer than the longest
  known one is split greedily from the left, as the tokenizer's longest match does.
  """
  runs = {2: newline_ids} if isinstance(newline_ids, int) else dict(newline_ids)
  if 2 not in runs:
    raise ValueError(f"newline_ids must give the id of a run of 2 newlines, got {runs}")
  length_of = {token: length for length, token in runs.items()}
  can_merge = len(runs) > 1

  def newline_tokens(count):
    out = []
    while count:
      fits = max((k for k in runs if k <= count), default=None)
      if fits is None:
        raise ValueError(f"no newline run in {sorted(runs)} fits the {count} newlines left")
      out.append(runs[fits])
      count -= fits
    return out

  out, pending = [], 0          # pending: newlines after the last span, not yet written

  def flush():
    nonlocal pending
    out.extend(newline_tokens(pending))
    pending = 0

  for token in ids:
    token = int(token)
    if token == boi_token_id:
      count = pending + 2
      pending = 0
      while can_merge and out and out[-1] in length_of:
        count += length_of[out.pop()]
      out.extend(newline_tokens(count))
      out.extend([boi_token_id] + [image_token_id] * tokens_per_image + [eoi_token_id])
      pending = 2
    elif pending and can_merge and token in length_of:
      pending += length_of[token]
    else:
      flush()
      out.append(token)
  flush()
  return out


def with_markers(row: np.ndarray, count: int, marker_id: int, prompt: int,
                 field: str) -> np.ndarray:
  """A prompt's ids [BOS, ...] holding one `marker_id` per image: as they are when they
  hold `count`, with `count` markers after the BOS when they hold none; otherwise a
  ValueError naming the prompt and the marker's config `field`."""
  row = np.asarray(row)
  markers = int(np.sum(row == marker_id))
  if count and not markers:
    return np.concatenate([row[:1], [marker_id] * count, row[1:]])
  if markers != count:
    raise ValueError(f"prompt {prompt} holds {markers} image markers ({field}={marker_id}) "
                     f"but {count} images were given for it")
  return row


def newline_runs(encode: Callable[[Sequence[str]], list],
                 double_newline_id: int) -> Union[int, Dict[int, int]]:
  """{run length: id} of the newline runs ("\\n" * k) a tokenizer holds as one token
  each, for `insert_image_placeholders`; `double_newline_id` alone where "\\n\\n" is
  not that id's single token (a byte tokenizer: no run merges). encode: texts -> ids."""
  runs = {k: ids[0] for k, ids in enumerate(encode(["\n" * k for k in range(1, 33)]), 1)
          if len(ids) == 1}
  return runs if runs.get(2) == double_newline_id else double_newline_id


def prompts_with_images(rows: Sequence[np.ndarray], images: Sequence[Sequence],
                        vision: Any, encode: Optional[Callable] = None
                        ) -> Tuple[list, np.ndarray]:
  """Prompt ids [BOS, ...] per row and images per row (files, PIL images or arrays) ->
  (rows with each start-of-image marker expanded into its span, pixels [B, I, S, S, C]
  padded with zeros). `vision` is the config's vision section. A row without markers
  gets one per image after its BOS; otherwise markers and images must match one to one.
  `encode` (the tokenizer's: texts -> ids) gives the newline runs that merge with a
  span's newlines, as Gemma3Processor's tokenizing merges them (the chat template's
  "user\\n<start_of_image>"); without it none merge.

  Raises:
    ValueError naming the prompt whose markers and images differ.
  """
  newlines = (vision.double_newline_token_id if encode is None
              else newline_runs(encode, vision.double_newline_token_id))
  expanded = []
  for b, (row, row_images) in enumerate(zip(rows, images)):
    row = with_markers(row, len(row_images), vision.boi_token_id, b, "boi_token_id")
    expanded.append(np.asarray(insert_image_placeholders(
        row, boi_token_id=vision.boi_token_id, eoi_token_id=vision.eoi_token_id,
        image_token_id=vision.image_token_id, tokens_per_image=vision.tokens_per_image,
        newline_ids=newlines), np.int32))
  most = max([1] + [len(row_images) for row_images in images])
  pixels = np.zeros((len(rows), most, vision.image_size, vision.image_size,
                     vision.num_channels), np.float32)
  for b, row_images in enumerate(images):
    if row_images:
      pixels[b, :len(row_images)] = preprocess_images(row_images, vision.image_size)
  return expanded, pixels
