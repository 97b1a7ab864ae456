"""A tiny absl app run through gemma_jax.apps, for tests/test_apps.py: prints its
config's train.steps, and logs one INFO line after JAX has picked its backend. With
--compile it also compiles a small program and prints the compilation cache's directory
and whether it loaded any program from there."""

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from gemma_jax import apps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])
_COMPILE = flags.DEFINE_bool("compile", False, "Compile a program; report the cache.")
HITS = "/jax/compilation_cache/cache_hits"   # the event JAX records per program loaded


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  jax.devices()
  logging.info("fixture info line")
  print(f"steps={_CONFIG.value.train.steps} on {jax.default_backend()}")
  if _COMPILE.value:
    hits = []
    jax.monitoring.register_event_listener(lambda event, **_: hits.append(event == HITS))
    jax.jit(lambda x: jnp.cumsum(jnp.sin(x) @ x.T, axis=1))(jnp.ones((8, 8))).block_until_ready()
    cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    print(f"cache={cache} loaded={any(hits)}")


if __name__ == "__main__":
  apps.run(main)
