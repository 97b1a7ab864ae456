r"""Trains a model from a config file: the first command to run.

    python experiments/train.py --config=configs/gemma3_tiny.py --workdir=runs/tiny
    python experiments/train.py --config=configs/gemma3_tiny.py --workdir=runs/tiny \
        --config.optimizer.learning_rate=3e-4 --config.data.path='books/*.txt'

On several devices add mesh sizes (--config.mesh.fsdp=4 --config.mesh.tensor=2); on
several hosts run the same command on each (see the README). Resumes from the
workdir's latest checkpoint, once its files match the checksums saved with it.
SIGTERM or Ctrl-C while training saves a checkpoint and exits cleanly; Ctrl-C
before (loading, compiling) exits at once with status 130. Start from published or
trained weights, with LoRA if wanted:

    python experiments/train.py --config=configs/gemma3_tiny_lora.py --workdir=runs/lora \
        --config.train.init_from=runs/tiny_hf --config.data.path=configs/data/chat_small.jsonl

A bad config, missing data, a workdir in use, a damaged checkpoint, a full disk or a
diverging loss ends with one error line; the libraries' reports behind it (orbax's
tracebacks of a failed save) are in WORKDIR/train.log.
"""

import os
import signal
import sys


def _interrupted_while_importing(*_):
  """Ctrl-C in the seconds JAX and the model code take to import, before apps.run takes
  over: one line and status 130, as it gives. Nothing is written yet: the process ends
  at once (an exception raised here could land in a garbage collector callback, which
  ignores it)."""
  os.write(2, b"train.py: interrupted\n")
  os._exit(130)   # pylint: disable=protected-access


if __name__ == "__main__":
  signal.signal(signal.SIGINT, _interrupted_while_importing)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from gemma_jax import apps, sharding
from gemma_jax.config import ConfigError
from gemma_jax.training import loop
from gemma_jax.training.checkpoints import CheckpointError
from gemma_jax.training.workdir import WorkdirError

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs",
                              "gemma3_tiny.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (FILE.py or FILE.py:ARGUMENT); default: "
    "configs/gemma3_tiny.py. --help lists its fields.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["workdir"])
LOG_FILE = "train.log"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Model fields set by flags (--config.model.X, --noconfig.model.X, a --flagfile's):
  # from a checkpoint only compute options may be.
  overridden = {path.split(".")[1] for path in config_flags.get_override_values(
      flags.FLAGS["config"]) if path.startswith("model.")}
  try:
    sharding.maybe_initialize_distributed(_CONFIG.value.mesh)
    # One log per host: train.log, train.1.log, ... (JAX is asked only when there are
    # hosts: asking starts its backend).
    index = jax.process_index() if jax.distributed.is_initialized() else 0
    apps.log_to_file(os.path.join(_WORKDIR.value, f"train.{index}.log" if index else LOG_FILE))
    loop.train(_CONFIG.value, _WORKDIR.value, model_overrides=overridden)
  except (ConfigError, WorkdirError, CheckpointError, loop.TrainingDiverged, OSError) as error:
    sys.exit(f"train.py: error: {error}")


if __name__ == "__main__":
  apps.run(main, default_config=os.path.normpath(DEFAULT_CONFIG))
