"""optax AdamW with warmup + cosine decay, global-norm clipping and a decay mask."""

import re
from typing import Callable

import jax
import optax
from ml_collections import config_dict


def learning_rate_schedule(config: config_dict.ConfigDict, total_steps: int) -> optax.Schedule:
  """0 -> learning_rate linearly over warmup_steps, then cosine down to
  learning_rate * end_learning_rate_ratio at decay_steps (default: total_steps)."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=total_steps if config.decay_steps is None else config.decay_steps,
      end_value=config.learning_rate * config.end_learning_rate_ratio)


def param_path(path) -> str:
  """A tree path -> "blocks/layer_0/attn/q/kernel" (a named tuple's field by its name)."""
  return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                  for key in path)


def decay_mask(patterns) -> Callable:
  """params -> bool tree: True where no pattern matches the parameter's path."""
  compiled = [re.compile(p) for p in patterns]
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: not any(p.search(param_path(path)) for p in compiled), params)


def make_optimizer(config: config_dict.ConfigDict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
  """Clip by global norm (unless max_grad_norm is 0), then AdamW."""
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask(config.no_decay))
  if not config.max_grad_norm:
    return adamw
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
