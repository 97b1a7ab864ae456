"""The whole model as pure functions: `transform(config) -> Transformed(init, apply, loss)`.

    model = gemma_jax.transform(config)
    params = model.init(jax.random.key(0), tokens)     # a plain pytree of arrays
    logits = model.apply(params, tokens)               # [B, T, V] float32
    logits, aux = model.apply(params, tokens, return_aux=True)   # + auxiliary outputs
    sums = model.loss(params, tokens)           # next-token cross-entropy sums

All are jitted (compiled once per input shape) and compose with jax.jit, jax.grad
and jax.vmap. Parameters carry logical axis names
at init time (see `gemma_jax.sharding`); `init` returns them unboxed.
"""

import contextlib
import functools
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import config as config_lib
from gemma_jax import decoder
from gemma_jax import lora as lora_lib
from gemma_jax.decoder import Decoder
from gemma_jax.layers import activation_stats, chunked_loss, moe
from gemma_jax.layers import loss as loss_lib
from gemma_jax.models import towers
from gemma_jax.models.gemma3 import vision
from gemma_jax.quant import projections


class Transformed(NamedTuple):
  """A model as pure functions: init(rng, tokens) -> params; apply(params, tokens) ->
  logits; loss(params, tokens, targets) -> weighted cross-entropy sums."""
  init: Callable
  apply: Callable
  loss: Callable


class ConfiguredDecoder(Decoder):
  """`Decoder` with what the config adds to its projections, by method interception
  (parameter paths stay the plain model's): LoRA adapters (`lora.adapting`, when `lora`
  is given) over projections quantized as `config.quant` says
  (`quant.projections.interceptor`), either or both.

  Attributes:
    lora: the config's lora section (rank > 0), or None.
  """
  lora: Optional[config_dict.FrozenConfigDict] = None

  def __call__(self, *args, **kwargs):
    with contextlib.ExitStack() as stack:
      matched = (stack.enter_context(lora_lib.adapting(self.lora, self.deterministic))
                 if self.lora is not None else None)
      if self.config.quant != "none":
        stack.enter_context(nn.intercept_methods(projections.interceptor(self.config)))
      out = super().__call__(*args, **kwargs)
    if matched is not None and self.is_initializing():
      lora_lib.check_matched(self.lora, matched)
    return out


def decoder_module(config: config_dict.ConfigDict, deterministic: bool = True) -> Decoder:
  """The module for `config` (its model section, lora and quantization)."""
  model = config_dict.FrozenConfigDict(config.model)
  if not config.lora.rank and model.quant == "none":
    return Decoder(model, deterministic=deterministic)
  lora = config_dict.FrozenConfigDict(config.lora) if config.lora.rank else None
  return ConfiguredDecoder(model, deterministic=deterministic, lora=lora)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
  """[B, T] document ids of packed rows -> [B, T] positions restarting at each document."""
  index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
  starts = jnp.where(
      jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                       segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1), index, 0)
  return index - jax.lax.cummax(starts, axis=1)


