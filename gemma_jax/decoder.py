"""The decoder: embed -> scanned blocks of layers -> final norm -> logits.

The attention pattern (e.g. 5 local, 1 global) repeats every `len(pattern)` layers
(`final_layer_global` makes the last layer global whatever the pattern says); one
period is a `Block`. With `scan_layers` runs of whole periods (`scan_segments`) run
under `nn.scan` (parameters stacked on a leading "layers" axis; rolled into a loop, the
program does not grow with depth, unrolled by `scan_unroll` it skips the loop's stacked
activations): "blocks", the leading periods whose layers all have the pattern's types,
and, in a model with shared key/value layers (Gemma 4's small ones), "shared_blocks",
the whole periods among those. The other layers run unscanned. Without it every layer
is unrolled. Parameter names:

  scanned:   blocks/layer_{j}/...         (stacked, block b holds layer b * period + j)
             shared_blocks/layer_{j}/...  (block b holds layer start + b * period + j)
             layers_{i}/...               (the layers outside both)
  unrolled:  layers_{i}/...               for every i

`stack_layers` / `unstack_layers` convert between the two, and between the vision
tower's scanned `vision/encoder/layers` and unrolled `vision/encoder/layers_{i}`.
With `per_layer_input_dim` the decoder computes every layer's per-layer input first
(`models.gemma4.per_layer_inputs`) and hands each layer its slice.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
from flax.linen import module as flax_module
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_dict

from gemma_jax import remat
from gemma_jax.config import attention_shape, kv_sharing_modes, layer_types
from gemma_jax.layers.attention import (CausalBlocks, CausalMask, attention_mask,
                                        causal_block_size, cudnn_fused, local_blocks,
                                        softcap)
from gemma_jax.layers.embed import Embed, sinusoidal
from gemma_jax.layers.linear import Linear
from gemma_jax.layers.matmul import unfused
from gemma_jax.models import towers
from gemma_jax.models.gemma3.layer import Gemma3Layer
from gemma_jax.models.gemma4.layer import Gemma4Layer
from gemma_jax.models.gemma4.per_layer_inputs import PerLayerInputs
from gemma_jax.models.gpt3 import Gpt3Layer
from gemma_jax.models.parallel import ParallelLayer

LAYERS = {"gemma3": Gemma3Layer, "gemma4": Gemma4Layer, "gpt3": Gpt3Layer,
          "parallel": ParallelLayer}


class Segment(NamedTuple):
  """`count` whole pattern periods from layer `start` run under one nn.scan, named `name`;
  their layers' key/value sharing is `kv_sharing` (None or "reuse")."""
  name: str
  start: int
  count: int
  kv_sharing: Optional[str]


def scan_segments(config: config_dict.ConfigDict) -> Tuple[Segment, ...]:
  """The scanned runs of whole periods (none when unrolled): "blocks" from layer 0 and,
  with shared key/value layers, "shared_blocks" from the first period start among them;
  each as long as its periods' layers have the pattern's types and one sharing mode.
  The layers outside them (a "store" layer's period, the rest) run unscanned."""
  return _segments(config) if config.scan_layers else ()


