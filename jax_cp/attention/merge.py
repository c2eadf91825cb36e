"""Merging a few rows into a large buffer: ``dst[:, o:o+n] = op(dst[:, o:o+n],
src)``.

Context-parallel attention produces small outputs (the straddling document's
rows, the halo's dK/dV) that belong to a few rows of a large per-rank buffer.
Padding them to full size and adding costs a pass over the whole buffer, and
XLA:GPU copies a custom call's result before a dynamic-update-slice into it.
Backends therefore provide ``merge_rows``; the ``cudnn`` backend runs an
in-place kernel on an aliased buffer, this module holds the contract's checks
and the portable ``jnp`` version.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Values of ``op``.
MERGE_OPS = ("add", "max")


def check_merge_rows(dst, src, row_offset, op) -> None:
  """``dst [B, Td, ...]``, ``src [B, Ts, ...]`` of one dtype, equal B and
  trailing dims, static ``0 <= row_offset <= Td - Ts``, ``op`` in
  :data:`MERGE_OPS`."""
  if op not in MERGE_OPS:
    raise ValueError(f"op must be one of {MERGE_OPS}, got {op!r}")
  if dst.ndim < 2 or src.ndim != dst.ndim or src.shape[0] != dst.shape[0] \
      or src.shape[2:] != dst.shape[2:]:
    raise ValueError(f"dst and src must be [B, T, ...] with equal B and "
                     f"trailing dims; got dst {dst.shape}, src {src.shape}")
  if src.dtype != dst.dtype:
    raise ValueError(f"dst and src must share a dtype; got {dst.dtype} and "
                     f"{src.dtype}")
  if not isinstance(row_offset, int) or not \
      0 <= row_offset <= dst.shape[1] - src.shape[1]:
    raise ValueError(f"row_offset must be a static int in [0, Td - Ts] = "
                     f"[0, {dst.shape[1] - src.shape[1]}], got {row_offset!r}")


def combine(a, b, op: str):
  """``op(a, b)`` formed in float32 (at least), in ``a``'s dtype."""
  wide = jnp.promote_types(a.dtype, jnp.float32)
  a32, b32 = a.astype(wide), b.astype(wide)
  return (a32 + b32 if op == "add" else jnp.maximum(a32, b32)).astype(a.dtype)


def merge_rows_jnp(dst, src, row_offset: int, op: str = "add"):
  """Portable ``merge_rows``: a slice, the op and a dynamic-update-slice
  (``.at[].add`` lowers to a scatter, which crashed XLA:CPU's compiler next
  to collectives in jaxlib 0.11.2)."""
  check_merge_rows(dst, src, row_offset, op)
  if src.shape[1] == 0:
    return dst
  head = jax.lax.slice_in_dim(dst, row_offset, row_offset + src.shape[1],
                              axis=1)
  return jax.lax.dynamic_update_slice_in_dim(dst, combine(head, src, op),
                                             row_offset, axis=1)
