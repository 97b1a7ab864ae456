"""Quantization: int8 / int4 weights, int8 training, int8 KV caches (see README).

    config, params = gemma_jax.quant.quantize(config, float_params, "int4_weights")
"""

from gemma_jax.quant.projections import STORED as STORED_MODES
from gemma_jax.quant.ptq import float_config, quantize