def _check_tokens(tokens, vocab_size: int, name: str = "tokens"):
  """Shape and dtype checks always; value checks when the ids are concrete."""
  if tokens.ndim != 2:
    raise ValueError(f"{name} must be [batch, length], got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
  if not isinstance(tokens, jax.core.Tracer):
    values = np.asarray(tokens)
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
      row, col = np.argwhere(bad)[0]
      raise ValueError(f"{name}[{row}, {col}] = {values[row, col]} is outside the "
                       f"vocabulary [0, {vocab_size})")


def _check_positions(positions, table_size: int, name: str = "positions"):
  """When the positions are concrete, that a learned table of `table_size` rows (0: none)
  holds them all; out of range, its lookup would give NaN."""
  if not table_size or isinstance(positions, jax.core.Tracer):
    return
  values = np.asarray(positions)
  if values.size and (values.min() < 0 or values.max() >= table_size):
    raise ValueError(f"{name} span [{values.min()}, {values.max()}], outside the learned "
                     f"position table [0, config.model.trainable_position_size={table_size})")


def _check_same_shape(tokens, value, name):
  if value is not None and tuple(value.shape) != tuple(tokens.shape):
    raise ValueError(f"{name} must have the shape of tokens {tokens.shape}, got {value.shape}")


class _Model:
  """The methods behind `transform(config)`'s functions: input checks, then jitted
  programs (compiled once per input shape) over the config's decoder module."""

  def __init__(self, config: config_dict.ConfigDict):
    self.config = config
    self.model = config_dict.FrozenConfigDict(config.model)
    self._jit_init = jax.jit(self._init)
    self._jit_apply = jax.jit(self._forward, static_argnames="return_aux")
    self._jit_loss = jax.jit(self._loss, static_argnames="return_aux")

  def _inputs(self, tokens, positions, segment_ids):
    # Lists and numpy arrays as well as jax arrays (tracers pass through).
    tokens, positions, segment_ids = (None if a is None else jnp.asarray(a)
                                      for a in (tokens, positions, segment_ids))
    _check_tokens(tokens, self.model.vocab_size)
    for name, value in (("positions", positions), ("segment_ids", segment_ids)):
      _check_same_shape(tokens, value, name)
      if value is not None and not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if positions is None and segment_ids is None:   # 0..T-1: known from the shape alone
      _check_positions(np.arange(tokens.shape[1]), self.model.trainable_position_size)
    if positions is None:
      positions = (jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
                   if segment_ids is None else positions_from_segments(segment_ids))
    _check_positions(positions, self.model.trainable_position_size)
    return tokens, positions, segment_ids

  def _forward(self, params, tokens, positions, segment_ids, images, rng, return_aux,
               return_hidden=False):
    rngs = None if rng is None else {"dropout": rng}
    # Without images there are no spans (check_image_inputs refuses placeholders then),
    # so local layers of long rows keep their blocked masks.
    spans = (vision.image_span_ids(tokens, self.model.vision.image_token_id)
             if images is not None else None)
    module = decoder_module(self.config, deterministic=rng is None)
    run = functools.partial(module.apply, {"params": params}, tokens, positions,
                            segment_ids, spans, images=images, rngs=rngs,
                            return_hidden=return_hidden)
    if not return_aux:
      return run()
    logits, state = run(mutable=["intermediates"])
    intermediates = state.get("intermediates", {})
    aux = moe.summarize(intermediates)
    if self.model.record_internal_nn_metrics:
      aux["activation_stats"] = activation_stats.summarize(
          intermediates, len(self.model.attention_pattern),
          {s.name: s.start for s in decoder.scan_segments(self.model)})
    return logits, aux

  def _loss(self, params, tokens, targets, weights, positions, segment_ids, images, rng,
            return_aux):
    tied = self.model.logits_via_embedding
    out = self._forward(params, tokens, positions, segment_ids, images, rng, return_aux,
                   return_hidden=tied)
    head, aux = out if return_aux else (out, None)
    if targets is None:
      targets = loss_lib.next_token_targets(tokens, segment_ids)
      if images is not None:   # an image's soft tokens are inputs, never predictions
        targets = jnp.where(targets == self.model.vision.image_token_id, -1, targets)
    ignored = targets < 0                      # transformers' -100: not counted
    targets, weights = jnp.where(ignored, 0, targets), jnp.where(ignored, 0, weights)
    if tied:
      sums = chunked_loss.token_losses(*head, targets, weights,
                                       logit_softcap=self.model.final_logit_softcap)
    else:
      sums = loss_lib.token_losses(head, targets, weights)
    return (sums, aux) if return_aux else sums

  def init(self, rng: jax.Array, tokens: jax.Array, *, positions=None,
           segment_ids=None) -> dict:
    """rng: a PRNG key; tokens: [B, T] ids (only their shape matters) -> params."""
    return self._jit_init(rng, *self._inputs(tokens, positions, segment_ids))

  def apply(self, params: dict, tokens: jax.Array, *,
            positions: Optional[jax.Array] = None,
            segment_ids: Optional[jax.Array] = None, images: Optional[jax.Array] = None,
            rng: Optional[jax.Array] = None, return_aux: bool = False):
    """Logits [B, T, V] for tokens [B, T] (float32 unless the config's
    `cast_logits_to_float32` is off); with `return_aux`, (logits, aux).

    Args:
      params: from `init` (or `gemma_jax.hf.load`).
      tokens: [B, T] int token ids in [0, vocab_size), padding included (checked unless
        traced: under jit an id outside gives NaN logits for its whole row, as masked
        keys still carry their values).
      positions: [B, T] positions (RoPE, position embeddings); default: index within
        each segment. With a learned table they must lie in [0, trainable_position_size)
        (checked unless traced; without positions and segment_ids, T is checked even
        under jit).
      segment_ids: [B, T] document ids of packed rows (0 for padding); default: one
        document per row.
      images: (a model with `vision.enabled`) Gemma 3: [B, I, S, S, C] pixels from
        `gemma_jax.models.gemma3.images`, each filling a span of `vision.tokens_per_image`
        ids `vision.image_token_id`; Gemma 4: `models.gemma4.images.ImagePatches`
        [B, I, P, ...],
        each filling a span of its own soft-token count. Row b's images go to its
        placeholder spans in order (bidirectional among themselves in the attention
        types `bidirectional_span_types`); images after a row's last span are padding
        (Gemma 4: empty images, all positions -1).
      rng: a PRNG key enables dropout; None runs deterministically.
      return_aux: also return the auxiliary outputs, a dict: "losses" maps names to
        weighted scalar losses to add to the objective (MoE load balancing and router
        z-loss, each the mean over layers; empty for a dense model), and a MoE model's
        "expert_load" [E] is the fraction of routed assignments each expert received,
        the mean over layers. With `record_internal_nn_metrics`, "activation_stats"
        maps "activation_mean/layer_{i}" (and _stdev, _fraction_zero) to scalars.
    """
    checked = self._inputs(tokens, positions, segment_ids)
    towers.check_image_inputs(checked[0], images, self.model)
    return self._jit_apply(params, *checked, images, rng, return_aux)

  def loss(self, params: dict, tokens: jax.Array, targets: Optional[jax.Array] = None, *,
           weights: Optional[jax.Array] = None, positions: Optional[jax.Array] = None,
           segment_ids: Optional[jax.Array] = None, images: Optional[jax.Array] = None,
           rng: Optional[jax.Array] = None, return_aux: bool = False):
    """The cross-entropy of `targets` under the logits `apply` gives, as
    `gemma_jax.layers.loss.TokenLosses` float32 sums over positions (cross_entropy,
    z_loss, weight; the mean loss is cross_entropy / weight); with `return_aux`,
    (sums, aux) as `apply` gives aux.

    With the tied embedding (every Gemma) the [B, T, V] logits are never formed whole:
    `layers.chunked_loss` takes them a chunk of positions at a time, the cross-entropy's
    gradient in the same pass. Differentiate it for training:

        grads = jax.grad(lambda p: (lambda s: s.cross_entropy / s.weight)(
            model.loss(p, tokens)))(params)

    Args:
      targets: [B, T] int ids below vocab_size (checked unless traced), the token
        expected at each position; a negative id (transformers' -100) marks a position
        that does not count, as weight 0 does. Default: the next token of the row
        (`gemma_jax.layers.loss.next_token_targets`: none after the last position,
        across documents of packed rows, or onto an image placeholder when `images` are
        given), as transformers' labels=input_ids with image tokens masked. Prefer it
        to `tokens[:, :-1], tokens[:, 1:]`: rows keep their length (2048, not 2047),
        which the matmul and attention kernels of an accelerator need no padding for.
      weights: [B, T] each position's weight (0: not counted); default all 1. It
        weighs the target at that position, with the default targets token t + 1: a
        mask over the tokens to learn (a chat's replies) shifts left by one,
        `jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))`.
      The others: as `apply`'s.
    """
    checked = self._inputs(tokens, positions, segment_ids)
    tokens = checked[0]
    if targets is not None:
      _check_same_shape(tokens, targets, "targets")
      concrete = not isinstance(targets, jax.core.Tracer)   # negative ids: ignored
      _check_tokens(np.maximum(np.asarray(targets), 0) if concrete else targets,
                    self.model.vocab_size, "targets")
    _check_same_shape(tokens, weights, "weights")
    weights = jnp.ones(tokens.shape, jnp.float32) if weights is None else weights
    towers.check_image_inputs(tokens, images, self.model)
    return self._jit_loss(params, checked[0], targets, weights, *checked[1:], images, rng,
                          return_aux)

  def _init(self, rng, tokens, positions, segment_ids):
    module = decoder_module(self.config, True)
    return nn.meta.unbox(module.init(rng, tokens, positions, segment_ids)["params"])


def transform(config: config_dict.ConfigDict) -> Transformed:
  """Validates `config` and returns the model's pure `init`, `apply` and `loss`."""
  config_lib.validate(config)
  model = _Model(config)
  return Transformed(model.init, model.apply, model.loss)
