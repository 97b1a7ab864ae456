"""`Decoder` with `config.model.quant` applied to its projections."""

import flax.linen as nn

from gemma_jax.decoder import Decoder
from gemma_jax.quant import projections


class QuantDecoder(Decoder):
  """`Decoder` whose projections are quantized as `config.quant` says (not "none"); see
  `gemma_jax.quant.projections`. Parameter paths are the plain model's."""

  def __call__(self, *args, **kwargs):
    with nn.intercept_methods(projections.interceptor(self.config)):
      return super().__call__(*args, **kwargs)