def _segments(config: config_dict.ConfigDict) -> Tuple[Segment, ...]:
  """`scan_segments` of the config scanned."""
  period = len(config.attention_pattern)
  types, modes = layer_types(config), kv_sharing_modes(config)
  first_shared = config.num_layers - config.num_kv_shared_layers

  def run(name, start, mode):
    count = 0
    while start + (count + 1) * period <= config.num_layers:
      layers = range(start + count * period, start + (count + 1) * period)
      if any(types[i] != config.attention_pattern[i - start - count * period]
             or modes[i] != mode for i in layers):
        break
      count += 1
    return Segment(name, start, count, mode)

  segments = [run("blocks", 0, None)]
  if config.num_kv_shared_layers:
    segments.append(run("shared_blocks", -(-first_shared // period) * period, "reuse"))
  return tuple(s for s in segments if s.count)


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
  equal fields (attention type, sharing mode) then share one trace, so lowering a
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


def _layer_options(kv_sharing: Optional[str]) -> dict:
  """The layer fields beyond Gemma 3's: only Gemma 4 shares keys and values."""
  return {"kv_sharing": kv_sharing} if kv_sharing else {}


def _gemma4_inputs(config: config_dict.ConfigDict, per_layer_input, shared_kv) -> tuple:
  """The arguments Gemma 4's small models add to a layer's call (none otherwise)."""
  if config.per_layer_input_dim or config.num_kv_shared_layers:
    return (per_layer_input, shared_kv)
  return ()


class Block(nn.Module):
  """One period of the attention pattern; returns (x, None) to serve as a scan body.

  per_layer: [period, B, T, P] the period's per-layer inputs, or None; shared_kv:
  {attention type: (keys, values)} for kv_sharing "reuse", or None.
  """
  config: config_dict.ConfigDict
  deterministic: bool = True
  kv_sharing: Optional[str] = None

  @nn.compact
  def __call__(self, x, positions, masks, per_layer=None, shared_kv=None):
    c = self.config
    layer_cls = _traced_once(LAYERS[c.block_type], self)
    for j, kind in enumerate(c.attention_pattern):
      extra = _gemma4_inputs(c, None if per_layer is None else per_layer[j],
                             None if shared_kv is None else shared_kv[kind])
      x = layer_cls(c, kind, self.deterministic, name=f"layer_{j}",
                    **_layer_options(self.kv_sharing))(x, positions, masks, *extra)
    return x, None


class Decoder(nn.Module):
  """tokens [B, T] -> logits [B, T, V] (float32 unless `cast_logits_to_float32` is off).

  Embedding: the token table (x sqrt(D) with `scale_embeddings`), plus the sinusoidal
  embedding of the positions and/or a learned [trainable_position_size, D] table
  `position_embed`. Logits: the tied token table, or a [D, V] kernel `logits`.
  With `vision.enabled`, the block type's `vision` tower (`models.towers`) turns images
  into soft tokens that replace the embeddings of the image placeholder ids; Gemma 4's
  per-layer inputs read the placeholders as `vision.pad_token_id`.

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
               return_hidden: bool = False) -> jax.Array:
    """tokens, positions, segment_ids, span_ids: [B, T] -> [B, T, V]; segment_ids None:
    one document per row.

    images: (`vision.enabled`) Gemma 3: [B, I, S, S, C] normalised pixels; Gemma 4:
      `gemma4_images.ImagePatches` [B, I, P, ...] (see `models.towers`). Row b's soft
      tokens replace its image placeholders in order; images past its last span are
      padding.

    masks: {attention type: [B, T, S] mask, `attention.LocalBlocks`, `CausalBlocks` or
      `CausalMask`, or an `attention.Prefill` / `Decode` / `Extend` cache access}
      replacing the masks built from
      segment_ids and span_ids (decoding; the layers' caches are then the "cache"
      collection, see `gemma_jax.inference.decoding`).
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
    if c.sinusoidal_position_embedding:
      x = x + sinusoidal(positions, c.d_model).astype(dtype)
    if c.trainable_position_size:
      x = x + Embed(c.trainable_position_size, c.d_model, scale_by_sqrt_dim=False, dtype=dtype,
                    param_dtype=param_dtype, name="position_embed").encode(positions)

    per_layer = None
    if c.per_layer_input_dim:
      per_layer = PerLayerInputs(
          c.num_layers, c.per_layer_input_dim, c.per_layer_vocab_size or c.vocab_size,
          c.norm_eps, c.norm_plus_one, dtype, param_dtype,
          name="per_layer_inputs")(towers.text_ids(c, tokens), x)    # [B, T, L, P]

    if masks is None:
      packed = segment_ids is not None
      segment_ids = segment_ids if packed else jnp.ones_like(tokens)
      masks = layer_masks(c, segment_ids, span_ids, blocked=True, packed=packed)
    x = self._layers(x, positions, masks, per_layer)

    x = unfused(LAYERS[c.block_type].make_norm(c, "final_norm")(x))
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


  def _layers(self, x, positions, masks, per_layer):
    """The layers in order: scanned segments, the others one by one, "store" layers'
    keys and values kept for the "reuse" layers after them."""
    c = self.config
    period = len(c.attention_pattern)
    types, modes = layer_types(c), kv_sharing_modes(c)
    segments = {s.start: s for s in scan_segments(c)}
    layer_cls = _with_remat(_traced_once(LAYERS[c.block_type], self), c, prevent_cse=True)
    shared = {}          # attention type -> (keys, values) of its "store" layer
    i = 0
    while i < c.num_layers:
      if i in segments:
        s = segments[i]
        blocks_per_layer = None
        if per_layer is not None:   # [B, T, L, P] -> [count, period, B, T, P]
          blocks_per_layer = per_layer[:, :, i:i + s.count * period].reshape(
              *per_layer.shape[:2], s.count, period, -1).transpose(2, 3, 0, 1, 4)
        unrolled = scan_unrolled(c)
        blocks = nn.scan(   # remat may skip its CSE barrier only inside a loop
            _with_remat(Block, c, prevent_cse=unrolled),
            variable_axes={"params": 0, "intermediates": 0, "cache": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast),
            length=s.count,
            unroll=0 if unrolled else 1,   # 0: every step, even of a length-1 scan
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.deterministic, s.kv_sharing, name=s.name)
        x, _ = blocks(x, positions, masks, blocks_per_layer, shared or None)
        i += s.count * period
        continue
      extra = _gemma4_inputs(c, None if per_layer is None else per_layer[:, :, i],
                             shared.get(types[i]) if modes[i] == "reuse" else None)
      out = layer_cls(c, types[i], self.deterministic, name=f"layers_{i}",
                      **_layer_options(modes[i]))(x, positions, masks, *extra)
      if modes[i] == "store":
        out, shared[types[i]] = out
      x = out
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
