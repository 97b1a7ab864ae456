"""The decoder: embed -> scanned blocks of layers -> final norm -> logits.

The attention pattern (e.g. 5 local, 1 global) repeats every `len(pattern)` layers
(`final_layer_global` makes the last layer global whatever the pattern says); one
period is a `Block`. With `scan_layers` runs of whole periods (`scan_segments`) run
under `nn.scan` (parameters stacked on a leading "layers" axis; rolled into a loop, the
program does not grow with depth, unrolled by `scan_unroll` it skips the loop's stacked
activations). Which layers run where is the family's plan (`models.plan`, one
`LayerSpec` per layer, from `models.families`): each scan group of the plan gets one
segment, the whole periods from the first period start among its layers whose specs
repeat the first period's and whose types are the pattern's ("blocks" from layer 0 for
every family; Gemma 4's shared key/value layers also "shared_blocks"). The other layers
run unscanned. Without it every layer is unrolled. Parameter names:

  scanned:   {group}/layer_{j}/...  (stacked, block b holds layer start + b * period + j)
             layers_{i}/...         (the layers outside the segments)
  unrolled:  layers_{i}/...         for every i

`stack_layers` / `unstack_layers` convert between the two, and between the vision
tower's scanned `vision/encoder/layers` and unrolled `vision/encoder/layers_{i}`.
The family's side inputs (Gemma 4's per-layer inputs) are computed once, after the
embedding; each layer gets its slice and what earlier layers handed on
(`Family.run_layer`).
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
from flax.linen import module as flax_module
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.config import attention_shape, layer_types
from gemma_jax.layers.attention import (CausalBlocks, CausalMask, attention_mask,
                                        causal_block_size, cudnn_fused, local_blocks,
                                        softcap)
from gemma_jax.layers.embed import Embed, sinusoidal
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.matmul import unfused
from gemma_jax.models import towers
from gemma_jax.models.families import FAMILIES
from gemma_jax.models.plan import LayerSpec


class Segment(NamedTuple):
  """`count` whole pattern periods from layer `start` run under one nn.scan named `name`
  (the plan's scan group); each period's layers are `specs`."""
  name: str
  start: int
  count: int
  specs: Tuple[LayerSpec, ...]


def scan_segments(config: config_dict.ConfigDict) -> Tuple[Segment, ...]:
  """The scanned runs of whole periods (none when unrolled), one per scan group of the
  family's plan (see the module docstring)."""
  return _segments(config) if config.scan_layers else ()


def _segments(config: config_dict.ConfigDict) -> Tuple[Segment, ...]:
  """`scan_segments` of the config scanned."""
  period, pattern = len(config.attention_pattern), tuple(config.attention_pattern)
  specs = FAMILIES[config.block_type].plan(config)
  segments = []
  for group in dict.fromkeys(spec.group for spec in specs if spec.group):
    first = next(i for i, spec in enumerate(specs) if spec.group == group)
    start = -(-first // period) * period
    unit = specs[start:start + period]
    count = 0
    while (start + (count + 1) * period <= config.num_layers
           and tuple(spec.kind for spec in unit) == pattern
           and all(spec.group == group for spec in unit)
           and specs[start + count * period:start + (count + 1) * period] == unit):
      count += 1
    if count:
      segments.append(Segment(group, start, count, unit))
  return tuple(segments)


def scanned_block_count(config: config_dict.ConfigDict) -> int:
  """How many whole pattern periods run under the "blocks" scan (0 when unrolled)."""
  return sum(s.count for s in scan_segments(config) if s.name == "blocks")


def scanned_layers(config: config_dict.ConfigDict) -> dict:
  """{layer index: (segment name, block, index in the period)} of the scanned layers."""
  period = len(config.attention_pattern)
  return {s.start + b * period + j: (s.name, b, j) for s in scan_segments(config)
          for b in range(s.count) for j in range(period)}


def fused_attention(config: config_dict.ConfigDict, kind: str) -> bool:
  """Whether layers of attention type `kind` run as cuDNN's fused kernel, which skips
  masked tiles itself: the "jax" kernel where cuDNN takes the type's heads
  (`attention.cudnn_fused`: a GPU, bfloat16 or float16, not too wide). Otherwise XLA's
  implementation computes every logit it is given, so the layer takes its mask in
  blocks."""
  return (config.attention_kernel == "jax"
          and cudnn_fused(attention_shape(config, kind)[1], config.dtype))


def layer_masks(config: config_dict.ConfigDict, segment_ids: jax.Array,
                span_ids: Optional[jax.Array] = None, blocked: bool = False,
                fused: Optional[bool] = None, packed: bool = True) -> dict:
  """{attention type: [B, T, T] mask} for the types present; spans are bidirectional
  only in `bidirectional_span_types`. With `blocked`, where there are no spans, a layer
  that skips masked work gets its mask in the form its kernel skips it in: for a fused
  kernel (`fused`, default per type `fused_attention(config, kind)`),
  `attention.CausalMask`, with no array when rows are not `packed` (one document each:
  the structure is the whole mask); else a local layer's is `attention.LocalBlocks`
  once T > 2 x window, and any other's `attention.CausalBlocks` once T holds two
  causal blocks."""
  t = segment_ids.shape[1]
  index = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
  masks = {}
  for kind in sorted(set(layer_types(config))):
    fused_kind = fused_attention(config, kind) if fused is None else fused
    spans = span_ids if kind in config.bidirectional_span_types else None
    window = config.sliding_window if kind == "local" else None
    if blocked and fused_kind and spans is None and not packed:
      masks[kind] = CausalMask(None, window)
      continue
    if (blocked and not fused_kind and spans is None and kind == "local"
        and t > 2 * config.sliding_window):
      masks[kind] = local_blocks(segment_ids, config.sliding_window)
      continue
    masks[kind] = attention_mask(index, index, segment_ids, segment_ids, q_spans=spans,
                                 kv_spans=spans, window=window)
    if blocked and spans is None and fused_kind:
      masks[kind] = CausalMask(masks[kind], window)
    elif blocked and spans is None and t >= 2 * causal_block_size(t):
      masks[kind] = CausalBlocks(masks[kind])
  return masks


def scan_unrolled(config: config_dict.ConfigDict) -> bool:
  """Whether the scanned segments run unrolled (`scan_unroll`, "auto": without remat)."""
  if config.scan_unroll == "auto":
    return not remat.is_remat(config.remat_policy)
  return config.scan_unroll == "full"


def _with_remat(module_cls, config, prevent_cse):
  if not remat.is_remat(config.remat_policy):
    return module_cls
  return nn.remat(module_cls, policy=remat.POLICIES[config.remat_policy],
                  prevent_cse=prevent_cse)


def _traced_once(layer_cls, caller: nn.Module):
  """`layer_cls` under `nn.jit`, made afresh per call: the layers built from it with
  equal fields (attention type, the plan's fields) then share one trace, so lowering a
  program traces each kind of layer once, not every layer (XLA still gets every layer:
  the compiled program is unchanged). Not while `caller`'s layers draw random numbers
  (init, dropout): nn.jit forks their keys, and a seed must draw the same values whether
  or not layers share a trace. Not while a method interceptor (LoRA, quantization, a
  user's) or `capture_intermediates` is active: what those do may depend on a layer's
  path, which nn.jit's cache key leaves out."""
  # Flax keeps both stacks private: where a version lacks them, nothing is shared.
  interceptors = getattr(flax_module, "_global_interceptor_stack", None)
  capture = getattr(getattr(flax_module, "_context", None), "capture_stack", None)
  draws = caller.is_initializing() or (not caller.deterministic and caller.config.dropout_rate)
  if (draws or interceptors is None or capture is None
      or len(interceptors) or (capture and capture[-1])):
    return layer_cls
  return nn.jit(layer_cls)


def _layer(layer_cls, config, spec: LayerSpec, deterministic: bool, name: str) -> nn.Module:
  """The family's layer at one depth, as its spec says."""
  return layer_cls(config, spec.kind, deterministic, name=name, **dict(spec.fields))


def _at(side: Any, i: Any) -> Any:
  """The side inputs [L, ...] of layer (or layers) `i`; None stays None."""
  return jax.tree_util.tree_map(lambda a: a[i], side)


class Block(nn.Module):
  """One period of layers `specs`; returns (x, None) to serve as a scan body.

  side: the period's side inputs [period, B, T, ...], or None; handed: what earlier
  layers handed on (read only: a scanned layer hands nothing on).
  """
  config: config_dict.ConfigDict
  deterministic: bool
  specs: Tuple[LayerSpec, ...]

  @nn.compact
  def __call__(self, x, positions, masks, side=None, handed=None):
    family = FAMILIES[self.config.block_type]
    layer_cls = _traced_once(family.layer, self)
    for j, spec in enumerate(self.specs):
      layer = _layer(layer_cls, self.config, spec, self.deterministic, f"layer_{j}")
      x, after = family.run_layer(layer, x, positions, masks, _at(side, j), handed)
      if after is not handed:
        raise ValueError(f"layer_{j} of a scanned period hands state on: its plan must "
                         f"give it scan group None")
    return x, None


class Decoder(nn.Module):
  """tokens [B, T] -> logits [B, T, V] (float32 unless `cast_logits_to_float32` is off).

  Embedding: the token table (x sqrt(D) with `scale_embeddings`), plus the sinusoidal
  embedding of the positions and/or a learned [trainable_position_size, D] table
  `position_embed`. Logits: the tied token table, or a [D, V] kernel `logits`.
  With `vision.enabled`, the block type's `vision` tower (`models.towers`) turns images
  into soft tokens that replace the embeddings of the image placeholder ids. The
  family's side inputs (`models.plan`) are computed from the tokens and embeddings.

  Attributes:
    config: the model section of the config.
    deterministic: disables dropout.
  """
  config: config_dict.ConfigDict
  deterministic: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array,
               segment_ids: Optional[jax.Array], span_ids: Optional[jax.Array] = None,
               masks: Optional[dict] = None,
               images: Optional[jax.Array] = None,
               soft_tokens: Optional[jax.Array] = None,
               return_hidden: bool = False) -> jax.Array:
    """tokens, positions, segment_ids, span_ids: [B, T] -> [B, T, V]; segment_ids None:
    one document per row.

    images: (`vision.enabled`) Gemma 3: [B, I, S, S, C] normalised pixels; Gemma 4:
      `gemma4_images.ImagePatches` [B, I, P, ...] (see `models.towers`). Row b's soft
      tokens replace its image placeholders in order; images past its last span are
      padding.

    masks: {attention type: [B, T, S] mask, `attention.LocalBlocks`, `CausalBlocks` or
      `CausalMask`, or a cache access of `layers.cache_access`}
      replacing the masks built from
      segment_ids and span_ids (decoding; the layers' caches are then the "cache"
      collection, see `gemma_jax.inference.decoding`).
    soft_tokens: (`vision.enabled`, instead of images) [B, T, D] the embeddings of the
      image placeholders, from `towers.soft_embeddings` (a prompt computed in chunks
      takes its chunk's); other positions are ignored.
    return_hidden: (tied embedding) instead of the logits, the final norm's output
      [B, T, D] and the table [V, D] in the compute dtype, for `layers.chunked_loss`.
    """
    c = self.config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    embed = Embed(c.vocab_size, c.d_model, scale_by_sqrt_dim=c.scale_embeddings, dtype=dtype,
                  param_dtype=param_dtype, name="embed")
    x = embed.encode(tokens)
    if c.vision.enabled:
      x = towers.embed_images(c, x, tokens, images, self.is_initializing())
      if soft_tokens is not None:
        x = jnp.where((tokens == c.vision.image_token_id)[..., None],
                      soft_tokens.astype(x.dtype), x)
    if c.sinusoidal_position_embedding:
      x = x + sinusoidal(positions, c.d_model).astype(dtype)
    if c.trainable_position_size:
      x = x + Embed(c.trainable_position_size, c.d_model, scale_by_sqrt_dim=False, dtype=dtype,
                    param_dtype=param_dtype, name="position_embed").encode(positions)

    side = FAMILIES[c.block_type].side_inputs(c, tokens, x)           # [L, B, T, ...]

    if masks is None:
      packed = segment_ids is not None
      segment_ids = segment_ids if packed else jnp.ones_like(tokens)
      masks = layer_masks(c, segment_ids, span_ids, blocked=True, packed=packed)
    x = self._layers(x, positions, masks, side)

    x = unfused(FAMILIES[c.block_type].layer.make_norm(c, "final_norm")(x))
    if return_hidden:
      if not c.logits_via_embedding:
        raise ValueError("return_hidden needs the tied embedding (logits_via_embedding)")
      return x, embed.embedding.astype(dtype)
    if c.logits_via_embedding:
      logits = embed.attend(x)
    else:
      logits = Linear((c.vocab_size,), ("embed", "vocab"), dtype=dtype, param_dtype=param_dtype,
                      name="logits")(x)
    if c.cast_logits_to_float32:
      logits = logits.astype(jnp.float32)
    logits = softcap(logits, c.final_logit_softcap)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


  def _layers(self, x, positions, masks, side):
    """The layers in order: the scanned segments, the others one by one, each handed
    what the layers before it handed on."""
    c = self.config
    family, period = FAMILIES[c.block_type], len(c.attention_pattern)
    specs = family.plan(c)
    segments = {s.start: s for s in scan_segments(c)}
    layer_cls = _with_remat(_traced_once(family.layer, self), c, prevent_cse=True)
    handed = {}
    i = 0
    while i < c.num_layers:
      if i in segments:
        s = segments[i]
        end = i + s.count * period   # side [L, ...] -> [count, period, ...]
        blocks_side = jax.tree_util.tree_map(
            lambda a: a[i:end].reshape(s.count, period, *a.shape[1:]), side)
        unrolled = scan_unrolled(c)
        blocks = nn.scan(   # remat may skip its CSE barrier only inside a loop
            _with_remat(Block, c, prevent_cse=unrolled),
            variable_axes={"params": 0, "intermediates": 0, "cache": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
            length=s.count,
            unroll=0 if unrolled else 1,   # 0: every step, even of a length-1 scan
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.deterministic, s.specs, name=s.name)
        x, _ = blocks(x, positions, masks, blocks_side, handed)
        i = end
        continue
      layer = _layer(layer_cls, c, specs[i], self.deterministic, f"layers_{i}")
      x, handed = family.run_layer(layer, x, positions, masks, _at(side, i), handed)
      i += 1
    return x


def _stack_arrays(arrays: Sequence[Any]) -> Any:
  """Host arrays stacked on the host, device arrays on the device."""
  if all(isinstance(a, np.ndarray) for a in arrays):
    return np.stack(arrays)
  return jnp.stack(arrays)


def _stack(layers: Sequence[Any], stack_leaves: Callable[[list], Any]) -> Any:
  """Parameter trees of one structure -> one tree, leaves stacked on a new leading layer
  axis by `stack_leaves`."""
  return jax.tree_util.tree_map(lambda *leaves: stack_leaves(list(leaves)), *layers)


def _unstack(stacked: Any) -> List[Any]:
  """A tree with a leading layer axis -> one tree per layer (`_stack` undone)."""
  count = jax.tree_util.tree_leaves(stacked)[0].shape[0]
  return [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(count)]


def unstack_layers(params: dict, config: config_dict.ConfigDict) -> dict:
  """Scanned parameter tree -> one entry `layers_{i}` per layer, the vision tower's
  `encoder/layers` too."""
  params = dict(params)
  if "vision" in params and "layers" in params["vision"]["encoder"]:
    encoder = dict(params["vision"]["encoder"])
    for i, layer in enumerate(_unstack(encoder.pop("layers"))):
      encoder[f"layers_{i}"] = layer
    params["vision"] = dict(params["vision"], encoder=encoder)
  period = len(config.attention_pattern)
  for segment in _segments(config):   # whatever scan_layers says: the tree decides
    blocks = params.pop(segment.name, None)
    if blocks is None:
      continue
    for j in range(period):
      for b, layer in enumerate(_unstack(blocks[f"layer_{j}"])):
        params[f"layers_{segment.start + b * period + j}"] = layer
  return params


def stack_layers(params: dict, config: config_dict.ConfigDict,
                 stack_leaves: Callable[[list], Any] = _stack_arrays) -> dict:
  """`layers_{i}` parameter tree -> the layout `config.scan_layers` asks for, the vision
  tower's `encoder/layers_{i}` too; `stack_leaves` makes one [layers, ...] leaf of the
  layers' leaves (default: numpy or jax.numpy stacking)."""
  params = dict(params)
  if "vision" in params and config.scan_layers:
    encoder = dict(params["vision"]["encoder"])
    encoder["layers"] = _stack([encoder.pop(f"layers_{i}")
                                for i in range(config.vision.num_layers)], stack_leaves)
    params["vision"] = dict(params["vision"], encoder=encoder)
  period = len(config.attention_pattern)
  for segment in scan_segments(config):
    params[segment.name] = {
        f"layer_{j}": _stack([params.pop(f"layers_{segment.start + b * period + j}")
                              for b in range(segment.count)], stack_leaves)
        for j in range(period)
    }
  return params
