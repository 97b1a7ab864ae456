"""A family's plan of layers: what the decoder runs at each depth, without knowing why.

A family is its layer class plus three answers the decoder asks it for:

- `plan(config)`: a `LayerSpec` per layer: its attention type, the layer module's extra
  fields, and the scan group it may run in (None: always unscanned);
- `side_inputs(config, tokens, x)`: inputs every layer reads besides the residual
  stream, computed once before the first layer: [L, B, T, ...] (layer first), or None;
- `run_layer(layer, x, positions, masks, side, handed)`: calls one layer with its slice
  of the side inputs and what earlier layers handed on (a dict), returning
  (x [B, T, D], what is handed on to later layers).

Layers that hand something on must have group None: a scan only broadcasts `handed` to
its layers, it cannot carry what they add.
"""

from typing import Any, Callable, NamedTuple, Optional, Tuple

from ml_collections import config_dict

from gemma_jax.config import layer_types


class LayerSpec(NamedTuple):
  """What the decoder runs at one depth.

  kind: the attention type ("local" or "global").
  fields: more fields of the family's layer module, as sorted (name, value) pairs.
  group: the scan segment this layer may join (periods of one group with equal specs
    run under one nn.scan named after it); None: the layer runs unscanned.
  """
  kind: str
  fields: Tuple[Tuple[str, Any], ...] = ()
  group: Optional[str] = "blocks"


def uniform_plan(config: config_dict.ConfigDict) -> Tuple[LayerSpec, ...]:
  """Every layer of its attention type, with no extra fields, in the "blocks" scan."""
  return tuple(LayerSpec(kind) for kind in layer_types(config))


def no_side_inputs(config, tokens, x) -> None:
  """A family whose layers read only the residual stream."""
  del config, tokens, x


def call_layer(layer, x, positions, masks, side, handed) -> tuple:
  """A layer that reads no side input and hands nothing on: (layer(x, ...), handed)."""
  del side
  return layer(x, positions, masks), handed


class Family(NamedTuple):
  """One block type's layer and its answers to the decoder (see the module docstring)."""
  layer: type
  plan: Callable[[config_dict.ConfigDict], Tuple[LayerSpec, ...]] = uniform_plan
  side_inputs: Callable[..., Any] = no_side_inputs
  run_layer: Callable[..., tuple] = call_layer
