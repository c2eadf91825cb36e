"""Exactness of one attention call at any size: the subset reference.

A full float32 reference of a call with a million rows costs ``T^2`` work
and memory. With an output cotangent that is non-zero on a few query rows
``R`` only, the exact results are cheap to compute and still cover every
output of the call:

* ``out[R]`` and ``lse[R]`` need the keys of those rows alone;
* ``dq`` is ``dq[R]`` on those rows and exactly 0 on every other row (a row
  with a zero cotangent has ``dS = P * (dP - rowsum(dO * O)) = 0``);
* ``dk`` and ``dv`` are the sums of the contributions of the rows ``R``,
  and exactly 0 on every key none of them sees.

So :func:`subset_reference` costs ``|R|`` rows of attention over their
segments' keys (float32, highest matmul precision, one row at a time), and
:func:`check_call` runs a backend's forward and backward with such a
cotangent and returns the relative error of each output. Rows in ``R`` are
drawn over the whole buffer, so segments that start deep into it (large
offsets) are checked as well as the first ones.

The reference builds each row's mask from the call's :class:`Segments`
(token offsets and lengths), the contract every backend implements
(:mod:`jax_cp.attention.backend`), and shares no code with a backend.

:class:`Case`, :func:`segments_for` and :func:`run_case` describe and check
one large ``cudnn`` call (``tests/gpu/exact_call.py`` runs them): a row
of ``tokens`` tokens as one document, 25 random documents (``mixed``),
documents of 1k-8k tokens (``short``), or a CP rank's call (``cp``: Q the
last ``1/cp`` of each document, K/V the whole documents, bottom-right).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.backend import Segments

_HIGHEST = jax.lax.Precision.HIGHEST

#: The outputs :func:`check_call` compares, in its result's order.
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class SubsetReference:
  """Exact float32 results of a call for a cotangent on the rows ``rows``.

  Attributes:
    rows: int ``[R]`` the query rows with a non-zero cotangent.
    out: ``[R, Hq, D]`` the attention output on those rows.
    lse: ``[R, Hq]`` their natural-log log-sum-exp (``-inf``: no key).
    dq: ``[R, Hq, D]`` dq on those rows (every other row's dq is 0).
    dk: ``[Tkv, Hkv, D]`` the whole dk.
    dv: ``[Tkv, Hkv, D]`` the whole dv.
  """

  rows: jax.Array
  out: jax.Array
  lse: jax.Array
  dq: jax.Array
  dk: jax.Array
  dv: jax.Array


def _row_segment(rows, seg: Segments):
  """The segment of each row (-1: none covers it), by comparing each row
  with every segment's Q range: ``[R, S]`` booleans, R small."""
  q_off = seg.q_offsets.astype(jnp.int32)
  q_len = seg.q_lens.astype(jnp.int32)
  inside = (rows[:, None] >= q_off[None]) & (rows[:, None]
                                             < (q_off + q_len)[None])
  return jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1)


