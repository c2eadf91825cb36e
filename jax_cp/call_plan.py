"""The call plan of CP attention: which varlen attention calls a rank runs.

Pure functions of the static config and the row metadata, with no
communication and no backend: the forward's calls per strategy
(:func:`forward_calls`), the backward's (:func:`backward_calls`), how each
backward call produces its dq (:func:`dq_writes`), and a call's metadata
as the backend's flat segment list (:func:`segments`). docs/design.md,
Call plans, describes the plans this module builds.

Names at the function boundaries: ``cu_seqlens``/``cu_seqlens_padded`` are
the row metadata ``[B, N+1]`` (valid and padded document boundaries),
``rank`` this rank's int32 index on the cp axis.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cp import metadata
from jax_cp.attention.backend import Segments
from jax_cp.cp_config import CPConfig
from jax_cp.strategy import CPLoadBalancingStrategy

_NLB = CPLoadBalancingStrategy.NO_LOAD_BALANCE

@dataclasses.dataclass(frozen=True)
class Call:
  """One varlen attention call.

  Attributes:
    meta: per-segment lengths/offsets ``[B, n]``.
    mask: backend mask type.
    max_q, max_kv: static bounds on the segment lengths.
    exchanged: KV come from the exchanged buffer (else the local chunk).
    q_rows: the call's segments lie in the first ``q_rows`` local Q rows of
      each row (static); None = anywhere. NO_LOAD_BALANCE's straddle call
      and its halo call have it; the halo call *reads* just that prefix of
      Q/out/dO (:attr:`DqWrite.q_rows`).
    kv_rows: the call reads only the first ``kv_rows`` rows of its KV
      buffer; None = all.
    overlaps_previous: its Q rows are those of earlier calls (the
      triangles of split bottom-right blocks, the parts of a windowed
      DUAL_CHUNK_SWAP block); every other call's rows are disjoint from
      all others'. In the forward such a call's out/lse are merged into
      the earlier calls' by log-sum-exp.
    halo_rows: None, or this is the *halo call* of NO_LOAD_BALANCE's
      straddling document (:func:`_split_straddle`): the document's first
      local Q rows against its keys before the chunk, and this is the int32
      ``[B]`` number of its first local Q rows that belong to that
      document. Forward: its out/lse on those rows are merged into the
      local call's by log-sum-exp, the other rows are dropped. Backward:
      its dq is summed like a triangle's, its dK/dV are the exchanged
      buffer's.
    reversed: a halo call that reads the first ``q_rows`` local Q rows
      (zero rows past the chunk) and the ``kv_rows`` exchanged rows before
      the chunk, both in reverse row order, with the top-left band (a
      sliding window that not every row sees whole). In the backward the
      planner zeroes out/dO and puts a huge lse on the rows past
      ``halo_rows``, so they add nothing. Otherwise a halo call is an
      unmasked rectangle on the exchanged buffer in sequence order, with
      exact segments.
    window_rows: None, or the call runs over the compact buffers of
      DUAL_CHUNK_SWAP's windowed near and far parts (their index maps,
      :func:`metadata.window_compaction`): Q (and in the backward out,
      dO, lse) gathered from the local rows, K/V from the exchanged ones;
      its outputs are gathered back (:func:`_dcs_window_calls`). It
      ``overlaps_previous``.
    tiled: every row holds one document slot that may fill it (cp=1, N=1,
      a bound of the whole row): the backend's segments are tiled
      (:attr:`jax_cp.attention.backend.Segments.tiled`).

  The calls of a step cover disjoint Q rows, so their outputs merge
  without log-sum-exp rescaling: a later call writes its rows into the
  buffers of the calls before it (in place when the backend
  ``supports_in_place``), or the planner adds them. The exceptions are a
  halo call, whose rows are merged by log-sum-exp, and the calls that
  ``overlaps_previous``.
  """

  meta: metadata.StepMetadata
  mask: str
  max_q: int
  max_kv: int
  exchanged: bool
  q_rows: int | None = None
  kv_rows: int | None = None
  overlaps_previous: bool = False
  halo_rows: jnp.ndarray | None = None
  reversed: bool = False
  window_rows: metadata.WindowRows | None = None
  tiled: bool = False


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _bounded_max_kv(max_q: int, max_kv: int, window_left: int) -> int:
  """The KV bound of a bottom-right call cut to its window
  (:func:`_cut_to_window`): at most ``q_len + window_left`` KV rows."""
  return max_kv if window_left < 0 else min(max_kv, max_q + window_left)


def _cut_to_window(call: Call, window_left: int) -> Call:
  """A bottom-right call without the KV rows before the window of its first
  Q row: Q row 0 sees KV rows from ``kv_len - q_len - window_left`` on, and
  later rows from further on, so nothing before that is read. The cut
  keeps the bottom-right alignment (the last Q row still meets the last KV
  row) and leaves ``kv_len >= q_len``; it shrinks the kernel's KV range
  to ``q_len + window_left`` rows."""
  if window_left < 0 or call.mask != "causal_bottom_right":
    return call
  m = call.meta
  skip = jnp.where(m.q_lens > 0,
                   jnp.maximum(m.kv_lens - m.q_lens - window_left, 0), 0)
  meta = m._replace(kv_lens=m.kv_lens - skip, kv_offsets=m.kv_offsets + skip)
  return dataclasses.replace(
      call, meta=meta,
      max_kv=_bounded_max_kv(call.max_q, call.max_kv, window_left))


def rows_before_chunk(cfg: CPConfig) -> int:
  """``H``, the rows before the chunk that a windowed NO_LOAD_BALANCE
  query can see: the received halo, or with an all-gather the last
  ``min(left, max_seqlen - 1, rows before the last chunk)`` of them."""
  ex = cfg.exchange
  if ex.kind == "halo":
    return ex.halo_tokens
  if ex.kind == "none":
    return 0
  return max(min(cfg.window_left, cfg.max_seqlen - 1,
                 (cfg.cp_size - 1) * cfg.local_tokens), 0)


def _split_straddle(cfg: CPConfig, call: Call) -> list[Call]:
  """NO_LOAD_BALANCE's straddle call (bottom-right, cut to the window if
  there is one) as a local call and a halo call, which cuDNN runs faster,
  in the forward and in the backward.

  With cuDNN 9.19 a bottom-right backward is slower than a top-left one
  (about 2x; with a band it skips no masked tile, about 11x;
  docs/design.md, Measurements and Sliding window), and splitting it
  into a rectangle and a triangle costs a call. Attention over a set of
  keys is a log-sum-exp merge of attention over its parts, so the
  straddling document's keys are split where the chunk starts:

  * its local keys: a top-left call (with the band, if any) on the
    document's local rows, reading the local chunk only
    (:func:`_step_calls` runs it as part of the chunk's local call, which
    costs no call of its own);
  * its keys before the chunk, the *halo call*:

    - if every one of the document's rows sees all of them (no window,
      or ``left - Tl >= H - 1``): the unmasked rectangle of the
      bottom-right block (:func:`metadata.split_bottom_right`) on the
      exchanged buffer, the received halo alone when there is one;
    - else (halo row ``m`` at chunk position ``m - H``; Q row ``i`` sees
      ``m >= i + H - left``): over the first ``Lq = left`` local rows
      with both axes reversed (``i' = Lq-1-i``, ``m' = H-1-m``) that is
      ``m' <= i'``, plain top-left causal, and the document's ``h`` halo
      rows are the first ``h`` reversed ones (KV length ``h``;
      :attr:`Call.reversed`). Its rows past the straddling document's
      are not the document's and are dropped.

  Returns ``[halo call, local call]`` (only the local call when nothing
  lies before the chunk)."""
  tl, left = cfg.local_tokens, cfg.window_left
  m = call.meta
  q_doc = m.q_lens                                  # [B, 1]
  zero = jnp.zeros_like(q_doc)
  local = Call(metadata.StepMetadata(q_doc, zero, q_doc, zero),
               "causal_top_left", call.max_q, call.max_q, False)
  if cfg.exchange.kind == "none":
    return [local]
  halo = rows_before_chunk(cfg)
  if left < 0 or left - tl >= halo - 1:
    rect, _ = metadata.split_bottom_right(m)
    kv_rows = halo if cfg.exchange.kind == "halo" else None
    halo_call = Call(rect, "no_mask", call.max_q, call.max_kv, True,
                     q_rows=call.q_rows, kv_rows=kv_rows,
                     halo_rows=rect.q_lens[..., 0])
    return [halo_call, local]
  rows = call.q_rows if call.q_rows is not None else tl
  h = jnp.where(q_doc > 0, m.kv_lens - q_doc, 0)
  has = h > 0
  meta = metadata.StepMetadata(jnp.where(has, left, 0), zero, h, zero)
  valid = jnp.where(has, jnp.minimum(q_doc, rows), 0)[..., 0]
  halo_call = Call(meta, "causal_top_left", left, halo, True, q_rows=left,
                   kv_rows=halo, halo_rows=valid, reversed=True)
  return [halo_call, local]


def merge_calls(calls: list[Call]) -> Call:
  """One call running the segments of several calls of the same mask.

  Their Q rows must be disjoint (those of any two CP calls are, except a
  split block's rectangle and its triangle). For a backward call their KV
  rows must be disjoint too: a fused kernel writes dK/dV per segment, it
  does not accumulate them. The bounds are the largest of the calls'."""
  first = calls[0]
  if len(calls) == 1:
    return first
  for c in calls:
    limits = (c.q_rows, c.kv_rows, c.halo_rows)
    if ((c.mask, c.exchanged) != (first.mask, first.exchanged)
        or any(x is not None for x in limits)):
      raise ValueError(
          "cannot merge calls: they must share the mask and the K/V source "
          "and have no row limits (q_rows, kv_rows, halo_rows); "
          f"got masks {[x.mask for x in calls]}, exchanged "
          f"{[x.exchanged for x in calls]}")
  meta = metadata.StepMetadata(*(
      jnp.concatenate([getattr(c.meta, f) for c in calls], axis=-1)
      for f in metadata.StepMetadata._fields))
  return dataclasses.replace(first, meta=meta,
                             max_q=max(c.max_q for c in calls),
                             max_kv=max(c.max_kv for c in calls))


def window_left(cfg: CPConfig, call: Call) -> int:
  """The band a call runs with: the config's window on a causal call in
  sequence order, none (-1) on an unmasked call and on a reversed or
  compact one (whose rows all lie within the window, so its plain
  top-left mask is the band already)."""
  if (call.mask == "no_mask" or call.reversed
      or call.window_rows is not None):
    return -1
  return cfg.window_left


def _dcs_window_split(cfg: CPConfig, backward: bool) -> bool:
  """DUAL_CHUNK_SWAP at cp > 1 with a window, run without bottom-right
  calls in this direction (:attr:`CPConfig.dcs_window_plan`)."""
  split = ("split", "split_backward") if backward else ("split",)
  return (cfg.strategy is not _NLB and cfg.cp_size > 1
          and cfg.window_left >= 0 and cfg.dcs_window_plan in split)


def _dcs_window_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                      ) -> list[Call]:
  """DUAL_CHUNK_SWAP with a sliding window, the same three calls each way,
  none bottom-right (:func:`metadata.split_windowed_block`; docs/design.md,
  Call plans):

  * ``diag``: both steps' chunks against their own keys, the top-left
    band, on the exchanged buffer (the first call: it makes out/lse, dq);
  * ``near``: unmasked, each chunk's rows against its nearest ``b`` keys
    before it;
  * ``far``: top-left causal, its first ``min(q, left)`` rows in reverse
    order against the next ``f`` keys in reverse order.

  ``near`` and ``far`` run over compact buffers that hold, per (step,
  document), the rows and keys they need (:func:`metadata.window_compaction`),
  so no two segments share a KV row and each runs as one backward call;
  their results are merged by log-sum-exp (forward) or summed (backward)
  into the diagonal's. Bounds, with ``c = ceil(W / 2cp)`` the longest
  chunk: ``diag`` ``c x c``, ``near`` ``min(left, c)`` rows against at
  most ``left - 1`` keys, ``far`` ``min(left, c)`` each way. With a
  window of 0 the diagonals alone run; with 1 no key is near."""
  cp, left = cfg.cp_size, cfg.window_left
  c = max(_ceil_div(cfg.max_seqlen, 2 * cp), 1)
  steps = tuple(metadata.dual_chunk_swap_step(cu_seqlens, cu_seqlens_padded,
                                              cp, rank, step)
                for step in (0, 1))
  tl, t = cfg.local_tokens, cfg.total_tokens
  diag = merge_calls([
      Call(metadata.split_windowed_block(m, left, tl, t)[0],
           "causal_top_left", c, c, True) for m in steps])
  if left == 0:
    return [diag]
  sq, skv = metadata.window_compaction_sizes(
      cu_seqlens_padded.shape[-1] - 1, cp, left, c, tl, t)
  near, far, rows = metadata.window_compaction(
      steps, cu_seqlens_padded, cp, left, tl, t, sq, skv)
  rows_q = max(min(left, c), 1)
  far_call = Call(far, "causal_top_left", rows_q, rows_q, True,
                  overlaps_previous=True, window_rows=rows)
  if left == 1:
    return [diag, far_call]
  near_call = Call(near, "no_mask", rows_q,
                   max(min(left - 1, (2 * cp - 1) * c), 1), True,
                   overlaps_previous=True, window_rows=rows)
  return [diag, near_call, far_call]


