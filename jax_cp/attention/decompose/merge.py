"""Merging partial results: ``dst[:, o:o+n] = op(dst[:, o:o+n], src)``, and
the running sum of a gradient over several attention calls.

Context-parallel attention produces small outputs (the straddling document's
rows, the halo's dK/dV) that belong to a few rows of a large per-rank buffer.
Padding them to full size and adding costs a pass over the whole buffer, and
XLA:GPU copies a custom call's result before a dynamic-update-slice into it.
Backends therefore provide ``merge_rows``; the ``cudnn`` backend runs an
in-place kernel on an aliased buffer, this module holds the contract's checks
and the portable ``jnp`` version.

:class:`GradSum` accumulates one gradient over the calls of a CP step: full
buffers are added with :func:`combine`, prefix-sized parts (the straddling
document's rows) are summed among themselves and merged once with a
backend's ``merge_rows``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

#: Values of ``op``.
MERGE_OPS = ("add", "max")

#: An lse that makes every probability of its row 0 (``exp(score - 1e30)``,
#: with no inf arithmetic): given to a backward call on rows it must not
#: count (a reversed halo call's rows past the straddling document, a
#: tiled call's rows past a segment's length).
NO_WEIGHT_LSE = 1e30


def reversed_prefix(x, rows: int, valid_rows=None, fill=None):
  """The Q-side input of a reversed call (a halo whose band is top-left
  with rows and keys reversed): the first ``rows`` rows of axis 1 of
  ``x [B, T, ...]`` (zero rows past ``T``), ``fill`` on the rows at or
  past each batch entry's ``valid_rows`` (int ``[B]``; with ``fill``
  given), in reverse order."""
  n = min(rows, x.shape[1])
  x = x[:, :n]
  if rows > n:
    x = jnp.pad(x, [(0, 0), (0, rows - n)] + [(0, 0)] * (x.ndim - 2))
  if fill is not None:
    valid = jnp.arange(rows)[None, :] < valid_rows[:, None]    # [B, rows]
    keep = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
    x = jnp.where(keep, x, jnp.asarray(fill, x.dtype))
  return jnp.flip(x, axis=1)


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


def add(a, b):
  """``a + b`` formed in float32 (at least), in ``a``'s dtype."""
  return combine(a, b, "add")


def merge_rows_jnp(dst, src, row_offset: int, op: str = "add"):
  """Portable ``merge_rows``: a slice, the op and a dynamic-update-slice
  (a dynamic-update-slice rather than ``.at[].add``, whose scatter XLA:CPU
  fails to compile next to collectives)."""
  check_merge_rows(dst, src, row_offset, op)
  if src.shape[1] == 0:
    return dst
  head = jax.lax.slice_in_dim(dst, row_offset, row_offset + src.shape[1],
                              axis=1)
  return jax.lax.dynamic_update_slice_in_dim(dst, combine(head, src, op),
                                             row_offset, axis=1)


MergeRows = Callable[..., jax.Array]


def merge_softmax_rows(out, lse, part_out, part_lse, valid,
                       merge_rows: MergeRows = merge_rows_jnp):
  """Attention over two disjoint key sets of the same rows, merged.

  ``out [B, T, H, D]`` / ``lse [B, T, H]`` (float32, natural log) are one
  call's results; ``part_out [B, n, H, D]`` / ``part_lse [B, n, H]`` another
  call's over other keys for rows ``[0, n)``, used where ``valid [B, n]``.
  There the merged row is the softmax over both key sets::

      lse' = logaddexp(lse, part_lse)
      out' = out * exp(lse - lse') + part_out * exp(part_lse - lse')

  formed in float32. A row whose ``part_lse`` is ``-inf`` (it sees none of
  the other keys) keeps its values. The rows go back with ``merge_rows``
  (in place with cudnn): ``out' - out`` added, ``lse'`` by maximum, which
  is ``lse'`` since ``lse' >= lse``.
  """
  n = part_out.shape[1]
  f32 = jnp.promote_types(out.dtype, jnp.float32)
  lse0 = lse[:, :n]
  out0 = out[:, :n].astype(f32)
  use = valid[..., None] & (part_lse > -jnp.inf)
  both = jnp.where(use, jnp.logaddexp(lse0, part_lse), lse0)
  w0 = jnp.where(use, jnp.exp(lse0 - both), 1.0)[..., None]
  w1 = jnp.where(use, jnp.exp(part_lse - both), 0.0)[..., None]
  delta = out0 * (w0 - 1.0) + part_out.astype(f32) * w1
  delta = jnp.where(use[..., None], delta, 0.0)
  out = merge_rows(out, delta.astype(out.dtype), 0, "add")
  lse = merge_rows(lse, both.astype(lse.dtype), 0, "max")
  return out, lse


