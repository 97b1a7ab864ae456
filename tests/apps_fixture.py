"""A tiny absl app run through gemma_jax.apps, for tests/test_apps.py: prints its
config's train.steps, and logs one INFO line after JAX has picked its backend."""

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from gemma_jax import apps

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  jax.devices()
  logging.info("fixture info line")
  print(f"steps={_CONFIG.value.train.steps} on {jax.default_backend()}")


if __name__ == "__main__":
  apps.run(main)
