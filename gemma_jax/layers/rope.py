"""Rotary position embedding with a base, a linear scale and a rotated fraction.

Pairs (i, i + H/2) rotate together (the "rotate half" layout). With a fraction f < 1
only the first int(f * H / 2) pairs rotate, at frequencies base^(-2i/H) of the full
head dim; the rest keep frequency zero (Gemma 4's proportional RoPE). A linear
scale s divides every frequency, stretching positions by s.
"""

import jax
import jax.numpy as jnp


def inverse_frequencies(head_dim: int, base: float, scale: float = 1.0,
                        fraction: float = 1.0) -> jax.Array:
  """[H/2] float32 angular frequencies."""
  half = head_dim // 2
  rotated = int(fraction * head_dim // 2)
  exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim
  freqs = 1.0 / (base ** exponents)
  freqs = jnp.concatenate([freqs, jnp.zeros((half - rotated,), jnp.float32)])
  return freqs / scale


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float, scale: float = 1.0,
               fraction: float = 1.0) -> jax.Array:
  """x: [B, T, N, H], positions: [B, T] -> [B, T, N, H] in x's dtype."""
  freqs = inverse_frequencies(x.shape[-1], base, scale, fraction)
  angles = positions[..., None].astype(jnp.float32) * freqs     # [B, T, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  rotated_half = jnp.concatenate([-second, first], axis=-1)
  return x * cos + rotated_half * sin