def _step_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                ) -> list[Call]:
  """The calls of both directions, in forward order: one per step
  (DUAL_CHUNK_SWAP), cut to the sliding window; or NO_LOAD_BALANCE's
  local call and halo call (:func:`_split_straddle`), the same in both
  directions: the straddle call split where the chunk starts, its local
  part run as the first segment of the chunk's local call (same mask and
  K/V, other rows). No halo call when nothing lies before the chunk."""
  calls = [_cut_to_window(c, cfg.window_left)
           for c in _unwindowed_calls(cfg, cu_seqlens, cu_seqlens_padded,
                                      rank)]
  if cfg.strategy is not _NLB or len(calls) == 1:
    return calls
  local, straddle = calls
  *halo, straddle_local = _split_straddle(cfg, straddle)
  return [merge_calls([straddle_local, local]), *halo]


def forward_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                  ) -> list[Call]:
  """The varlen attention calls of this rank's forward, in order.

  DUAL_CHUNK_SWAP's two steps run as one call: their Q rows are disjoint
  and a forward may read the same KV rows from several segments.

  With a sliding window every call runs with the band (the backend's
  ``window_left``); bottom-right calls also drop the KV rows before the
  band (:func:`_cut_to_window`).

  NO_LOAD_BALANCE runs the chunk's local call, then the halo call
  (:func:`_split_straddle`), so the local call hides the exchange. The
  halo call's out/lse are merged into the local call's rows by
  log-sum-exp (the only forward call whose rows are not disjoint from the
  others')."""
  if _dcs_window_split(cfg, backward=False):
    return _dcs_window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  calls = _step_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  if cfg.strategy is not _NLB and len(calls) > 1:
    return [merge_calls(calls)]
  return calls


