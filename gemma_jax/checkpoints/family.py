"""The interface of one transformers family's mapping (`gemma`, `gpt2`): how its
config.json and tensors map onto our config and parameters, layers unrolled."""

from typing import Callable, Dict, NamedTuple, Optional, Set, Tuple, Union

import numpy as np
from ml_collections import config_dict


class Family(NamedTuple):
  """How one transformers family's checkpoints map onto our parameters (paths unrolled)."""
  config_from_hf: Callable[[dict], config_dict.ConfigDict]
  config_to_hf: Callable[[config_dict.ConfigDict], dict]
  # A file's tensors -> (tensors by name below the model, names that belong nowhere).
  model_tensors: Callable[[Dict[str, np.ndarray]], Tuple[Dict[str, np.ndarray], list]]
  tensor_name: Callable[[Tuple[str, ...]], str]          # our path -> name below the model
  layer_of: Callable[[str], Optional[int]]   # a name below the model -> its layer, or None
  # (stored tensor, our path, our shape) -> our parameter, or why it does not fit.
  from_hf: Callable[[np.ndarray, Tuple[str, ...], Tuple[int, ...]], Union[np.ndarray, str]]
  # (our parameter, our path) -> (stored name, part index, stored part).
  to_hf: Callable[[np.ndarray, Tuple[str, ...]], Tuple[str, int, np.ndarray]]
  # The model section -> names of tensors a published checkpoint holds that the model
  # computes nothing from (read past, not reported as unexpected).
  unused_tensors: Callable[[config_dict.ConfigDict], Set[str]]
