"""Low-rank adapters (LoRA) on the model's projections, chosen by parameter path.

With `config.lora.rank` r > 0, every `Linear` whose kernel path (e.g.
"blocks/layer_0/attn/q/kernel") matches one of `config.lora.targets` gets two more
parameters beside its kernel W [*I, *O] (I: the contracted input dims, O: the output
dims):

    lora_a [*I, r]   logical axes: the kernel's input axes + "lora_rank"
    lora_b [r, *O]   logical axes: "lora_rank" + the kernel's output axes

and computes y = x W + (alpha / r) (dropout(x) A) B. The adapter path runs on the
activations (x A is [..., r]), so training the adapters never forms a gradient of W.
A is initialised by variance scaling over its fan-in, B to zeros: a fresh adapter
changes nothing. Under `nn.scan` the adapters are stacked on the leading "layers" axis
like the kernels they adapt. The layers and `Linear` are untouched: the model runs
inside `adapting(...)`, an `nn.intercept_methods` that adds the adapters to targeted
`Linear` calls (`transformer.decoder_module` enters it), so parameter paths stay those
of the plain model.

Fine-tuning keeps the base frozen and trains the adapters only:

    base, adapters = lora.split(params)            # or lora.init_adapters(config, rng)
    grads = jax.grad(lambda a: loss(model.apply(lora.combine(base, a), ...)))(adapters)
    merged = lora.merge(config, params)            # run with lora.disabled(config)
"""

import contextlib
import functools
import math
import re
from typing import Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.config import ConfigError
from gemma_jax.decoder import Decoder
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.matmul import matmul

ADAPTER_NAMES = ("lora_a", "lora_b")
RANK_AXIS = "lora_rank"


def _adapt(lora: config_dict.FrozenConfigDict, deterministic: bool, matched: set,
           next_fun, args, kwargs, context):
  """An `nn.intercept_methods` interceptor: a targeted `Linear.__call__` gets its
  adapters (created in the Linear's own scope) and adds their low-rank update."""
  module = context.module
  if not isinstance(module, Linear) or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  path = "/".join(module.scope.path + ("kernel",))
  hits = {pattern for pattern in lora.targets if re.search(pattern, path)}
  y = next_fun(*args, **kwargs)
  if not hits:
    return y
  matched.update(hits)
  x, = args
  r, k = lora.rank, module.in_dims
  in_shape, out_shape = x.shape[x.ndim - k:], tuple(module.out_shape)
  axes = tuple(module.axes)
  init_a = nn.initializers.variance_scaling(1.0, "fan_in", "normal",
                                            in_axis=tuple(range(k)), out_axis=k)
  a = module.param("lora_a", nn.with_logical_partitioning(init_a, axes[:k] + (RANK_AXIS,)),
                   in_shape + (r,), module.param_dtype)
  b = module.param("lora_b", nn.with_logical_partitioning(
      nn.initializers.zeros_init(), (RANK_AXIS,) + axes[k:]), (r,) + out_shape,
                   module.param_dtype)
  if lora.dropout and not deterministic:
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - lora.dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - lora.dropout), 0.0).astype(x.dtype)
  rows = x.shape[:x.ndim - k]
  # A's gradient x^T dh goes through `matmul`, which on a CPU transposes the narrow dh
  # [rows, r], not x; B's, h^T d, has the small side transposed already.
  h = matmul(x.reshape(math.prod(rows), math.prod(in_shape)).astype(module.dtype),
             a.reshape(-1, r).astype(module.dtype))                      # [rows, r]
  delta = jnp.matmul(h, b.reshape(r, -1).astype(module.dtype)) * (lora.alpha / r)
  return y + delta.reshape(rows + out_shape).astype(y.dtype)


@contextlib.contextmanager
def adapting(lora: config_dict.FrozenConfigDict, deterministic: bool = True):
  """Within it, every targeted `Linear` call gets its adapters (rank > 0), created in the
  Linear's own scope at init; yields the set of target patterns that matched a kernel
  (`check_matched` it after an init)."""
  matched = set()
  with nn.intercept_methods(functools.partial(_adapt, lora, deterministic, matched)):
    yield matched