def _unwindowed_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                      ) -> list[Call]:
  # w: the bound on a padded document, cp: the number of ranks.
  w, cp = cfg.max_seqlen, cfg.cp_size
  cu, cuP = cu_seqlens, cu_seqlens_padded
  if cp == 1:
    m = metadata.no_load_balance_step(cu, cuP, 1, 0, cfg.total_tokens)
    # Q and KV lengths agree per document: top-left == bottom-right, and
    # top-left is the faster cuDNN backward. One document slot per row,
    # starting at 0 (cu_seqlens_padded starts at 0) and bounded by the row:
    # the rows tile the buffer (docs/design.md, Tiled calls).
    tiled = cfg.causal and cu.shape[-1] == 2 and w >= cfg.total_tokens
    return [Call(m, "causal_top_left" if cfg.causal else "no_mask", w, w,
                 False, tiled=tiled)]
  if cfg.strategy is _NLB:
    return _no_load_balance_calls(cfg, cu, cuP, rank)
  # DUAL_CHUNK_SWAP: each Q chunk holds c = W / 2cp tokens of a document.
  c = max(_ceil_div(w, 2 * cp), 1)
  calls = []
  for step in (0, 1):
    m = metadata.dual_chunk_swap_step(cu, cuP, cp, rank, step, cfg.causal)
    if cfg.causal:
      # Step 0 sees at most chunks 0..r <= cp-1, step 1 the whole document.
      calls.append(Call(m, "causal_bottom_right", c,
                        min(w, cp * c) if step == 0 else w, True))
    else:
      calls.append(Call(m, "no_mask", c, w, True))
  return calls


