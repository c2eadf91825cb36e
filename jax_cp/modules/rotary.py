"""Rotary position embedding driven by per-document position ids.

In a packed row the positions restart at 0 for every document
(:func:`jax_cp.get_position_ids`), and under context parallelism they travel
with the tokens: slice them with :func:`jax_cp.get_batch_on_this_cp_rank`
(local view) or permute them with :func:`jax_cp.reorder_for_cp` (global view)
exactly like the token ids. Rotary embeddings then only need each token's
own position, whatever rank holds it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_frequencies(head_dim: int, theta: float = 10000.0) -> jax.Array:
  """float32 ``[head_dim // 2]`` inverse frequencies ``theta^(-2i/D)``."""
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got "
                     f"{head_dim}")
  i = jnp.arange(head_dim // 2, dtype=jnp.float32)
  return jnp.asarray(theta, jnp.float32) ** (-2.0 * i / head_dim)


def apply_rotary(x: jax.Array, position_ids: jax.Array,
                 theta: float = 10000.0) -> jax.Array:
  """Rotates feature pairs ``(x[..., i], x[..., i + D/2])`` by
  ``position * theta^(-2i/D)`` (the "half split" rotary form).

  Args:
    x: ``[..., T, H, D]`` queries or keys.
    position_ids: int ``[..., T]``, each token's position in its document.
    theta: the rotary base.

  Returns:
    ``x`` rotated, same shape and dtype (computed in float32).
  """
  d = x.shape[-1]
  angles = (position_ids.astype(jnp.float32)[..., None]
            * rotary_frequencies(d, theta))          # [..., T, D/2]
  cos = jnp.cos(angles)[..., None, :]                # [..., T, 1, D/2]
  sin = jnp.sin(angles)[..., None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