def subset_reference(q, k, v, seg: Segments, rows, dout_rows, *, mask: str,
                     scale: float | None = None,
                     window_left: int = -1) -> SubsetReference:
  """Exact results of ``fused_attention`` for a cotangent on ``rows`` only.

  Args:
    q: ``[Tq, Hq, D]``; k, v: ``[Tkv, Hkv, D]`` (any float dtype; computed
      in float32).
    seg: the call's segments (the backend contract's meaning).
    rows: int ``[R]`` distinct query rows.
    dout_rows: ``[R, Hq, D]`` the cotangent of ``out`` on those rows (it is
      0 on every other row).
    mask, scale, window_left: as in ``fused_attention``'s backends.

  Returns:
    A :class:`SubsetReference`. Memory: two float32 ``[Tkv, Hkv, D]``
    accumulators plus ``[Hq, max_seqlen_kv]`` scores of one row.
  """
  tkv, hkv, d = k.shape
  hq = q.shape[1]
  g = hq // hkv
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  width = min(int(seg.max_seqlen_kv), tkv)
  rows = jnp.asarray(rows, jnp.int32)
  seg_of_row = _row_segment(rows, seg)
  q_off, q_len = seg.q_offsets.astype(jnp.int32), seg.q_lens.astype(jnp.int32)
  kv_off = seg.kv_offsets.astype(jnp.int32)
  kv_len = jnp.minimum(seg.kv_lens.astype(jnp.int32), width)

  def one_row(carry, inputs):
    dk, dv = carry
    row, s, do = inputs
    covered = s >= 0
    s = jnp.maximum(s, 0)
    start = kv_off[s]
    base = jnp.clip(start, 0, tkv - width)   # dynamic_slice's own clamp
    key = base + jnp.arange(width, dtype=jnp.int32) - start  # in segment
    j = row - q_off[s]                                       # query index
    diag = j + (kv_len[s] - q_len[s] if mask == "causal_bottom_right" else 0)
    sees = covered & (key >= 0) & (key < kv_len[s])
    if mask != "no_mask":
      sees &= key <= diag
      if window_left >= 0:
        sees &= key >= diag - window_left
    kw = jax.lax.dynamic_slice_in_dim(k, base, width).astype(jnp.float32)
    vw = jax.lax.dynamic_slice_in_dim(v, base, width).astype(jnp.float32)
    kw = kw.reshape(width, hkv, 1, d)
    vw = vw.reshape(width, hkv, 1, d)
    qr = q[row].astype(jnp.float32).reshape(hkv, g, d)
    dor = do.astype(jnp.float32).reshape(hkv, g, d)
    scores = jnp.einsum("hgd,khzd->hgk", qr, kw, precision=_HIGHEST) * scale
    scores = jnp.where(sees[None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(sees[None, None], jnp.exp(scores - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(denom[..., 0]),
                    -jnp.inf)
    out = jnp.einsum("hgk,khzd->hgd", p, vw, precision=_HIGHEST)
    dp = jnp.einsum("hgd,khzd->hgk", dor, vw, precision=_HIGHEST)
    delta = jnp.sum(dor * out, axis=-1, keepdims=True)
    ds = p * (dp - delta) * scale
    dq = jnp.einsum("hgk,khzd->hgd", ds, kw, precision=_HIGHEST)
    dk_w = jnp.einsum("hgk,hgd->khd", ds, qr, precision=_HIGHEST)
    dv_w = jnp.einsum("hgk,hgd->khd", p, dor, precision=_HIGHEST)
    dk = jax.lax.dynamic_update_slice_in_dim(
        dk, jax.lax.dynamic_slice_in_dim(dk, base, width) + dk_w, base, 0)
    dv = jax.lax.dynamic_update_slice_in_dim(
        dv, jax.lax.dynamic_slice_in_dim(dv, base, width) + dv_w, base, 0)
    return (dk, dv), (out.reshape(hq, d), lse.reshape(hq), dq.reshape(hq, d))

  zeros = jnp.zeros((tkv, hkv, d), jnp.float32)
  (dk, dv), (out, lse, dq) = jax.lax.scan(
      one_row, (zeros, zeros), (rows, seg_of_row, dout_rows))
  return SubsetReference(rows=rows, out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def relative_error(x, ref) -> jax.Array:
  """``||x - ref|| / ||ref||`` in float32 (``||x||`` where ``ref`` is 0)."""
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  num = jnp.sqrt(jnp.sum(jnp.square(x - ref)))
  den = jnp.sqrt(jnp.sum(jnp.square(ref)))
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), num)


def dq_error(dq, ref: SubsetReference) -> jax.Array:
  """dq against the reference: its rows, and 0 on every other row."""
  dq32 = dq.astype(jnp.float32)
  diff2 = jnp.sum(jnp.square(dq32[ref.rows] - ref.dq))
  elsewhere2 = jnp.sum(jnp.square(dq32.at[ref.rows].set(0.0)))
  den = jnp.sqrt(jnp.sum(jnp.square(ref.dq)))
  return jnp.sqrt(diff2 + elsewhere2) / jnp.where(den > 0, den, 1.0)


def pick_rows(seg_q_offsets, seg_q_lens, tq: int, count: int,
              seed: int = 0) -> np.ndarray:
  """``count`` distinct covered query rows drawn uniformly over the buffer,
  plus the last covered row (where the offsets are largest). Host numpy."""
  rng = np.random.default_rng(seed)
  off = np.asarray(seg_q_offsets, np.int64)
  n = np.asarray(seg_q_lens, np.int64)
  covered = np.zeros(tq + 1, np.int64)
  np.add.at(covered, np.clip(off, 0, tq), 1)
  np.add.at(covered, np.clip(off + n, 0, tq), -1)
  rows = np.flatnonzero(np.cumsum(covered[:tq]) > 0)
  if rows.size == 0:
    raise ValueError("pick_rows: no segment covers a query row.")
  picked = rng.choice(rows, size=min(count, rows.size), replace=False)
  return np.unique(np.concatenate([picked, rows[-1:]])).astype(np.int32)


def check_call(backend, q, k, v, seg: Segments, *, mask: str,
               scale: float | None = None, window_left: int = -1,
               rows: int = 128, seed: int = 0) -> dict[str, float]:
  """Relative errors of a backend's forward and backward on one call.

  The cotangent of ``out`` is random on ``rows`` query rows
  (:func:`pick_rows`) and 0 elsewhere; the backend's ``forward`` and
  ``backward`` run as the CP layer runs them (the backward reads the
  forward's ``out`` and ``lse``), and each output is compared with
  :func:`subset_reference`.

  Args:
    backend: a :class:`~jax_cp.attention.backend.Backend` (e.g. the
      ``"cudnn"`` backend from :mod:`jax_cp.attention.registry`).
    q, k, v, seg, mask, scale, window_left: the call.
    rows: how many query rows carry a cotangent.
    seed: of the rows and the cotangent.

  Returns:
    ``{"out", "lse", "dq", "dk", "dv"}`` relative errors (Python floats).
  """
  picked = pick_rows(seg.q_offsets, seg.q_lens, q.shape[0], rows, seed)
  rng = np.random.default_rng(seed + 1)
  dout_rows = jnp.asarray(
      rng.standard_normal((picked.size,) + q.shape[1:]), jnp.float32)
  kwargs = dict(mask=mask, scale=1.0 / math.sqrt(q.shape[2])
                if scale is None else scale)
  if window_left >= 0:
    kwargs["window_left"] = window_left

  @jax.jit
  def run(q, k, v, seg, rows, dout_rows):
    out, lse = backend.forward(q, k, v, seg, **kwargs)
    dout = jnp.zeros(q.shape, q.dtype).at[rows].set(
        dout_rows.astype(q.dtype))
    dq, dk, dv = backend.backward(q, k, v, out, lse, dout, seg, **kwargs)
    return out[rows], lse[rows], dq, dk, dv

  @jax.jit
  def errors(q, k, v, seg, rows, dout_rows, got):
    # The reference reads the cotangent as the backend saw it (rounded to
    # q's dtype).
    do = dout_rows.astype(q.dtype).astype(jnp.float32)
    ref = subset_reference(q, k, v, seg, rows, do, mask=mask,
                           scale=kwargs["scale"], window_left=window_left)
    out, lse, dq, dk, dv = got
    live = jnp.isfinite(ref.lse)
    lse_err = relative_error(jnp.where(live, lse, 0.0),
                             jnp.where(live, ref.lse, 0.0))
    lse_err = jnp.where(jnp.all(jnp.isfinite(lse) == live), lse_err,
                        jnp.inf)
    return (relative_error(out, ref.out), lse_err, dq_error(dq, ref),
            relative_error(dk, ref.dk), relative_error(dv, ref.dv))

  rows_d = jnp.asarray(picked)
  got = run(q, k, v, seg, rows_d, dout_rows)
  errs = errors(q, k, v, seg, rows_d, dout_rows, got)
  return {name: float(e) for name, e in zip(OUTPUTS, errs)}


@dataclasses.dataclass(frozen=True)
class Case:
  """One call: layout (``one_doc``, ``mixed``, ``short``, ``cp``), sizes,
  dtype, and for ``cp`` the cp size whose rank's call it is."""

  layout: str
  tokens: int
  hq: int
  hkv: int
  d: int
  dtype: str = "bfloat16"
  cp: int = 8

  @property
  def name(self) -> str:
    return (f"{self.layout} T={self.tokens} {self.hq}/{self.hkv}/{self.d} "
            f"{self.dtype}")


def segments_for(case: Case, seed: int = 0):
  """Host values ``(q_lens, kv_lens, q_offsets, kv_offsets, max_q, max_kv,
  tq, mask, tiled)`` of a case's call."""
  rng, t = np.random.default_rng(seed), case.tokens
  if case.layout == "one_doc":
    return [t], [t], [0], [0], t, t, t, "causal_top_left", True
  if case.layout == "mixed":
    cuts = np.sort(rng.choice(np.arange(1, t), size=24, replace=False))
    bounds = np.concatenate([[0], cuts, [t]])
  elif case.layout in ("short", "cp"):
    lens = []
    while sum(lens) < t:
      lens.append(int(rng.integers(1024, 8193)))
    lens[-1] -= sum(lens) - t
    if lens[-1] <= 0:
      lens.pop()
      lens[-1] += t - sum(lens)
    bounds = np.concatenate([[0], np.cumsum(lens)])
  else:
    raise ValueError(f"unknown layout {case.layout!r}")
  lens, starts = np.diff(bounds), bounds[:-1]
  if case.layout == "cp":
    q_lens = -(-lens // case.cp)
    q_off = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    return (q_lens, lens, q_off, starts, int(q_lens.max()), int(lens.max()),
            int(q_lens.sum()), "causal_bottom_right", False)
  return (lens, lens, starts, starts, int(lens.max()), int(lens.max()), t,
          "causal_top_left", False)


def run_case(case: Case, bits: int | None, rows: int, seed: int) -> dict:
  """:func:`check_call` of a case's ``cudnn`` call with ``bits``-wide
  ragged offsets (None: the backend's choice): ``errors`` per output, or
  ``error`` with the message of a call that failed."""
  from jax_cp.attention.cudnn import backend as cudnn  # pylint: disable=import-outside-toplevel
  q_lens, kv_lens, q_off, kv_off, max_q, max_kv, tq, mask, tiled = \
      segments_for(case, seed)
  seg = Segments(*(jnp.asarray(x, jnp.int32) for x in
                   (q_lens, kv_lens, q_off, kv_off)), max_q, max_kv,
                 rows_see_keys=True, tiled=tiled)
  dtype = jnp.dtype(case.dtype)
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (tq, case.hq, case.d), dtype)
  k = jax.random.normal(kk, (case.tokens, case.hkv, case.d), dtype)
  v = jax.random.normal(kv, (case.tokens, case.hkv, case.d), dtype)
  chosen = cudnn.ragged_offset_bits
  if bits is not None:
    cudnn.ragged_offset_bits = lambda *a, **kw: bits
  t0 = time.perf_counter()
  try:
    errs, error = check_call(cudnn.BACKEND, q, k, v, seg, mask=mask,
                             rows=rows, seed=seed), None
  except Exception as e:  # noqa: BLE001  (recorded, the caller goes on)
    errs, error = {}, f"{type(e).__name__}: {str(e)[:300]}"
  finally:
    cudnn.ragged_offset_bits = chosen
  default_bits = chosen((tq, case.hq, case.d),
                        (case.tokens, case.hkv, case.d), len(q_lens), max_q)
  return dict(case=dataclasses.asdict(case), name=case.name,
              bits=default_bits if bits is None else bits,
              default_bits=default_bits, tq=tq, tkv=case.tokens, mask=mask,
              tiled=tiled, segments=len(q_lens),
              q_elements=tq * case.hq * case.d,
              kv_elements=case.tokens * case.hkv * case.d,
              kv_full_head_elements=case.tokens * case.hq * case.d,
              errors=errs, error=error,
              seconds=round(time.perf_counter() - t0, 2))
