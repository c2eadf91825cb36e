"""A test-only attention backend with the in-place capability
(``supports_in_place``), in plain ``jnp`` on top of the ``xla`` backend's
math, so that the CP planner's in-place branch runs on CPU.

It keeps every promise of the contract (jax_cp/attention/backend.py) and
nothing more: wherever the contract leaves a result unspecified, or a
caller breaks a precondition, it writes NaN, so a planner that reads such
rows gives non-finite results instead of right ones by luck.

* ``forward(..., into=(out0, lse0))``: covered rows are written; a covered
  row on which ``out0``/``lse0`` do not hold 0 / ``-inf`` becomes NaN; other
  rows keep ``into``'s values. Needs ``seg.rows_see_keys`` (ValueError).
* ``backward(..., dq_into=)``: a fresh dq is 0 on uncovered rows; with
  ``dq_into`` covered rows are written (NaN where ``dq_into`` does not hold
  0) and the others keep ``dq_into``'s values.
* ``rows_see_keys``: a covered row that sees no key gets NaN (the promise
  lets a backend skip zeroing it).
* Static bounds: a segment longer than ``max_seqlen_q``/``max_seqlen_kv``,
  Q rows covered by two segments, or (backward) two segments reading
  overlapping KV rows turn every result into NaN (kernels sized by the
  bounds, as cuDNN's are, and cuDNN's per-segment dK/dV writes). A segment
  without Q rows does no work, so its ``kv_len`` may exceed the bound (the
  planner leaves such segments uncut by a sliding window; cuDNN clips them
  and counts no KV row of theirs as read).
* The attention calls read only K/V rows inside their segments' KV ranges
  (NaN there propagates, as in a kernel that loads whole ranges) and only
  the Q, out, dO and lse rows their segments cover.

:func:`make_backend` builds one (hashable) backend that logs the in-place
arguments of each call, at trace time, to a list; with or without the
split of bottom-right backward blocks (``split_bottom_right_backward``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_cp.attention import xla
from jax_cp.attention.backend import MASK_TYPES, Backend, Segments
from jax_cp.attention.decompose.merge import merge_rows_jnp


def _ranges(offsets, lens, n: int, live):
  """int32 ``[n]``: how many of the ranges ``[offsets, offsets + lens)``
  (only where ``live``) hold each row."""
  t = jnp.arange(n, dtype=jnp.int32)[None, :]
  lo = offsets.astype(jnp.int32)[:, None]
  hi = lo + lens.astype(jnp.int32)[:, None]
  return jnp.sum((t >= lo) & (t < hi) & live[:, None], axis=0)


def _inspect(seg: Segments, tq: int, tkv: int, mask: str, window_left: int,
             kv_disjoint: bool):
  """(ok [Tq, Tkv], covered [Tq], sees [Tq], kv_read [Tkv], broken ()):
  the mask, covered Q rows, covered rows that see a key, KV rows inside a
  live segment's range, and whether the segments break a static bound or
  overlap."""
  ok, sid = xla.segment_mask(seg, tq, tkv, mask, window_left)
  covered = sid >= 0
  sees = ok.any(axis=1)
  live = (seg.q_lens > 0) & (seg.kv_lens > 0)
  kv_count = _ranges(seg.kv_offsets, seg.kv_lens, tkv, live)
  broken = (jnp.any(seg.q_lens > seg.max_seqlen_q)
            | jnp.any((seg.kv_lens > seg.max_seqlen_kv) & (seg.q_lens > 0))
            | jnp.any(seg.q_lens < 0) | jnp.any(seg.kv_lens < 0)
            | jnp.any(_ranges(seg.q_offsets, seg.q_lens, tq,
                              seg.q_lens > 0) > 1))
  if kv_disjoint:
    broken |= jnp.any(kv_count > 1)
  return ok, covered, sees, kv_count > 0, broken


def _rows(x, row_mask):
  """``row_mask [T]`` broadcast against ``x [T, ...]``."""
  return row_mask.reshape(row_mask.shape + (1,) * (x.ndim - 1))


def _nan_like(x):
  return jnp.full_like(x, jnp.nan)


def _poison(broken, *xs):
  return tuple(jnp.where(broken, _nan_like(x), x) for x in xs)


def _check_call(q, k, v, seg, mask, window_left):
  if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or \
      q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
    raise ValueError(f"need q [Tq, Hq, D], k = v [Tkv, Hkv, D] with Hq % "
                     f"Hkv == 0; got q{q.shape} k{k.shape} v{v.shape}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, "
                     f"{k.dtype}, {v.dtype}")
  if mask not in MASK_TYPES:
    raise ValueError(f"mask must be one of {MASK_TYPES}, got {mask!r}")
  if not isinstance(window_left, int) or window_left < -1 or \
      (window_left >= 0 and mask == "no_mask"):
    raise ValueError(f"window_left must be a static int >= -1 (>= 0 only "
                     f"with a causal mask), got {window_left!r} with "
                     f"{mask!r}")
  for name in ("max_seqlen_q", "max_seqlen_kv"):
    if not isinstance(getattr(seg, name), int):
      raise ValueError(f"seg.{name} must be a static int")


def _check_into(seg, name, x, shape, dtype):
  if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
    raise ValueError(f"{name} must be {tuple(shape)} {jnp.dtype(dtype)}, "
                     f"got {tuple(x.shape)} {x.dtype}")
  if not seg.rows_see_keys:
    raise ValueError(f"{name}= needs Segments(rows_see_keys=True)")


def _clean_kv(k, v, kv_read):
  """Zeroes K/V rows outside every live segment's KV range: the xla math
  multiplies masked probabilities (0) by every row, and 0 * NaN is NaN."""
  zero = jnp.zeros((), k.dtype)
  return (jnp.where(_rows(k, kv_read), k, zero),
          jnp.where(_rows(v, kv_read), v, zero))


def make_backend(name: str, log: list | None = None,
                 split_bottom_right_backward: bool = False) -> Backend:
  """A strict in-place backend named ``name``; each traced call appends
  ``dict(kind=, into=, tq=, mask=)`` (backward calls also ``heads=(Hq,
  Hkv)``) to ``log`` (when given). ``split_bottom_right_backward``: the
  CP planner splits its bottom-right backward blocks into a rectangle
  and a triangle, as it does the cudnn backend's."""

  def record(**entry):
    if log is not None:
      log.append(entry)

  def forward(q, k, v, seg: Segments, *, mask: str, scale: float,
              window_left: int = -1, into=None):
    _check_call(q, k, v, seg, mask, window_left)
    tq, hq, _ = q.shape
    if into is not None:
      _check_into(seg, "into[0]", into[0], q.shape, q.dtype)
      _check_into(seg, "into[1]", into[1], (tq, hq), jnp.float32)
    record(kind="forward", into=into is not None, tq=tq, mask=mask)
    _, covered, sees, kv_read, broken = _inspect(
        seg, tq, k.shape[0], mask, window_left, kv_disjoint=False)
    k, v = _clean_kv(k, v, kv_read)
    out, lse = xla.forward(q, k, v, seg, mask=mask, scale=scale,
                           window_left=window_left)
    if seg.rows_see_keys:   # keyless covered rows are left unwritten
      out = jnp.where(_rows(out, covered & ~sees), _nan_like(out), out)
      lse = jnp.where(_rows(lse, covered & ~sees), _nan_like(lse), lse)
    if into is not None:
      out0, lse0 = into
      neutral = (jnp.all(out0 == 0, axis=(1, 2))
                 & jnp.all(lse0 == -jnp.inf, axis=1))
      out = jnp.where(_rows(out, covered),
                      jnp.where(_rows(out, neutral), out, _nan_like(out)),
                      out0)
      lse = jnp.where(_rows(lse, covered),
                      jnp.where(_rows(lse, neutral), lse, _nan_like(lse)),
                      lse0)
    return _poison(broken, out, lse)

  def backward(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
               scale: float, window_left: int = -1, dq_into=None):
    _check_call(q, k, v, seg, mask, window_left)
    tq = q.shape[0]
    for nm, x, shape in (("out", out, q.shape), ("dout", dout, q.shape),
                         ("lse", lse, q.shape[:2])):
      if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{nm} must be {tuple(shape)}, got {x.shape}")
    if dq_into is not None:
      _check_into(seg, "dq_into", dq_into, q.shape, q.dtype)
    record(kind="backward", into=dq_into is not None, tq=tq, mask=mask,
           heads=(q.shape[1], k.shape[1]))
    _, covered, sees, kv_read, broken = _inspect(
        seg, tq, k.shape[0], mask, window_left, kv_disjoint=True)
    k, v = _clean_kv(k, v, kv_read)
    # Only covered rows of q/out/dout/lse are read.
    keep = lambda x, fill: jnp.where(_rows(x, covered), x,
                                     jnp.full((), fill, x.dtype))
    dq, dk, dv = xla.backward(keep(q, 0), k, v, keep(out, 0),
                              keep(lse, -jnp.inf), keep(dout, 0), seg,
                              mask=mask, scale=scale,
                              window_left=window_left)
    if seg.rows_see_keys:
      dq = jnp.where(_rows(dq, covered & ~sees), _nan_like(dq), dq)
    if dq_into is None:
      dq = jnp.where(_rows(dq, covered), dq, jnp.zeros((), dq.dtype))
    else:
      neutral = jnp.all(dq_into == 0, axis=(1, 2))
      dq = jnp.where(
          _rows(dq, covered),
          jnp.where(_rows(dq, neutral), dq, _nan_like(dq)), dq_into)
    return _poison(broken, dq, dk, dv)

  def is_available(platform: str) -> bool:
    del platform
    return True

  return Backend(name=name, forward=forward, backward=backward,
                 is_available=is_available, merge_rows=merge_rows_jnp,
                 supports_in_place=True, exact_past_bounds=False,
                 split_bottom_right_backward=split_bottom_right_backward)

