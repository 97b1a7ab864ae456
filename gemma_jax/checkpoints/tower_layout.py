"""How a vision tower's parameters map onto transformers' tensors: the machinery both
towers' tables use (gemma_jax/gemma3_tower.py for Gemma 3's, gemma4_tower.py for
Gemma 4's).

A layout names each of our unrolled paths below the tower (`params["vision"]`, encoder
layers as `encoder/layers_{i}`) by one canonical transformers name; every stored layout
of the family maps onto those names by its prefix (`canonical_name`), and `to_hf`
writes the names the family's classes save.
"""

import math
import re
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np


class Tensor(NamedTuple):
  """Where one of our tower parameters lives in transformers' layout."""
  name: str                 # canonical name (below the layer prefix for a layer)
  kind: str = "copy"        # "linear" ([out, in] there), "conv" ([W, C, p, p]), "copy"
  in_dims: int = 1          # a linear kernel's contracted dims here


class TowerLayout(NamedTuple):
  """One family's table of names.

  layer_names: our path below `encoder/layers_{i}` -> its tensor below `layer_prefix`
    with the layer's index.
  top_names: our other paths -> their tensors.
  prefixes: (stored prefix, canonical prefix), longest first.
  saved_name: canonical name -> the name the family's checkpoints are written with.
  """
  layer_names: Mapping[Tuple[str, ...], Tensor]
  top_names: Mapping[Tuple[str, ...], Tensor]
  layer_prefix: str
  prefixes: Sequence[Tuple[str, str]]
  saved_name: Callable[[str], str]

  def canonical_name(self, name: str) -> Optional[str]:
    """A stored tensor name of the tower in any layout -> its canonical name; None for
    other tensors."""
    for stored, canonical in self.prefixes:
      if name.startswith(stored):
        return canonical + name[len(stored):]
    return None

  def tensor(self, path: Tuple[str, ...]) -> Tensor:
    """Our unrolled path below the tower -> its transformers tensor."""
    match = re.fullmatch(r"layers_(\d+)", path[1]) if path[0] == "encoder" else None
    if match:
      tensor = self.layer_names[path[2:]]
      return tensor._replace(name=f"{self.layer_prefix}{match.group(1)}.{tensor.name}")
    return self.top_names[path]

  def tensor_name(self, path: Tuple[str, ...]) -> str:
    """Our unrolled path below the tower -> the canonical transformers name."""
    return self.tensor(path).name

  def from_hf(self, value: np.ndarray, path: Tuple[str, ...],
              shape: Tuple[int, ...]) -> Union[np.ndarray, str]:
    """A stored tensor -> our parameter of `shape` at `path`, or why it does not fit."""
    tensor = self.tensor(path)
    if tensor.kind == "linear":
      value = value.T
      fits = value.shape == (math.prod(shape[:tensor.in_dims]),
                             math.prod(shape[tensor.in_dims:]))
    elif tensor.kind == "conv":
      value = value.transpose(2, 3, 1, 0)   # [W, C, p, p] -> [p, p, C, W]
      fits = value.shape == shape
    else:   # biases of multi-head projections are stored flat
      fits = value.shape == shape or value.shape == (math.prod(shape),)
    if not fits:
      return f"{value.shape} does not fit {shape}"
    return value.reshape(shape)

  def to_hf(self, value: np.ndarray, path: Tuple[str, ...]) -> Tuple[str, np.ndarray]:
    """Our parameter at `path` -> (its saved name, the stored tensor)."""
    tensor = self.tensor(path)
    if tensor.kind == "linear":
      value = value.reshape(math.prod(value.shape[:tensor.in_dims]), -1).T
    elif tensor.kind == "conv":
      value = value.transpose(3, 2, 0, 1)   # [p, p, C, W] -> [W, C, p, p]
    elif path[-1] == "bias":
      value = value.reshape(-1)
    return self.saved_name(tensor.name), value
