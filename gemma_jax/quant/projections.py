"""Quantized projections: `config.model.quant` applied through the hooks `Linear` and
`Experts` declare (`HOOKS`: `kernel`, `product`; `weights`, `hidden`, `__call__`).

  int8, fp8      weights and activations quantized (weights per output channel,
                 activations per row), gradients straight through: training. A `Linear`
                 takes its product in the quantized type (int8: int32 accumulation);
                 the experts' grouped matmuls, which every dispatch runs its own way,
                 take the same rounded values in the compute dtype.
  int8_weights,  the weights stored as integers plus float32 scales ("{name}_scale"
  int4_weights   beside "{name}"): per output channel, int4 in groups of
                 `quant_group_size` along the last contracting axis, two to a byte;
                 dequantized where used. Serving; `gemma_jax.quant.quantize` turns float
                 parameters into them.

Quantized: every projection of attention, MLPs and experts; the untied logits with
`quant_logits`. Float: embeddings, norms, the router, the vision tower.
"""

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_dict

from gemma_jax.config import ConfigError
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.moe import Experts
from gemma_jax.quant import numerics

STORED = {"int8_weights": "int8", "int4_weights": "int4"}     # mode -> stored type
COMPUTED = {"int8": "int8", "fp8": "fp8"}                     # mode -> compute type
EXPERT_WEIGHTS = ("gate", "up", "down")
EXPERT_CONTRACTING = (1,)                                     # D of gate/up, F of down


def is_quantized(path: Sequence[str], quant_logits: bool) -> bool:
  """Whether the projection of module `path` is quantized."""
  if "vision" in path or "router" in path:
    return False
  return quant_logits or not path or path[-1] != "logits"


def scale_axes(axes: Sequence[str], shape: Sequence[int], scale_shape: Sequence[int]):
  """The scale's logical axes: the weight's, None where per-channel scales have size 1."""
  return tuple(None if s == 1 and n != 1 else a for a, n, s in zip(axes, shape, scale_shape))


def stored_weight(module: nn.Module, name: str, float_weight: Callable[[], jax.Array],
                  contracting: Sequence[int], model: config_dict.ConfigDict) -> jax.Array:
  """The weight `name`, stored quantized as `name` + `{name}_scale`, dequantized to the
  module's dtype. A float weight found there (`float_weight()` draws one at init; or
  float parameters applied with "params" mutable, see `quant.quantize`) is quantized in
  place first."""
  qtype = STORED[model.quant]
  if not module.has_variable("params", name):
    float_weight()
  current = module.get_variable("params", name)
  w = nn.meta.unbox(current)
  path = "/".join(module.scope.path + (name,))
  if jnp.issubdtype(w.dtype, jnp.floating):
    if not module.is_mutable_collection("params"):
      raise ValueError(f"{path} holds {w.dtype} weights but model.quant={model.quant!r} "
                       "runs stored integers: quantize the parameters first "
                       "(gemma_jax.quant.quantize)")
    _quantize_in_place(module, name, current, contracting, qtype, model.quant_group_size)
  get = lambda n: nn.meta.unbox(module.get_variable("params", n))
  return numerics.dequantize_weight(get(name), get(f"{name}_scale"), contracting, qtype,
                                    module.dtype)


def _quantize_in_place(module, name, current, contracting, qtype, group_size):
  """Replaces the float variable `current` of `name` by its values and `{name}_scale`,
  with logical axes when it has them."""
  w = nn.meta.unbox(current)
  group = group_size if qtype == "int4" else 0
  if qtype == "int4":
    why = numerics.group_error(w.shape[sorted(contracting)[-1] % w.ndim], group)
    if why:
      raise ConfigError("model.quant_group_size",
                        f"{'/'.join(module.scope.path + (name,))}: {why}")
  values, scale = numerics.quantize_weight(w, contracting, qtype, group)
  if isinstance(current, nn.LogicallyPartitioned):
    axes = tuple(current.names)
    values = nn.LogicallyPartitioned(values, axes)
    scale = nn.LogicallyPartitioned(scale, scale_axes(axes, w.shape, scale.shape))
  module.put_variable("params", name, values)
  module.put_variable("params", f"{name}_scale", scale)


def _linear(model, next_fun, args, kwargs, module: Linear, method: str):
  if model.quant in STORED and method == "kernel":
    return stored_weight(module, "kernel", lambda: next_fun(*args, **kwargs),
                         range(module.in_dims), model)
  if model.quant in COMPUTED and method == "product":
    return numerics.quantized_matmul(*args, COMPUTED[model.quant])
  return next_fun(*args, **kwargs)


def _experts(model, next_fun, args, kwargs, module: Experts, method: str):
  if model.quant in STORED and method == "weights":
    floats = {}

    def float_weight(name):
      if not floats:
        floats.update(zip(EXPERT_WEIGHTS, next_fun(*args, **kwargs)))
      return floats[name]
    return tuple(stored_weight(module, name, lambda n=name: float_weight(n),
                               EXPERT_CONTRACTING, model) for name in EXPERT_WEIGHTS)
  if model.quant in COMPUTED:
    qtype = COMPUTED[model.quant]
    if method == "weights":
      return tuple(numerics.fake_quantize(w, EXPERT_CONTRACTING, qtype)
                   for w in next_fun(*args, **kwargs))
    if method == "hidden":
      return numerics.fake_quantize(next_fun(*args, **kwargs), (-1,), qtype)
    if method == "__call__":
      x, routing = args
      return next_fun(numerics.fake_quantize(x, (-1,), qtype), routing, **kwargs)
  return next_fun(*args, **kwargs)


def interceptor(model: config_dict.ConfigDict) -> Callable:
  """An `nn.intercept_methods` interceptor applying `model.quant` (not "none")."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if (isinstance(module, (Linear, Experts)) and context.method_name in module.HOOKS
        and is_quantized(module.scope.path, model.quant_logits)):
      run = _linear if isinstance(module, Linear) else _experts
      return run(model, next_fun, args, kwargs, module, context.method_name)
    return next_fun(*args, **kwargs)
  return intercept