def _no_load_balance_calls(cfg: CPConfig, cu, cuP, rank) -> list[Call]:
  """Documents inside the chunk need only local K/V (and can run while the
  exchange is in flight): one top-left call. The one straddling document
  per row needs the exchanged buffer: one bottom-right call, which
  :func:`_split_straddle` splits further. It reaches at most W-1 tokens
  into the chunk, so it only needs the first W-1 Q rows: small calls for
  short documents."""
  w, tl = cfg.max_seqlen, cfg.local_tokens
  local, straddle = metadata.no_load_balance_split(
      cu, cuP, cfg.cp_size, rank, cfg.total_tokens,
      cfg.exchange.buffer_start(rank))
  bound = min(w, tl)
  q_rows = min(max(w - 1, 1), tl)
  return [Call(local, "causal_top_left", bound, bound, False),
          Call(straddle, "causal_bottom_right", q_rows, w, True,
               q_rows=q_rows if q_rows < tl else None)]


def backward_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                   ) -> list[Call]:
  """The forward's calls in reverse order.

  NO_LOAD_BALANCE: the halo call first, so the halo's gradients travel
  back while the local call runs; none of its calls is bottom-right
  (:func:`_split_straddle`).

  DUAL_CHUNK_SWAP: one call per step, bottom-right blocks split into an
  unmasked rectangle followed by a top-left triangle where the config
  says so (``split_causal_backward``; the triangle ``overlaps_previous``).
  The steps read overlapping KV rows (chunks ``0..r`` of every
  document), so they stay separate calls; their triangles do not (chunk
  ``r`` against chunk ``2cp-1-r``) and run as one call after both
  rectangles. With a sliding window: :func:`_dcs_window_calls`, none
  bottom-right (or, with ``dcs_window_plan="bottom_right"``, whole
  bottom-right banded calls per step)."""
  if _dcs_window_split(cfg, backward=True):
    return _dcs_window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  calls = _step_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  out, triangles = [], []
  for call in reversed(calls):
    if call.mask != "causal_bottom_right" or not cfg.split_causal_backward:
      out.append(call)
      continue
    rect, diag = metadata.split_bottom_right(call.meta)
    out.append(dataclasses.replace(call, meta=rect, mask="no_mask"))
    triangles.append(dataclasses.replace(
        call, meta=diag, mask="causal_top_left", max_kv=call.max_q,
        overlaps_previous=True))
  if triangles:
    out.append(merge_calls(triangles))
  return out