def merge_softmax(out, lse, parts):
  """Attention over disjoint key sets of the same rows, merged over all
  rows: ``out [B, T, H, D]`` / ``lse [B, T, H]`` of one call and
  ``parts``, a list of ``(out_i, lse_i)`` of the same shapes from calls
  over other keys. Each row becomes the softmax over the union of its
  keys::

      lse' = log(sum_i exp(lse_i))
      out' = sum_i out_i * exp(lse_i - lse')

  in one float32 pass; ``out'`` in ``out``'s dtype. Rows whose every
  ``lse_i`` is ``-inf`` (no keys) get 0 and ``-inf``.
  """
  f32 = jnp.promote_types(out.dtype, jnp.float32)
  outs = [out] + [o for o, _ in parts]
  lses = [lse.astype(f32)] + [l.astype(f32) for _, l in parts]
  top = lses[0]
  for l in lses[1:]:
    top = jnp.maximum(top, l)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = [jnp.exp(l - top) for l in lses]
  z = sum(weights[1:], weights[0])
  some = z > 0
  inv = jnp.where(some, 1.0 / jnp.where(some, z, 1.0), 0.0)
  merged = sum((o.astype(f32) * (w * inv)[..., None]
                for o, w in zip(outs[1:], weights[1:])),
               outs[0].astype(f32) * (weights[0] * inv)[..., None])
  total = jnp.where(some, top + jnp.log(jnp.where(some, z, 1.0)), -jnp.inf)
  return merged.astype(out.dtype), total.astype(lse.dtype)


class GradSum:
  """The running sum of one gradient over the attention calls of a step.

  Full-size parts are added as they come (:func:`add`, one fused pass
  each). Parts that cover only a prefix of the rows (the straddling
  document's calls) are summed among themselves in float32, which is cheap,
  and merged into the full sum once with a backend's ``merge_rows`` (in
  place with cudnn: no pass over the full buffer and no copy of it).

  Attributes:
    full: the sum of the full-size parts (None until one comes).
    prefix: the float32 sum of the prefix parts (None until one comes).
  """

  def __init__(self):
    self.full: jax.Array | None = None
    self.prefix: jax.Array | None = None

  def add(self, part, rows: int | None) -> None:
    """Adds ``part``: full-size when ``rows`` is None, else the first
    ``rows`` rows of axis 1."""
    if rows is None:
      self.full = part if self.full is None else add(self.full, part)
    else:
      wide = part.astype(jnp.promote_types(part.dtype, jnp.float32))
      self.prefix = wide if self.prefix is None else self.prefix + wide

  def total(self, merge_rows: MergeRows, dtype):
    """The full sum with the prefix merged in; the prefix alone (in
    ``dtype``) if no full part came; None if nothing came."""
    prefix = None if self.prefix is None else self.prefix.astype(dtype)
    if self.full is None:
      return prefix
    if prefix is None:
      return self.full
    return merge_rows(self.full, prefix.astype(self.full.dtype), 0, "add")
