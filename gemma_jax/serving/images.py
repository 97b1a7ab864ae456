"""A request's images: its prompt with their placeholder spans, the model's images, and
where a prompt chunk may end.

The engine computes a prompt's soft tokens once, at admission (`towers.soft_embeddings`),
and hands each prefill chunk its slice. Where image spans are bidirectional
(`bidirectional_span_types`), a span's tokens attend to each other both ways, so a
chunk never ends inside one (`chunk_end`) and no span may be longer than a chunk.
"""

import hashlib
from typing import Any, List, Tuple

import jax
import numpy as np
from ml_collections import config_dict

from gemma_jax.models import towers


def prepare(prompt: List[int], images, model: config_dict.ConfigDict, tokenizer,
            prefill_chunk: int) -> Tuple[List[int], Any, bytes]:
  """(the prompt with each image's placeholder span, the model's images [1, I, ...], a
  digest of them for the prefix cache's keys).

  Raises:
    ValueError naming the field: images for a model without vision, markers and images
      that do not match, a span longer than `prefill_chunk` where spans are
      bidirectional.
  """
  if not model.vision.enabled:
    raise ValueError("images were given to a model without vision")
  encode = tokenizer.encode if tokenizer is not None else None
  rows, model_images = towers.prompts_with_images([np.asarray(prompt, np.int32)],
                                                  [list(images)], model, encode)
  tokens = rows[0].tolist()
  towers.check_image_inputs(np.asarray([tokens]), model_images, model)
  longest = max(_span_lengths(tokens, model.vision.image_token_id), default=0)
  if model.bidirectional_span_types and longest > prefill_chunk:
    raise ValueError(f"images: a span of {longest} soft tokens is longer than the engine's "
                     f"prefill_chunk={prefill_chunk}; its tokens attend to each other both "
                     "ways, so one chunk must hold it")
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(model_images):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return tokens, model_images, digest.digest()


def check_text(prompt, model: config_dict.ConfigDict) -> None:
  """Raises ValueError when a prompt without images holds the image placeholder id (it
  would be read as a word)."""
  if model.vision.enabled and model.vision.image_token_id in prompt:
    raise ValueError(f"prompt holds the image placeholder id {model.vision.image_token_id} "
                     "but no images were given")


def chunk_end(tokens: List[int], start: int, end: int, model: config_dict.ConfigDict) -> int:
  """Where a chunk of tokens[start:end] should end instead: before the span it would
  cut, where spans are bidirectional (the span then starts the next chunk)."""
  image = model.vision.image_token_id
  if (not model.vision.enabled or not model.bidirectional_span_types or end >= len(tokens)
      or tokens[end - 1] != image or tokens[end] != image):
    return end
  span_start = end - 1
  while span_start > start and tokens[span_start - 1] == image:
    span_start -= 1
  return span_start if span_start > start else end


def _span_lengths(tokens: List[int], image_token_id: int) -> List[int]:
  lengths, run = [], 0
  for token in tokens + [None]:
    if token == image_token_id:
      run += 1
    elif run:
      lengths.append(run)
      run = 0
  return lengths
