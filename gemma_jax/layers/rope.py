"""Rotary position embedding with a base, a linear scale and a rotated fraction.

Pairs (i, i + H/2) rotate together (the "rotate half" layout). With a fraction f < 1
only the first int(f * H / 2) pairs rotate, at frequencies base^(-2i/H) of the full
head dim; the rest keep frequency zero (Gemma 4's proportional RoPE). A linear
scale s divides every frequency, stretching positions by s.
"""

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, base: float, scale: float = 1.0,
                        fraction: float = 1.0) -> jax.Array:
  """[H/2] float32 angular frequencies."""
  half = head_dim // 2
  rotated = int(fraction * head_dim // 2)
  exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim
  freqs = 1.0 / (base ** exponents)
  freqs = jnp.concatenate([freqs, jnp.zeros((half - rotated,), jnp.float32)])
  return freqs / scale


def _tables(angles: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """cos and sin of angles [B, T, H/2], each [B, T, H] (every angle twice: rotate half)."""
  both = lambda f: jnp.concatenate([f(angles), f(angles)], axis=-1)
  return both(jnp.cos), both(jnp.sin)


def _tables_as_arrays(angles: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """`_tables`, the angles' cosines and sines [B, T, H] repeated by a matmul.

  Left to itself, XLA's CPU backend fuses the sines and cosines into the rotation, which
  then computes them anew for every head. A matmul's result is an array of its own, so
  the product with a 0/1 matrix (exact) makes them once, at about half the cost.
  """
  half = angles.shape[-1]
  repeat = np.kron(np.eye(2), np.tile(np.eye(half), (1, 2))).astype(np.float32)  # [H, 2H]
  both = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
  tables = jnp.einsum("bth,hk->btk", both, repeat, precision=jax.lax.Precision.HIGHEST)
  return tables[..., :2 * half], tables[..., 2 * half:]


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float, scale: float = 1.0,
               fraction: float = 1.0) -> jax.Array:
  """x: [B, T, N, H], positions: [B, T] -> [B, T, N, H] in x's dtype.

  Over more than one token the sines and cosines are made once, not per head, on a CPU
  (`_tables_as_arrays`); a decoded token's few stay fused (a kernel more costs more)."""
  freqs = inverse_frequencies(x.shape[-1], base, scale, fraction)
  angles = positions[..., None].astype(jnp.float32) * freqs     # [B, T, H/2]
  if x.shape[1] > 1:
    cos, sin = jax.lax.platform_dependent(angles, cpu=_tables_as_arrays, default=_tables)
  else:
    cos, sin = _tables(angles)
  cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  rotated_half = jnp.concatenate([-second, first], axis=-1)
  return x * cos + rotated_half * sin
