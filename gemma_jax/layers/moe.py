"""Mixture of experts in Gemma 4's form: a shared dense MLP beside top-k routed experts.

    y = post_shared(mlp(pre_shared(x))) + post_routed(experts(pre_routed(x), router(x)))

x is the residual stream; each branch has its own pre- and post-norm, and the router
reads x itself (not a normed copy). Dims: B batch, T length, D model width,
M = B * T tokens, E experts, k experts per token, F an expert's hidden width.

Auxiliary outputs are sown into the "intermediates" collection, one value per layer:
`expert_load` [E] always, and the weighted `load_balance_loss` and `router_z_loss`
when their weights are positive. `summarize` averages them over the layers.
"""

import functools
from typing import Dict, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma_jax.layers import expert_dispatch, expert_parallel
from gemma_jax.layers.linear import Linear, float_param
from gemma_jax.layers.mlp import GatedMlp, gated_activation
from gemma_jax.layers.norms import RMSNorm

LOSSES = ("load_balance_loss", "router_z_loss")
EXPERT_WEIGHTS = ("gate", "up", "down")   # an `Experts`' parameters, [E, ...] each


class Routing(NamedTuple):
  """The router's decision for M tokens, all float32 but the ids."""
  logits: jax.Array        # [M, E]
  probs: jax.Array         # [M, E] softmax of the logits
  expert_ids: jax.Array    # [M, k] int32, the k likeliest experts
  weights: jax.Array       # [M, k] their probabilities renormalised, times per-expert scales