@dataclasses.dataclass(frozen=True)
class DqWrite:
  """How one backward call produces its dq.

  Attributes:
    into: the call writes its rows into the dq of the calls before it (the
      backend's ``dq_into``, in place) instead of making a fresh one.
    q_rows: the call reads only the first ``q_rows`` rows of Q/out/dO/lse
      and its dq covers only those (None: all rows).
  """

  into: bool = False
  q_rows: int | None = None


def dq_writes(calls: list[Call], in_place: bool) -> list[DqWrite]:
  """One :class:`DqWrite` per backward call.

  The first other call makes the full-size dq; with an in-place backend
  every later one writes into it (its rows are disjoint from the
  others'), without one each returns a fresh dq that the planner adds. A
  triangle or halo call is summed either way.
  """
  writes = []
  have_dq = False
  for call in calls:
    if call.overlaps_previous or call.halo_rows is not None:
      writes.append(DqWrite(q_rows=call.q_rows))
      continue
    writes.append(DqWrite(into=in_place and have_dq))
    have_dq = True
  return writes


def segments(call: Call, q_tokens: int, kv_tokens: int) -> Segments:
  """A call's ``[B, n]`` metadata over B rows of ``q_tokens`` Q and
  ``kv_tokens`` KV rows -> one segment list over the flattened rows,
  heaviest segment first.

  Every CP call has ``kv_len > 0`` whenever ``q_len > 0`` (and
  ``kv_len >= q_len`` where it is bottom-right), so every covered row sees
  a key (``rows_see_keys``).

  Segment order does not change the result. Fused kernels start their
  thread blocks roughly in segment order, so putting the most work (causal
  pairs ``q * (2 * kv - q)``) first leaves short blocks for the end of the
  grid instead of one long document's (docs/design.md, Measurements).
  """
  m = call.meta
  rows = jnp.arange(m.q_lens.shape[0], dtype=jnp.int32)[:, None]

  def flat(x):
    return x.reshape(-1).astype(jnp.int32)

  seg = [flat(m.q_lens), flat(m.kv_lens), flat(m.q_offsets + rows * q_tokens),
         flat(m.kv_offsets + rows * kv_tokens)]
  max_q = max(min(call.max_q, q_tokens), 1)
  max_kv = max(min(call.max_kv, kv_tokens), 1)
  if call.tiled and max_q == q_tokens and max_kv == kv_tokens and \
      m.q_lens.shape[-1] == 1:
    # Segment i is row i, whole: kept in row order.
    return Segments(*seg, max_q, max_kv, rows_see_keys=True, tiled=True)
  if seg[0].shape[0] > 1:
    q, kv = seg[0].astype(jnp.float32), seg[1].astype(jnp.float32)
    order = jnp.argsort(-(q * (2 * kv - q)), stable=True)
    seg = [x[order] for x in seg]
  return Segments(*seg, max_q, max_kv, rows_see_keys=True)
