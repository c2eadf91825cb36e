"""Rotary position embedding driven by per-document position ids.

In a packed row the positions restart at 0 for every document
(:func:`jax_cp.data.get_position_ids`), and under context parallelism they
travel with the tokens: slice them with
:func:`jax_cp.data.get_batch_on_this_cp_rank` (local view) or permute them
with :func:`jax_cp.data.reorder_for_cp` (global view) exactly like the
token ids. Rotary embeddings then only need each token's
own position, whatever rank holds it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Positions split into three 11-bit digits, p = p2 * 2^22 + p1 * 2^11 + p0:
# any int32 position (p2 < 2^9 of a non-negative one).
_DIGIT_BITS, _DIGITS = 11, 3
# Bits after the binary point of each digit's table entry (``high`` below):
# an 11-bit digit times it is an integer of at most 24 bits over 2^13,
# exact in float32.
_HIGH_BITS = 24 - _DIGIT_BITS


def rotary_frequencies(head_dim: int, theta: float = 10000.0) -> jax.Array:
  """float32 ``[head_dim // 2]`` inverse frequencies ``theta^(-2i/D)``
  (computed in float64, rounded once)."""
  return jnp.asarray(_frequencies(head_dim, float(theta)), jnp.float32)


def _frequencies(head_dim: int, theta: float) -> np.ndarray:
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got "
                     f"{head_dim}")
  i = np.arange(head_dim // 2, dtype=np.float64)
  return theta ** (-2.0 * i / head_dim)


@functools.lru_cache(maxsize=64)
def _turn_tables(head_dim: int, theta: float) -> tuple[np.ndarray, ...]:
  """float32 ``(high, low)``, each ``[3, D/2]``: the fraction of a turn
  that one unit of each position digit adds, ``frac(2^(11 j) * f_i / 2pi)``
  in float64, cut into ``high`` (a multiple of 2^-13) and the rest
  ``low`` (below 2^-13)."""
  turns = _frequencies(head_dim, theta) / (2 * np.pi)
  scale = 2.0 ** (_DIGIT_BITS * np.arange(_DIGITS))[:, None]
  frac = np.mod(scale * turns[None], 1.0)
  high = np.floor(frac * 2.0 ** _HIGH_BITS) / 2.0 ** _HIGH_BITS
  return high.astype(np.float32), (frac - high).astype(np.float32)


def rotary_angles(position_ids: jax.Array, head_dim: int,
                  theta: float = 10000.0) -> jax.Array:
  """float32 ``[..., T, D/2]`` rotary angles ``position * theta^(-2i/D)``,
  reduced to ``[-pi, pi)``, to within about 1e-6 rad at any int32
  position.

  A float32 product ``position * frequency`` loses the angle as positions
  grow (0.06 rad between neighbouring tokens at position 2^20; positions
  past 2^24 are not even representable). Here the frequencies live in
  float64 tables built on the host, as fractions of a turn per unit of
  each of the position's three 11-bit digits, split into a part whose
  product with a digit is exact in float32 and a small rest. The device
  adds up the digits' products modulo one turn in float32 (taking the
  fractional part of a float is exact), so the error is a few float32
  roundings of numbers below 4, whatever the position. Works on traced
  positions, under ``jit`` and inside ``shard_map``.

  Args:
    position_ids: integer ``[..., T]`` positions (cast to int32).
    head_dim: the even feature count ``D``.
    theta: the rotary base (a Python number: the tables are built on the
      host).
  """
  high, low = _turn_tables(int(head_dim), float(theta))
  p = jnp.asarray(position_ids).astype(jnp.int32)[..., None]   # [..., T, 1]
  mask = (1 << _DIGIT_BITS) - 1
  turns = jnp.zeros(p.shape[:-1] + (head_dim // 2,), jnp.float32)
  rest = turns
  for j in range(_DIGITS):
    digit = (p >> (_DIGIT_BITS * j)) if j == _DIGITS - 1 else (
        (p >> (_DIGIT_BITS * j)) & mask)
    d = digit.astype(jnp.float32)
    exact = d * high[j]                      # exact: at most 24 bits
    turns = turns + (exact - jnp.floor(exact))
    rest = rest + d * low[j]
  turns = turns + rest
  turns = turns - jnp.floor(turns + 0.5)     # [-1/2, 1/2)
  return turns * np.float32(2 * np.pi)


def apply_rotary(x: jax.Array, position_ids: jax.Array,
                 theta: float = 10000.0) -> jax.Array:
  """Rotates feature pairs ``(x[..., i], x[..., i + D/2])`` by
  ``position * theta^(-2i/D)`` (the "half split" rotary form), with the
  angles of :func:`rotary_angles` (exact to about 1e-6 rad at any
  position).

  Args:
    x: ``[..., T, H, D]`` queries or keys.
    position_ids: int ``[..., T]``, each token's position in its document.
    theta: the rotary base.

  Returns:
    ``x`` rotated, same shape and dtype (computed in float32).
  """
  angles = rotary_angles(position_ids, x.shape[-1], theta)  # [..., T, D/2]
  cos = jnp.cos(angles)[..., None, :]                # [..., T, 1, D/2]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
