"""transformers <-> gemma_jax, the public face of `gemma_jax.checkpoints`:

    config, params = gemma_jax.hf.load("path/to/save_pretrained_dir")
    gemma_jax.hf.save("out_dir", config, params)   # transformers' from_pretrained reads it

See `gemma_jax.checkpoints.hf` for what is read and written, and how.
"""

from gemma_jax.checkpoints import CheckpointError
from gemma_jax.checkpoints.gemma_config import config_from_hf, config_to_hf
from gemma_jax.checkpoints.hf import load, load_config, read_json_object, save

__all__ = ["CheckpointError", "config_from_hf", "config_to_hf", "load", "load_config",
           "read_json_object", "save"]