def expert_load(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """[M, k] -> [E]: the fraction of the M * k assignments each expert receives."""
  counts = jnp.bincount(expert_ids.reshape(-1), length=num_experts)
  return counts.astype(jnp.float32) / expert_ids.size


def load_balance_loss(routing: Routing) -> jax.Array:
  """E * sum_e load_e * mean router probability_e: 1 when routing is uniform (Switch)."""
  num_experts = routing.probs.shape[-1]
  load = jax.lax.stop_gradient(expert_load(routing.expert_ids, num_experts))
  return num_experts * jnp.sum(load * jnp.mean(routing.probs, axis=0))


def router_z_loss(routing: Routing) -> jax.Array:
  """Mean over tokens of logsumexp(router logits)^2 (ST-MoE)."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


class Router(nn.Module):
  """RMSNorm without scale of x, times a learned scale and D^-0.5, projected to E
  logits; float32 softmax; top-k, renormalised, times a learned per-expert scale."""
  num_experts: int
  experts_per_token: int
  norm_eps: float = 1e-6
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> Routing:
    """x: [M, D] -> Routing; computed in float32 whatever x's dtype."""
    d = x.shape[-1]
    ones = lambda axes: nn.with_logical_partitioning(nn.initializers.ones_init(), axes)
    scale = self.param("scale", ones(("norm",)), (d,), self.param_dtype)
    h = RMSNorm(self.norm_eps, with_scale=False)(x.astype(jnp.float32))
    h = h * scale.astype(jnp.float32) * d ** -0.5
    logits = Linear((self.num_experts,), ("embed", None), dtype=jnp.float32,
                    param_dtype=self.param_dtype, name="proj")(h)
    probs = jax.nn.softmax(logits, axis=-1)
    top, expert_ids = jax.lax.top_k(probs, self.experts_per_token)
    per_expert_scale = self.param("per_expert_scale", ones((None,)), (self.num_experts,),
                                  self.param_dtype)
    weights = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = weights * per_expert_scale.astype(jnp.float32)[expert_ids]
    return Routing(logits, probs, expert_ids, weights)


class Experts(nn.Module):
  """E gated MLPs (gate, up: [E, D, F]; down: [E, F, D]) run on the routed tokens; under
  a mesh with an `expert` axis, each of its devices runs its own experts
  (`expert_parallel`).

  Attributes:
    dispatch: a name in `expert_dispatch.DISPATCHES`, or "auto".
  """
  # The methods a method interceptor may replace (gemma_jax.quant.projections): their
  # names and signatures are part of this class's interface.
  HOOKS = ("weights", "hidden", "__call__")
  num_experts: int
  mlp_dim: int
  activation: str = "gelu_tanh"
  dispatch: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, routing: Routing) -> jax.Array:
    """x: [M, D] -> [M, D], the weighted sum of each token's k experts."""
    gate, up, down = self.weights(x.shape[-1])
    dispatch = functools.partial(expert_dispatch.for_rows, self.dispatch)
    sharded = expert_parallel.expert_shards(x.shape[0]) > 1
    if isinstance(gate, tuple):   # one array per expert (`split_experts`)
      if not sharded and dispatch(routing.expert_ids.size, self.num_experts) is (
          expert_dispatch.sliced):
        return expert_dispatch.switched(x.astype(self.dtype), routing.expert_ids,
                                        routing.weights, gate, up, down, self.hidden)
      gate, up, down = (jnp.stack(w) for w in (gate, up, down))
    args = (x.astype(self.dtype), routing.expert_ids, routing.weights, gate, up, down,
            self.hidden)
    if sharded:
      return expert_parallel.run_sharded(dispatch, *args)
    return dispatch(routing.expert_ids.size, self.num_experts)(*args)

  def weights(self, d: int):
    """gate, up [E, D, F] and down [E, F, D] in the compute dtype, or as E arrays each
    where the parameters hold them so (`split_experts`) (a hook: quantization stores
    them otherwise)."""
    if self.has_variable("params", "gate") and isinstance(
        self.get_variable("params", "gate"), tuple):   # `split_experts`'s layout
      return tuple(tuple(w.astype(self.dtype) for w in self.get_variable("params", name))
                   for name in EXPERT_WEIGHTS)
    e, f = self.num_experts, self.mlp_dim
    weight = lambda name, shape, axes: float_param(
        self, name, nn.with_logical_partitioning(nn.initializers.variance_scaling(
            1.0, "fan_in", "normal", in_axis=1, out_axis=2, batch_axis=(0,)), axes),
        shape, self.param_dtype).astype(self.dtype)
    return (weight("gate", (e, d, f), ("expert", "embed", "mlp")),
            weight("up", (e, d, f), ("expert", "embed", "mlp")),
            weight("down", (e, f, d), ("expert", "mlp", "embed")))

  def hidden(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """An expert's hidden activations from its gate and up projections [.., F] (a hook:
    int8 training quantizes them)."""
    return gated_activation(self.activation, gate, up)


def split_experts(params: dict) -> dict:
  """The parameters with every `Experts`' gate, up and down [E, ...] as a tuple of E
  arrays (scanned stacks [blocks, E, ...] and other layouts are left as they are).

  For decoding on the CPU (`decoding.make_decoding`'s `unrolled`): a token routed to a
  few experts then reads their arrays where they lie (`expert_dispatch.switched`), where
  XLA's CPU backend copies each slice of the stack before its product, which doubled a
  decoded token's time. Costs one copy of the experts, which unstacking scanned layers
  makes anyway.
  """
  def visit(tree):
    if not isinstance(tree, dict):
      return tree
    if set(tree) == set(EXPERT_WEIGHTS) and all(
        getattr(tree[n], "ndim", 0) == 3 for n in EXPERT_WEIGHTS):
      return {n: tuple(tree[n]) for n in EXPERT_WEIGHTS}
    return {k: visit(v) for k, v in tree.items()}
  return visit(params)


class MoeBlock(nn.Module):
  """The residual stream [B, T, D] -> the shared MLP's plus the experts' output [B, T, D]."""
  mlp_dim: int
  num_experts: int
  experts_per_token: int
  expert_mlp_dim: int
  activation: str = "gelu_tanh"
  dispatch: str = "auto"
  load_balance_loss_weight: float = 0.0
  router_z_loss_weight: float = 0.0
  norm_eps: float = 1e-6
  norm_plus_one: bool = True
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    norm = lambda name: RMSNorm(self.norm_eps, plus_one=self.norm_plus_one,
                                param_dtype=self.param_dtype, name=name)
    shared = GatedMlp(self.mlp_dim, self.activation, dtype=self.dtype,
                      param_dtype=self.param_dtype, name="shared")(norm("pre_shared_norm")(x))
    shared = norm("post_shared_norm")(shared)

    tokens = x.reshape(-1, x.shape[-1])                                     # [M, D]
    routing = Router(self.num_experts, self.experts_per_token, self.norm_eps,
                     self.param_dtype, name="router")(tokens)
    routed = Experts(self.num_experts, self.expert_mlp_dim, self.activation, self.dispatch,
                     self.dtype, self.param_dtype, name="experts")(
                         norm("pre_routed_norm")(tokens), routing)
    routed = norm("post_routed_norm")(routed.reshape(x.shape))

    self.sow("intermediates", "expert_load", expert_load(routing.expert_ids, self.num_experts))
    if self.load_balance_loss_weight:
      self.sow("intermediates", "load_balance_loss",
               self.load_balance_loss_weight * load_balance_loss(routing))
    if self.router_z_loss_weight:
      self.sow("intermediates", "router_z_loss",
               self.router_z_loss_weight * router_z_loss(routing))
    return shared + routed


def summarize(intermediates: dict) -> Dict[str, object]:
  """Sown values of every MoE layer -> {"losses": {name: mean over layers},
  "expert_load": [E] mean over layers}; {"losses": {}} for a dense model.

  A scanned block's values carry a leading block axis; an unscanned layer's do not.
  """
  found = {}
  for path, values in flax.traverse_util.flatten_dict(intermediates).items():
    name = path[-1]
    if name in LOSSES or name == "expert_load":
      rank = 1 if name == "expert_load" else 0
      for value in values:
        found.setdefault(name, []).append(value.reshape((-1,) + value.shape[value.ndim - rank:]))
  summary = {"losses": {name: jnp.mean(jnp.concatenate(found[name]))
                        for name in LOSSES if name in found}}
  if "expert_load" in found:
    summary["expert_load"] = jnp.mean(jnp.concatenate(found["expert_load"]), axis=0)
  return summary
