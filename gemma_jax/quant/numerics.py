"""The arithmetic of quantization, on Qwix's quantized arrays.

Symmetric absmax scales (Qwix's convention): a channel of largest magnitude m gets
scale s = m / (q_max + 0.5) and values round(w / s) clipped to the type's range
(int8: s = m / 127.5 in [-128, 127]; int4: s = m / 7.5 in [-8, 7]). Weights are
quantized per output channel over their contracting axes, int4 optionally in groups of
`group_size` along the last contracting axis; activations per row.

int4 values are stored two to a byte (uint8, along the last contracting axis, low nibble
first), so the memory saving is real on every backend.
"""

import functools
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import qwix

QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}


def quantize_weight(w: jax.Array, contracting: Sequence[int], qtype: str,
                    group_size: int = 0) -> Tuple[jax.Array, jax.Array]:
  """w [..] -> (values, scale float32). Scale has w's rank: 1 on the contracting axes;
  with groups, size // group_size on the last of them and full size on the others (a
  group is `group_size` consecutive inputs). Values int8, or int4 packed two per uint8
  along the last contracting axis."""
  contracting = sorted(a % w.ndim for a in contracting)
  reduced = contracting[-1:] if group_size else contracting
  channels = tuple(a for a in range(w.ndim) if a not in reduced)
  tiles = {contracting[-1]: group_size} if group_size else None
  q = qwix.quantize(w.astype(jnp.float32), QTYPES[qtype], channelwise_axes=channels,
                    tiled_axes=tiles)
  values = pack_int4(q.qvalue, contracting[-1]) if qtype == "int4" else q.qvalue
  return values, q.scale


def dequantize_weight(values: jax.Array, scale: jax.Array, contracting: Sequence[int],
                      qtype: str, dtype) -> jax.Array:
  """`quantize_weight` undone: values * scale in `dtype` (groups broadcast)."""
  last = sorted(a % values.ndim for a in contracting)[-1]
  if qtype == "int4":
    values = unpack_int4(values, last)
  group = values.shape[last] // scale.shape[last]
  if group > 1:
    scale = jnp.repeat(scale, group, axis=last)
  return (values.astype(jnp.float32) * scale).astype(dtype)


def pack_int4(q: jax.Array, axis: int) -> jax.Array:
  """int4 (or int8 holding values in [-8, 7]) of even size along `axis` -> uint8 of half
  that size: element 2i in the low nibble, 2i + 1 in the high one."""
  q = jnp.moveaxis(q.astype(jnp.int8), axis, -1)
  low, high = q[..., 0::2], q[..., 1::2]
  packed = (low.astype(jnp.uint8) & 0xF) | (high.astype(jnp.uint8) << 4)
  return jnp.moveaxis(packed, -1, axis)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
  """`pack_int4` undone: uint8 -> int8 values in [-8, 7], twice the size along `axis`."""
  p = jnp.moveaxis(packed, axis, -1).astype(jnp.int8)
  low = jnp.left_shift(p, 4) >> 4          # arithmetic shifts sign-extend the nibbles
  high = p >> 4
  q = jnp.stack([low, high], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))
  return jnp.moveaxis(q, -1, axis)


def fake_quantize(x: jax.Array, reduce_axes: Sequence[int], qtype: str) -> jax.Array:
  """x quantized (one scale per slice over `reduce_axes`) and dequantized, in x's dtype;
  the gradient passes straight through."""
  keep = tuple(a for a in range(x.ndim) if a not in {r % x.ndim for r in reduce_axes})
  q = qwix.quantize(x.astype(jnp.float32), QTYPES[qtype], channelwise_axes=keep)
  rounded = qwix.dequantize(q).astype(x.dtype)
  return x + jax.lax.stop_gradient(rounded - x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantized_matmul(x: jax.Array, w: jax.Array, qtype: str) -> jax.Array:
  """x [R, I] @ w [I, O] with x quantized per row and w per column, the product taken
  in the quantized type (int8: int32 accumulation) and rescaled, in x's dtype. The
  gradients are those of x @ w (straight-through)."""
  qx = qwix.quantize(x, QTYPES[qtype], channelwise_axes=(0,))
  qw = qwix.quantize(w, QTYPES[qtype], channelwise_axes=(1,))
  return qwix.dot_general(qx, qw, (((1,), (0,)), ((), ()))).astype(x.dtype)


def _quantized_matmul_fwd(x, w, qtype):
  return quantized_matmul(x, w, qtype), (x, w)


def _quantized_matmul_bwd(qtype, residuals, grad):
  del qtype
  x, w = residuals
  return (grad @ w.T.astype(grad.dtype)).astype(x.dtype), (x.T @ grad).astype(w.dtype)


quantized_matmul.defvjp(_quantized_matmul_fwd, _quantized_matmul_bwd)


def group_error(size: int, group_size: int) -> Optional[str]:
  """Why groups of `group_size` cannot split a contracting axis of `size`, or None."""
  if group_size and size % group_size:
    return f"group size {group_size} does not divide the contracting axis of size {size}"
  if size % 2:
    return f"int4 packs values in pairs: the contracting axis of size {size} is odd"
  return None
