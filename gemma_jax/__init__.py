"""gemma_jax: Gemma 3 in pure Flax Linen, as two pure functions.

    import gemma_jax as gj
    config = gj.get_config("gemma3-1b")
    model = gj.transform(config)
    params = model.init(jax.random.key(0), tokens)
    logits = model.apply(params, tokens)
"""

from gemma_jax import hf
from gemma_jax.config import ConfigError, default_config, validate
from gemma_jax.presets import PRESETS, get_config
from gemma_jax.transformer import Transformed, transform

__all__ = ["ConfigError", "PRESETS", "Transformed", "default_config", "get_config", "hf",
           "transform", "validate"]