def check_matched(lora: config_dict.FrozenConfigDict, matched: set) -> None:
  """ConfigError (lora.targets) naming a target pattern that matched no kernel."""
  for pattern in lora.targets:
    if pattern not in matched:
      raise ConfigError("lora.targets", f"{pattern!r} matches no projection kernel of "
                        f"the model (paths look like 'blocks/layer_0/attn/q/kernel', "
                        f"'layers_7/mlp/down/kernel')")


def disabled(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """A copy of `config` with lora.rank 0: the config that runs merged parameters."""
  config = config_dict.ConfigDict(config.to_dict())
  config.lora.rank = 0
  config.lock()
  return config


def _is_adapter(path: Tuple[str, ...]) -> bool:
  return path[-1] in ADAPTER_NAMES


def split(params: dict) -> Tuple[dict, dict]:
  """params -> (base: everything but the adapters, adapters: the lora_a / lora_b leaves),
  both nested as `params`."""
  flat = flax.traverse_util.flatten_dict(params)
  base = {p: v for p, v in flat.items() if not _is_adapter(p)}
  adapters = {p: v for p, v in flat.items() if _is_adapter(p)}
  return (flax.traverse_util.unflatten_dict(base),
          flax.traverse_util.unflatten_dict(adapters))


def combine(base: dict, adapters: dict) -> dict:
  """`split` undone: one parameter tree holding both."""
  flat = flax.traverse_util.flatten_dict(base)
  flat.update(flax.traverse_util.flatten_dict(adapters))
  return flax.traverse_util.unflatten_dict(flat)


def merge(config: config_dict.ConfigDict, params: dict) -> dict:
  """Parameters with adapters -> without: each adapted kernel becomes
  W + (alpha / r) A B (computed in float32, stored in W's dtype). Run the result with
  `disabled(config)` (decoding needs nothing else)."""
  base, adapters = split(params)
  flat = flax.traverse_util.flatten_dict(base)
  flat_adapters = flax.traverse_util.flatten_dict(adapters)
  scale = config.lora.alpha / config.lora.rank
  for path, a in flat_adapters.items():
    if path[-1] != "lora_a":
      continue
    kernel_path = path[:-1] + ("kernel",)
    w, b = flat[kernel_path], flat_adapters[path[:-1] + ("lora_b",)]
    lead = a.shape[:a.ndim + b.ndim - 2 - w.ndim]    # the scanned layers axis, if any
    r = a.shape[-1]
    delta = jnp.matmul(jnp.reshape(a, lead + (-1, r)).astype(jnp.float32),
                       jnp.reshape(b, lead + (r, -1)).astype(jnp.float32))
    flat[kernel_path] = (w.astype(jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)
  return flax.traverse_util.unflatten_dict(flat)


def adapter_shapes(config: config_dict.ConfigDict) -> dict:
  """The adapters' tree of ShapeDtypeStructs (empty when lora.rank is 0), traced without
  computing anything.

  Raises:
    ConfigError (lora.targets): a target regex matches no projection kernel.
  """
  return jax.eval_shape(functools.partial(init_adapters, config), jax.random.key(0))


def check_targets(config: config_dict.ConfigDict) -> None:
  """Raises ConfigError (lora.targets) naming a target regex that matches no projection
  kernel of the model; traces shapes only, so call it before compiling a step."""
  adapter_shapes(config)


def param_count(config: config_dict.ConfigDict) -> int:
  """How many adapter parameters the config adds (0 without LoRA)."""
  return sum(math.prod(s.shape) for s in jax.tree.leaves(adapter_shapes(config)))


def init_adapters(config: config_dict.ConfigDict, rng: jax.Array) -> dict:
  """Fresh adapters (A random, B zero) for a base loaded elsewhere. Jitted, the base's
  random init is dead code that XLA drops: only the adapters are materialised."""
  if not config.lora.rank:
    return {}
  module = Decoder(config_dict.FrozenConfigDict(config.model))
  lora = config_dict.FrozenConfigDict(config.lora)

  @jax.jit
  def init(rng):
    tokens = jnp.ones((1, 1), jnp.int32)
    with adapting(lora) as matched:
      params = module.init(rng, tokens, tokens, tokens)["params"]
    check_matched(lora, matched)
    return split(nn.meta.unbox(params))[1]

  return init(rng)
