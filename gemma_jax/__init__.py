"""gemma_jax: Gemma 3 and 4 in pure Flax Linen, as pure functions.

    import gemma_jax as gj
    config = gj.get_config("gemma3-1b")
    model = gj.transform(config)
    params = model.init(jax.random.key(0), tokens)
    logits = model.apply(params, tokens)
    sums = model.loss(params, tokens)            # next-token cross-entropy sums

On a CPU-only install, importing it sets glibc's malloc to reuse freed memory
(`gemma_jax.host_memory`; GEMMA_JAX_KEEP_FREED_MEMORY=0 leaves malloc alone).
"""

from gemma_jax import host_memory

host_memory.keep_freed_memory_on_cpu()

# pylint: disable=wrong-import-position   (malloc is set before jax is imported)
from gemma_jax import compilation_cache
from gemma_jax import hf
from gemma_jax.config import ConfigError, default_config, validate
from gemma_jax.presets import PRESETS, get_config
from gemma_jax.transformer import Transformed, transform

__all__ = ["ConfigError", "PRESETS", "Transformed", "compilation_cache", "default_config",
           "get_config", "hf", "transform", "validate"]
