"""The pure steps: `train_step(state, batch) -> (state, metrics)` and `eval_step`.

Both take a `forward(params, batch, rng) -> (sums, losses, observed)`: `sums` are the
batch's weighted cross-entropy sums (`loss.TokenLosses`), `losses` maps names to scalar
losses the model wants added to the objective (e.g. MoE load balancing), `observed`
maps names to scalars only to log (e.g. each expert's load); the train step logs both
as aux/<name>. `model_forward` adapts a
`gemma_jax.transform` model.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import optax

from gemma_jax import lora, sharding
from gemma_jax.layers import loss
from gemma_jax.transformer import Transformed

Batch = Dict[str, jax.Array]
Scalars = Dict[str, jax.Array]
Forward = Callable[[Any, Batch, Optional[jax.Array]], Tuple[loss.TokenLosses, Scalars, Scalars]]


class TrainState(NamedTuple):
  """Everything a step changes; a pytree."""
  step: jax.Array        # int32 scalar: optimizer updates applied so far
  params: Any
  opt_state: Any
  rng: jax.Array         # PRNG key, split once per step for dropout


def model_forward(model: Transformed) -> Forward:
  """The model's loss (`Transformed.loss`: the tied logits never formed whole) with its
  auxiliary outputs; rng None runs without dropout.

  The losses are the model's (MoE load balancing and router z-loss, already weighted);
  a MoE model's per-expert load is observed as `expert_load/<e>`, and with
  `record_internal_nn_metrics` each layer's `activation_mean/layer_<i>` (and _stdev,
  _fraction_zero).
  """

  def forward(params, batch, rng):
    sums, aux = model.loss(params, batch["tokens"], batch["targets"],
                           weights=batch["weights"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"], images=batch.get("images"),
                           rng=rng, return_aux=True)
    observed = {}
    if "expert_load" in aux:
      load = jax.lax.stop_gradient(aux["expert_load"])
      observed.update({f"expert_load/{e}": load[e] for e in range(load.shape[0])})
    observed.update(jax.lax.stop_gradient(aux.get("activation_stats", {})))
    return sums, dict(aux["losses"]), observed

  return forward


def trained_part(config) -> Callable[[Any], Any]:
  """params -> the part of them a run trains: the LoRA adapters (`config.lora.rank` > 0),
  else all of them."""
  if not config.lora.rank:
    return lambda params: params
  return lambda params: lora.split(params)[1]


def init_state(model: Transformed, optimizer: optax.GradientTransformation, seed: int,
               seq_len: int, trained: Callable[[Any], Any] = lambda params: params
               ) -> TrainState:
  """Fresh trained parameters (`trained` of the model's, see `trained_part`; under jit
  the rest is never computed) and their optimizer state; parameters and dropout keys
  from `seed`."""
  param_rng, dropout_rng = jax.random.split(jax.random.key(seed))
  params = trained(model.init(param_rng, jnp.zeros((1, seq_len), jnp.int32)))
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), dropout_rng)


def state_shardings(config, optimizer: optax.GradientTransformation, abstract: TrainState,
                    mesh: jax.sharding.Mesh) -> TrainState:
  """Where each part of a train state lives on `mesh`: parameters (the trained part,
  see `trained_part`) and their optimizer slots by the sharding rules, the step, counts
  and the key replicated."""
  params = trained_part(config)(sharding.param_shardings(config, mesh))
  replicated = sharding.replicated(mesh)
  opt_state = sharding.optimizer_state_shardings(optimizer, abstract.opt_state, params, mesh)
  return TrainState(step=replicated, params=params, opt_state=opt_state, rng=replicated)


def make_train_step(forward: Forward, optimizer: optax.GradientTransformation,
                    learning_rate: optax.Schedule, *, grad_accum_steps: int = 1,
                    z_loss: float = 0.0) -> Callable:
  """The train step, accumulating gradients over `grad_accum_steps` micro-batches.

  The objective is (sum of cross-entropy + z_loss * sum of log(Z)^2) / (weight of the
  whole batch) + the mean over micro-batches of each auxiliary loss, so accumulating
  gives the gradient of one large batch. Micro-batch i holds rows i, i + A, i + 2A, ...
  of the batch (A = grad_accum_steps).
  """

  def micro_step(params, micro, rng, total_weight):
    def objective(params):
      sums, losses, observed = forward(params, micro, rng)
      losses = {name: value / grad_accum_steps for name, value in losses.items()}
      # Without a z-loss its sum stays out of the objective: the loss's backward pass
      # then sees a symbolic zero and compiles no z-loss gradient at all.
      penalty = z_loss * sums.z_loss if z_loss else 0.0
      value = (sums.cross_entropy + penalty) / total_weight + sum(losses.values())
      observed = {name: value / grad_accum_steps for name, value in observed.items()}
      return value, (sums, {**losses, **observed})

    (_, (sums, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return grads, sums, aux

  def train_step(state: TrainState, batch: Batch) -> Tuple[TrainState, Dict[str, jax.Array]]:
    """batch: dict of [B, T] arrays (see `gemma_jax.training.data`), and for an image
    model optionally "images" [B, I, S, S, C] -> (state, metrics); the metrics' loss
    is that of the parameters before the update, "params_finite" tells whether the
    updated ones are all finite."""
    rng, step_rng = jax.random.split(state.rng)
    total_weight = jnp.maximum(jnp.sum(batch["weights"], dtype=jnp.float32), 1.0)
    # Micro-batch i takes rows i, i + A, i + 2A, ... (A = grad_accum_steps): a mesh
    # splits the batch's rows into contiguous runs, one per device, so each micro-batch
    # takes an equal share of every device's rows and none moves. Contiguous micro-batches
    # each lay on a few devices and were spread out again at every micro-step.
    micro_batches = jax.tree.map(
        lambda x: x.reshape(-1, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(totals, inputs):
      index, micro = inputs
      out = micro_step(state.params, micro, jax.random.fold_in(step_rng, index), total_weight)
      return jax.tree.map(jnp.add, totals, out), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        micro_step, state.params, first, step_rng, total_weight))
    (grads, sums, aux), _ = jax.lax.scan(
        accumulate, zeros, (jnp.arange(grad_accum_steps), micro_batches))

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": sums.cross_entropy / total_weight,
               "grad_norm": optax.tree.norm(grads),
               "params_finite": jnp.all(jnp.stack(
                   [jnp.isfinite(p).all() for p in jax.tree.leaves(params)])),
               "learning_rate": learning_rate(state.step),
               "target_tokens": sums.weight,
               **{f"aux/{name}": value for name, value in aux.items()}}
    if z_loss:
      metrics["z_loss"] = sums.z_loss / total_weight
    return TrainState(state.step + 1, params, opt_state, rng), metrics

  return train_step


def make_eval_step(forward: Forward) -> Callable:
  """eval_step(params, batch) -> loss.TokenLosses sums, without dropout."""

  def eval_step(params, batch: Batch) -> loss.TokenLosses:
    sums, _, _ = forward(params, batch, None)
    return sums

  return eval_step
