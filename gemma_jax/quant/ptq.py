"""Post-training quantization: float parameters -> stored integer weights and scales."""

import functools
from typing import Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax.decoder import Decoder
from gemma_jax.quant import projections
from gemma_jax.quant.projections import STORED


def float_config(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """A copy of `config` whose model holds float weights (a stored-weight `quant` undone;
  "int8" training rounds float weights and stays)."""
  config = config_dict.ConfigDict(config.to_dict())
  if config.model.quant in STORED:
    config.model.quant = "none"
  return config


def quantize(config: config_dict.ConfigDict, params: dict,
             mode: str = "int8_weights") -> Tuple[config_dict.ConfigDict, dict]:
  """Float `params` of `config`'s model -> (the config with `model.quant = mode`, the
  parameters with every quantized projection's weight held as int8 (int4: two per
  uint8) plus its float32 scales). Other parameters are the same arrays' values.

  Args:
    config: the float parameters' config (its `quant` "none", or "int8": a model
      trained with int8 rounding).
    params: float parameters (from `init`, `hf.load`, a workdir), on the host, a device
      or a mesh (the quantized ones come back with XLA's placement of the same).
    mode: "int8_weights" or "int4_weights" (groups of `model.quant_group_size`).

  Raises:
    ConfigError (model.quant): `mode` is not a stored-weight mode.
    ValueError: `params` already hold integer weights (naming the first one).
  """
  if mode not in STORED:
    raise config_lib.ConfigError("model.quant", f"quantize makes stored weights: mode must "
                                 f"be one of {tuple(STORED)}, got {mode!r}")
  for path, leaf in flax.traverse_util.flatten_dict(params).items():
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(f"params are already quantized: {'/'.join(path)} holds {leaf.dtype} "
                       f"(config model.quant={config.model.quant!r})")
  quantized = config_dict.ConfigDict(config.to_dict())
  quantized.model.quant = mode
  quantized.model.remat_policy = "none"
  config_lib.validate(quantized)
  model = config_dict.FrozenConfigDict(quantized.model)
  module = Decoder(model)   # adapters, if any, pass through
  tokens = jnp.zeros((1, 1), jnp.int32)

  @functools.partial(jax.jit, donate_argnums=())
  def run(params):
    # One token through the model with "params" mutable: each quantized projection
    # finds its weight float and replaces it by values and scales.
    with nn.intercept_methods(projections.interceptor(model)):
      _, state = module.apply({"params": params}, tokens, tokens, tokens + 1,
                              mutable=["params"])
    return state["params"]

  result = run(params)
  quantized.model.remat_policy = config.model.remat_policy
  return quantized, result
