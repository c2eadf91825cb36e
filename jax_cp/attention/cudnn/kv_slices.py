"""A backward in sub-calls over ranges of the K/V rows.

The cuDNN backward keeps float32 dK and dV at the query heads (GQA), sized
by the call's K/V rows (:mod:`jax_cp.attention.cudnn.workspace`). Under an
all-gather exchange those rows are the whole row, so past some length even
one KV head's sub-call (:mod:`jax_cp.attention.head_groups`) needs more
scratch than the bound. This module splits such a backward over ``n``
contiguous ranges ("slices") of the K/V buffer: each slice's sub-calls read
a copy of its K/V rows only, write that slice's dK and dV, and give a
share of dQ; the shares are summed in float32.

The split is exact. With the forward's ``out`` and ``lse`` given, every
gradient is a sum over (query row, key) pairs: ``P = exp(s - lse)`` needs
no other key, and ``D = rowsum(dO * out)`` no key at all. So the pairs of a
segment may be cut along the keys. For a segment of ``q`` query rows and
``kv`` keys under a causal mask, query row ``j`` sees the keys ``r <= j +
delta`` (``delta = kv - q`` bottom-right, 0 top-left). Over the slice of
its keys ``[c0, c1)`` (counted from the segment's first key) the rows fall
into three runs:

* ``j < c0 - delta``: no key of the slice (no call);
* ``c0 - delta <= j < c1 - delta``: a prefix of the slice, the keys
  ``[c0, j + delta]``: a bottom-right causal part of rows ``[j0, j1)`` and
  keys ``[c0, j1 + delta)``, in which every row sees a key;
* ``j >= c1 - delta``: every key of the slice: an unmasked part.

An unmasked segment is one unmasked part per slice. Each slice runs as two
calls, the causal parts of all segments and the unmasked parts, since a
call has one mask; the parts of one call read disjoint key ranges, as a
backward that writes dK/dV per segment needs. The rows of a call's parts
all see a key, so the forward's ``lse`` is finite on them.

Sliding windows are not cut (a window bounds the keys a row sees, so a
windowed call's K/V are bounded by the plan already); nor are tiled calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from jax_cp.attention.backend import Segments
from jax_cp.attention.mask import AttentionMask


def slice_bounds(tokens_kv: int, slices: int) -> list[tuple[int, int]]:
  """The ``[a, b)`` row ranges of ``slices`` equal slices of ``tokens_kv``
  K/V rows (the last one shorter when they do not divide; no empty
  range)."""
  if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
    raise ValueError(f"slices={slices!r} must be a positive int")
  size = max(-(-tokens_kv // slices), 1)
  return [(a, min(a + size, tokens_kv)) for a in range(0, tokens_kv, size)]


def slice_parts(seg: Segments, mask: str, a: int, b: int
                ) -> list[tuple[Segments, str]]:
  """The calls of the K/V slice ``[a, b)``: ``(segments, mask)`` over the
  Q buffer and the slice's rows ``k[a:b]`` (the module docstring). One
  segment per segment of ``seg`` in each, empty where it reads no key of
  the slice; static bounds capped by the slice's rows."""
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  ql, kl, qo, ko = map(i32, (seg.q_lens, seg.kv_lens, seg.q_offsets,
                             seg.kv_offsets))
  lo, hi = jnp.clip(ko, a, b), jnp.clip(ko + kl, a, b)
  c0, c1 = lo - ko, hi - ko                 # the slice, in segment keys
  seen = (hi > lo) & (ql > 0)
  rows = b - a

  # A causal part's rows see a prefix of the slice: at most its rows.
  bound_q = {"no_mask": int(seg.max_seqlen_q),
             "causal_bottom_right": min(int(seg.max_seqlen_q), rows)}
  bound_kv = max(min(int(seg.max_seqlen_kv), rows), 1)

  def part(q_from, q_to, kv_len, part_mask):
    q_len = jnp.where(seen, q_to - q_from, 0)
    return dataclasses.replace(
        seg, q_lens=q_len, kv_lens=jnp.where(q_len > 0, kv_len, 0),
        q_offsets=qo + jnp.where(seen, q_from, 0), kv_offsets=lo - a,
        max_seqlen_q=max(bound_q[part_mask], 1), max_seqlen_kv=bound_kv,
        rows_see_keys=True, tiled=False), part_mask

  delta = AttentionMask(mask).diagonal_offset(ql, kl)
  if delta is None:
    return [part(0, ql, c1 - c0, "no_mask")]
  j0 = jnp.clip(c0 - delta, 0, ql)
  j1 = jnp.clip(c1 - delta, j0, ql)
  return [part(j0, j1, j1 + delta - c0, "causal_bottom_right"),
          part(j1, ql, c1 - c0, "no_mask")]


def backward_in_kv_slices(backward: Callable, slices: int, q, k, v, out,
                          lse, dout, seg: Segments, *, mask: str,
                          window_left: int = -1, dq_into=None, **kwargs):
  """``backward(q, k, v, out, lse, dout, seg, mask=mask, **kwargs)`` as
  sub-calls over ``slices`` ranges of the K/V rows (the module docstring).

  Args:
    backward: a backend's backward of one call (the contract of
      :mod:`jax_cp.attention.backend`), taking the static bounds from the
      segments it is given.
    slices: the number of K/V ranges (1: one call, as given).
    q, k, v, out, lse, dout, seg, mask: as for ``backward``.
    window_left: must be -1 when ``slices > 1`` (windows are not cut).
    dq_into: as the in-place contract's: dq holds 0 on the rows the call
      covers, which get the call's dq; every other row keeps its value.
    **kwargs: passed on to every sub-call (scale).

  Returns:
    ``(dq, dk, dv)``, equal to one call's up to the float32 sums of dq.

  Raises:
    ValueError: ``slices`` is not a positive int, a tiled ``seg`` or a
      window with ``slices > 1``.
  """
  bounds = slice_bounds(k.shape[0], slices)
  if len(bounds) <= 1:
    extra = {} if dq_into is None else dict(dq_into=dq_into)
    return backward(q, k, v, out, lse, dout, seg, mask=mask,
                    window_left=window_left, **kwargs, **extra)
  if window_left >= 0 or seg.tiled:
    raise ValueError("a backward over K/V slices takes no sliding window "
                     f"and no tiled segments (window_left={window_left}, "
                     f"tiled={seg.tiled})")
  dq = jnp.zeros(q.shape, jnp.float32) if dq_into is None else \
      dq_into.astype(jnp.float32)
  dks, dvs = [], []
  for a, b in bounds:
    ks, vs = k[a:b], v[a:b]
    dk = dv = None
    for part, part_mask in slice_parts(seg, mask, a, b):
      dq_p, dk_p, dv_p = backward(q, ks, vs, out, lse, dout, part,
                                  mask=part_mask, window_left=-1, **kwargs)
      dq = dq + dq_p.astype(jnp.float32)
      dk = dk_p.astype(jnp.float32) if dk is None else dk + dk_p
      dv = dv_p.astype(jnp.float32) if dv is None else dv + dv_p
    dks.append(dk.astype(k.dtype))
    dvs.append(dv.astype(v.dtype))
  return (dq.astype(q.dtype), jnp.concatenate(dks, axis=0),
          jnp.concatenate(dvs, axis=0))
