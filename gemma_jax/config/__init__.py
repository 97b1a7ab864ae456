"""The one config schema (`schema`: every field, its default and meaning) and its
validation (`validation`), as one namespace:

    config = gemma_jax.config.default_config()   # locked: a misspelt field raises
    gemma_jax.config.validate(config)            # ConfigError naming the first bad field
"""

from gemma_jax.config.schema import (ACTIVATIONS, ATTENTION_KERNELS, ATTENTION_TYPES,
                                     BATCH_AXES, BLOCK_TYPES, DATA_FORMATS, DTYPES,
                                     MESH_AXES, MOE_DISPATCHES, QUANT_MODES, SCAN_UNROLLS,
                                     ConfigError, attention_shape, checkpoint_config,
                                     data_config, default_config, field_notes,
                                     layer_types, lora_config, mesh_config, model_config,
                                     optimizer_config, sample_config, train_config,
                                     vision_config)
from gemma_jax.config.validation import check_sample_fits, validate

__all__ = ["ACTIVATIONS", "ATTENTION_KERNELS", "ATTENTION_TYPES", "BATCH_AXES",
           "BLOCK_TYPES", "DATA_FORMATS", "DTYPES", "MESH_AXES", "MOE_DISPATCHES",
           "QUANT_MODES", "SCAN_UNROLLS", "ConfigError", "attention_shape",
           "check_sample_fits", "checkpoint_config", "data_config", "default_config", "field_notes",
           "layer_types", "lora_config", "mesh_config", "model_config",
           "optimizer_config", "sample_config", "train_config", "validate", "vision_config"]
