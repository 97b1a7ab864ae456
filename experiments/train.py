r"""Trains a model from a config file: the first command to run.

    python experiments/train.py --config=configs/gemma3_tiny.py --workdir=runs/tiny
    python experiments/train.py --config=configs/gemma3_tiny.py --workdir=runs/tiny \
        --config.optimizer.learning_rate=3e-4 --config.data.path='books/*.txt'

On several devices add mesh sizes (--config.mesh.fsdp=4 --config.mesh.tensor=2); on
several hosts run the same command on each (see the README). Resumes from the
workdir's latest checkpoint. SIGTERM or Ctrl-C saves a checkpoint and
exits cleanly. Start from published or trained weights, with LoRA if wanted:

    python experiments/train.py --config=configs/gemma3_tiny_lora.py --workdir=runs/lora \
        --config.train.init_from=runs/tiny_hf --config.data.path=configs/data/chat_small.jsonl

A bad config, missing data, a workdir in use or a diverging loss ends with one error line.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from gemma_jax import apps, sharding
from gemma_jax.config import ConfigError
from gemma_jax.workdir import WorkdirError
from gemma_jax.training import loop
from gemma_jax.training.checkpoints import CheckpointError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Model fields set by flags (--config.model.X, --noconfig.model.X, a --flagfile's):
  # from a checkpoint only compute options may be.
  overridden = {path.split(".")[1] for path in config_flags.get_override_values(
      flags.FLAGS["config"]) if path.startswith("model.")}
  try:
    sharding.maybe_initialize_distributed(_CONFIG.value.mesh)
    loop.train(_CONFIG.value, _WORKDIR.value, model_overrides=overridden)
  except (ConfigError, WorkdirError, CheckpointError, loop.TrainingDiverged) as error:
    sys.exit(f"train.py: error: {error}")


if __name__ == "__main__":
  apps.run(main)
