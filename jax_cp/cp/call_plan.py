"""The call plan of CP attention: which varlen attention calls a rank runs.

Pure functions of the static config and the row metadata, with no
communication and no backend call: :func:`forward_plan` and
:func:`backward_plan` return the calls of a rank in order, each of one of
three kinds, with its segments ready for the backend, so the executor
(:mod:`jax_cp.cp.vjp`) runs them without deriving anything:

* :class:`RowsCall`: a call on this rank's Q rows (local or exchanged
  K/V) whose rows no other :class:`RowsCall` of the forward covers; it
  writes them into the earlier calls' outputs (``into``, in place with a
  backend that supports it) or its outputs are added.
* :class:`HaloCall`: NO_LOAD_BALANCE's halo call, the straddling
  document's first rows against its keys before the chunk
  (:mod:`jax_cp.attention.decompose.straddle`), merged by log-sum-exp.
* :class:`CompactCalls`: windowed DUAL_CHUNK_SWAP's near and far parts,
  over compact buffers of the rows and keys they need
  (:func:`jax_cp.cp.metadata.window_compaction`), merged by log-sum-exp.

The ring exchange has a plan of its own, one :class:`RowsCall` per step
(:func:`ring_plan`), which :mod:`jax_cp.cp.ring` runs.

docs/internals.md, Call plans, describes the plans this module builds.

Names at the function boundaries: ``cu_seqlens``/``cu_seqlens_padded`` are
the row metadata ``[B, N+1]`` (valid and padded document boundaries),
``rank`` this rank's int32 index on the cp axis.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cp.attention.backend import Segments, row_segments
from jax_cp.attention.decompose import straddle
from jax_cp.cp import metadata
from jax_cp.cp.config import CPConfig
from jax_cp.cp.strategy import CPLoadBalancingStrategy

_NLB = CPLoadBalancingStrategy.NO_LOAD_BALANCE


@dataclasses.dataclass(frozen=True)
class RowsCall:
  """A call on this rank's local Q rows.

  Attributes:
    segments: the backend's segments over the ``B * Tl`` local Q rows and
      the K/V buffer's rows.
    mask: the backend mask.
    window_left: the band the call runs with (-1: none).
    exchanged: K/V are the exchanged buffer (else the local chunk).
    into: the call writes its rows into the outputs of the calls before it
      (forward: ``out``/``lse``; backward: ``dq``), in place, by the
      backend's in-place writes; otherwise its outputs are added (``lse``
      by maximum). The first call of a plan makes the outputs.
  """

  segments: Segments
  mask: str
  window_left: int
  exchanged: bool
  into: bool = False


@dataclasses.dataclass(frozen=True)
class HaloCall:
  """NO_LOAD_BALANCE's halo call (:mod:`jax_cp.attention.decompose.straddle`).

  Attributes:
    call: the halo call.
    before_chunk: None: K/V are the exchanged buffer as it is (the
      received halo, or the all-gathered row with the segments' offsets
      into it); else the ``before_chunk`` rows right before the chunk (the
      received halo, or those rows cut from the all-gathered row), which a
      reversed call needs.
  """

  call: straddle.HaloCall
  before_chunk: int | None


@dataclasses.dataclass(frozen=True)
class CompactCalls:
  """Windowed DUAL_CHUNK_SWAP's near and far calls over compact buffers.

  Attributes:
    rows: the index maps of the compact buffers.
    calls: ``(segments, mask)`` of each call over the compact Q and K/V
      buffers: the far part, top-left causal, and (with a window of 2 or
      more) the near part, unmasked.
  """

  rows: metadata.WindowRows
  calls: tuple[tuple[Segments, str], ...]


@dataclasses.dataclass(frozen=True)
class _Block:
  """A call while the plan is built: per-document metadata ``[B, n]``, the
  mask, the static bounds, the K/V source, ``q_rows`` (the block's
  segments lie in the first ``q_rows`` local rows; None: anywhere), and
  whether its segments tile the rows (``tiled``) or may, by the traced
  metadata (``may_tile``: docs/internals.md, Tiled calls)."""

  meta: metadata.StepMetadata
  mask: str
  max_q: int
  max_kv: int
  exchanged: bool
  q_rows: int | None = None
  tiled: bool = False
  may_tile: bool = False


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _kv_tokens(cfg: CPConfig, exchanged: bool) -> int:
  """The rows of a call's K/V buffer: the local chunk, the received halo,
  or the all-gathered row."""
  if not exchanged or cfg.exchange.kind == "none":
    return cfg.local_tokens
  if cfg.exchange.kind == "halo":
    return cfg.exchange.halo_tokens
  return cfg.total_tokens


def _window_left(cfg: CPConfig, block: _Block) -> int:
  """The band a block runs with: the config's window on a causal block,
  none on an unmasked one."""
  return -1 if block.mask == "no_mask" else cfg.window_left


def _rows_call(cfg: CPConfig, block: _Block, into: bool) -> RowsCall:
  m = block.meta
  seg = row_segments(m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets,
                     cfg.local_tokens, _kv_tokens(cfg, block.exchanged),
                     block.max_q, block.max_kv, rows_see_keys=True,
                     tiled=block.tiled, heaviest_first=True,
                     may_tile=block.may_tile and not into)
  return RowsCall(seg, block.mask, _window_left(cfg, block), block.exchanged,
                  into)


def _in_order(cfg: CPConfig, blocks: list[_Block]) -> list[RowsCall]:
  """Blocks of disjoint Q rows as calls: the first makes the outputs,
  each later one writes into them where the backend writes in place."""
  in_place = cfg.backend.supports_in_place
  return [_rows_call(cfg, b, into=in_place and i > 0)
          for i, b in enumerate(blocks)]


def _bounded_max_kv(max_q: int, max_kv: int, window_left: int) -> int:
  """The KV bound of a bottom-right block cut to its window
  (:func:`_cut_to_window`): at most ``q_len + window_left`` KV rows."""
  return max_kv if window_left < 0 else min(max_kv, max_q + window_left)


def _cut_to_window(block: _Block, window_left: int) -> _Block:
  """A bottom-right block without the KV rows before the window of its
  first Q row: Q row 0 sees KV rows from ``kv_len - q_len - window_left``
  on, and later rows from further on, so nothing before that is read. The
  cut keeps the bottom-right alignment (the last Q row still meets the
  last KV row) and leaves ``kv_len >= q_len``; it shrinks the kernel's KV
  range to ``q_len + window_left`` rows."""
  if window_left < 0 or block.mask != "causal_bottom_right":
    return block
  m = block.meta
  skip = jnp.where(m.q_lens > 0,
                   jnp.maximum(m.kv_lens - m.q_lens - window_left, 0), 0)
  meta = m._replace(kv_lens=m.kv_lens - skip, kv_offsets=m.kv_offsets + skip)
  return dataclasses.replace(
      block, meta=meta,
      max_kv=_bounded_max_kv(block.max_q, block.max_kv, window_left))


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


def _split_straddle(cfg: CPConfig, block: _Block
                    ) -> tuple[_Block, HaloCall | None]:
  """NO_LOAD_BALANCE's straddle block (bottom-right, cut to the window if
  there is one) split where the chunk starts (docs/internals.md, Call
  plans): its local keys as a top-left block on the document's local
  rows, which becomes a segment of the chunk's local call, and its keys
  before the chunk as the halo call
  (:mod:`jax_cp.attention.decompose.straddle`):

  - a rectangle when every one of the document's rows sees all of them
    (no window, or ``left - Tl >= H - 1``), on the exchanged buffer (the
    received halo alone when there is one);
  - else reversed: halo row ``m`` is at chunk position ``m - H`` and Q
    row ``i`` sees it when ``m >= i + H - left``; over the first ``left``
    local rows with both axes reversed that is plain top-left causal.

  Returns ``(local block, halo call)``; no halo call when nothing lies
  before the chunk."""
  tl, left = cfg.local_tokens, cfg.window_left
  m = block.meta
  q_doc = m.q_lens                                  # [B, 1]
  zero = jnp.zeros_like(q_doc)
  local = _Block(metadata.StepMetadata(q_doc, zero, q_doc, zero),
                 "causal_top_left", block.max_q, block.max_q, False)
  if cfg.exchange.kind == "none":
    return local, None
  halo = rows_before_chunk(cfg)
  keys = jnp.where(q_doc > 0, m.kv_lens - q_doc, 0)[..., 0]
  if left < 0 or left - tl >= halo - 1:
    rows = min(block.q_rows if block.q_rows is not None else tl, tl)
    call = straddle.halo_call(
        q_doc[..., 0], keys, m.kv_offsets[..., 0], rows=rows,
        kv_tokens=_kv_tokens(cfg, True), max_kv=block.max_kv,
        reversed=False)
    return local, HaloCall(call, None)
  call = straddle.halo_call(q_doc[..., 0], keys, None, rows=left,
                            kv_tokens=halo, max_kv=halo, reversed=True)
  return local, HaloCall(call, halo)


def merge_blocks(blocks: list[_Block]) -> _Block:
  """One block running the segments of several blocks of the same mask.

  Their Q rows must be disjoint (those of any two CP blocks are, except a
  split block's rectangle and its triangle). For a backward call their KV
  rows must be disjoint too: a fused kernel writes dK/dV per segment, it
  does not accumulate them. The bounds are the largest of the blocks'."""
  first = blocks[0]
  if len(blocks) == 1:
    return first
  for b in blocks:
    if ((b.mask, b.exchanged) != (first.mask, first.exchanged)
        or b.q_rows is not None):
      raise ValueError(
          "cannot merge blocks: they must share the mask and the K/V source "
          "and have no row limit; got masks "
          f"{[x.mask for x in blocks]}, exchanged "
          f"{[x.exchanged for x in blocks]}")
  meta = metadata.StepMetadata(*(
      jnp.concatenate([getattr(b.meta, f) for b in blocks], axis=-1)
      for f in metadata.StepMetadata._fields))
  return dataclasses.replace(first, meta=meta,
                             max_q=max(b.max_q for b in blocks),
                             max_kv=max(b.max_kv for b in blocks))


def _dcs_window(cfg: CPConfig) -> bool:
  """DUAL_CHUNK_SWAP at cp > 1 with a window: the windowed plan."""
  return (cfg.strategy is not _NLB and cfg.cp_size > 1
          and cfg.window_left >= 0)


def _dcs_window_calls(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                      ) -> list:
  """DUAL_CHUNK_SWAP with a sliding window, the same calls each way, none
  bottom-right (:func:`metadata.split_windowed_block`; docs/internals.md,
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
  diag = merge_blocks([
      _Block(metadata.split_windowed_block(m, left, tl, t)[0],
             "causal_top_left", c, c, True) for m in steps])
  calls = [_rows_call(cfg, diag, into=False)]
  if left == 0:
    return calls
  sq, skv = metadata.window_compaction_sizes(
      cu_seqlens_padded.shape[-1] - 1, cp, left, c, tl, t)
  near, far, rows = metadata.window_compaction(
      steps, cu_seqlens_padded, cp, left, tl, t, sq, skv)
  rows_q = max(min(left, c), 1)

  def segments(m, max_kv):
    return row_segments(m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets, sq,
                        skv, rows_q, max_kv, rows_see_keys=True,
                        heaviest_first=True)

  compact = [(segments(far, rows_q), "causal_top_left")]
  if left > 1:
    compact.insert(0, (segments(near, max(min(left - 1, (2 * cp - 1) * c),
                                          1)), "no_mask"))
  return calls + [CompactCalls(rows, tuple(compact))]


def _unwindowed_blocks(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                       ) -> list[_Block]:
  # w: the bound on a padded document, cp: the number of ranks.
  w, cp = cfg.max_seqlen, cfg.cp_size
  cu, cuP = cu_seqlens, cu_seqlens_padded
  if cp == 1:
    m = metadata.no_load_balance_step(cu, cuP, 1, 0, cfg.total_tokens)
    # Q and KV lengths agree per document: top-left == bottom-right, and
    # top-left is the faster cuDNN backward. One document slot per row,
    # starting at 0 (cu_seqlens_padded starts at 0) and bounded by the row:
    # the rows tile the buffer (docs/internals.md, Tiled calls). More slots
    # may still hold one document per row: the device tells.
    whole_rows = cfg.causal and w >= cfg.total_tokens
    tiled = whole_rows and cu.shape[-1] == 2
    return [_Block(m, "causal_top_left" if cfg.causal else "no_mask", w, w,
                   False, tiled=tiled, may_tile=whole_rows and not tiled)]
  if cfg.strategy is _NLB:
    return _no_load_balance_blocks(cfg, cu, cuP, rank)
  # DUAL_CHUNK_SWAP: each Q chunk holds c = W / 2cp tokens of a document.
  c = max(_ceil_div(w, 2 * cp), 1)
  blocks = []
  for step in (0, 1):
    m = metadata.dual_chunk_swap_step(cu, cuP, cp, rank, step, cfg.causal)
    if cfg.causal:
      # Step 0 sees at most chunks 0..r <= cp-1, step 1 the whole document.
      blocks.append(_Block(m, "causal_bottom_right", c,
                           min(w, cp * c) if step == 0 else w, True))
    else:
      blocks.append(_Block(m, "no_mask", c, w, True))
  return blocks


def _no_load_balance_blocks(cfg: CPConfig, cu, cuP, rank) -> list[_Block]:
  """Documents inside the chunk need only local K/V (and can run while the
  exchange is in flight): one top-left block. The one straddling document
  per row needs the exchanged buffer: one bottom-right block, which
  :func:`_split_straddle` splits further. It reaches at most W-1 tokens
  into the chunk, so it only needs the first W-1 Q rows: small calls for
  short documents."""
  w, tl = cfg.max_seqlen, cfg.local_tokens
  local, straddling = metadata.no_load_balance_split(
      cu, cuP, cfg.cp_size, rank, cfg.total_tokens,
      cfg.exchange.buffer_start(rank))
  bound = min(w, tl)
  q_rows = min(max(w - 1, 1), tl)
  return [_Block(local, "causal_top_left", bound, bound, False),
          _Block(straddling, "causal_bottom_right", q_rows, w, True,
                 q_rows=q_rows if q_rows < tl else None)]


def _step_blocks(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                 ) -> tuple[list[_Block], HaloCall | None]:
  """The blocks of both directions, in forward order: one per step
  (DUAL_CHUNK_SWAP), cut to the sliding window; or NO_LOAD_BALANCE's
  local block, its straddling document's local part the first of its
  segments (same mask and K/V, other rows), and the halo call
  (:func:`_split_straddle`; None when nothing lies before the chunk)."""
  blocks = [_cut_to_window(b, cfg.window_left)
            for b in _unwindowed_blocks(cfg, cu_seqlens, cu_seqlens_padded,
                                        rank)]
  if cfg.strategy is not _NLB or len(blocks) == 1:
    return blocks, None
  local, straddling = blocks
  straddle_local, halo = _split_straddle(cfg, straddling)
  # A chunk inside one document (its local rows that document's alone) is
  # a tiled call over the local K/V: the device tells (Tiled calls).
  merged = merge_blocks([straddle_local, local])
  return [dataclasses.replace(merged, may_tile=cfg.causal)], halo


def forward_plan(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank) -> list:
  """The varlen attention calls of this rank's forward, in order.

  DUAL_CHUNK_SWAP's two steps run as one call: their Q rows are disjoint
  and a forward may read the same KV rows from several segments. With a
  sliding window every causal call runs with the band; bottom-right calls
  also drop the KV rows before the band (:func:`_cut_to_window`); at
  cp > 1 DUAL_CHUNK_SWAP runs its windowed plan (:func:`_dcs_window_calls`).

  NO_LOAD_BALANCE runs the chunk's local call, then the halo call, so the
  local call hides the exchange; the halo call's rows are merged into the
  local call's by log-sum-exp."""
  if _dcs_window(cfg):
    return _dcs_window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  blocks, halo = _step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)
  if cfg.strategy is not _NLB and len(blocks) > 1:
    blocks = [merge_blocks(blocks)]
  return _in_order(cfg, blocks) + ([] if halo is None else [halo])


def backward_plan(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank
                  ) -> list:
  """The forward's calls in reverse order.

  NO_LOAD_BALANCE: the halo call first, so the halo's gradients travel
  back while the local call runs.

  DUAL_CHUNK_SWAP: one call per step, bottom-right blocks split into an
  unmasked rectangle followed by a top-left triangle where the backend
  prefers it (:attr:`CPConfig.split_bottom_right_backward`). The steps
  read overlapping KV rows (chunks ``0..r`` of every document), so they
  stay separate calls; their triangles do not (chunk ``r`` against chunk
  ``2cp-1-r``) and run as one call after both rectangles, adding their dq
  (their rows are the rectangles'). With a sliding window:
  :func:`_dcs_window_calls`."""
  if _dcs_window(cfg):
    return _dcs_window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
  blocks, halo = _step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)
  rows, triangles = [], []
  for block in reversed(blocks):
    if (block.mask != "causal_bottom_right"
        or not cfg.split_bottom_right_backward):
      rows.append(block)
      continue
    rect, diag = metadata.split_bottom_right(block.meta)
    rows.append(dataclasses.replace(block, meta=rect, mask="no_mask"))
    triangles.append(dataclasses.replace(
        block, meta=diag, mask="causal_top_left", max_kv=block.max_q))
  calls = _in_order(cfg, rows)
  if triangles:
    calls.append(_rows_call(cfg, merge_blocks(triangles), into=False))
  return ([] if halo is None else [halo]) + calls


def ring_plan(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, rank, step: int
              ) -> RowsCall:
  """The call of ring step ``step`` (:func:`metadata.ring_step`): this
  rank's Q rows against the K/V chunk it holds then (the local chunk at
  step 0), the same call in the forward and the backward. Bounds: with
  ``W`` the bound, a DUAL_CHUNK_SWAP document puts at most ``2c`` rows of
  either side in the call (``c = ceil(W / 2cp)``); NO_LOAD_BALANCE's
  local call at most ``min(W, Tl)``, a later step's straddling document
  at most ``min(W - 1, Tl)``."""
  # A window keeps the halo exchange (exchange.choose_exchange).
  assert cfg.exchange.kind == "ring" and cfg.window_left < 0, cfg
  w, tl = cfg.max_seqlen, cfg.local_tokens
  meta, mask = metadata.ring_step(
      cu_seqlens, cu_seqlens_padded, cfg.cp_size, rank, step,
      dual_chunk=cfg.strategy is not _NLB, causal=cfg.causal,
      total_tokens=cfg.total_tokens)
  if cfg.strategy is not _NLB:
    bound = 2 * max(_ceil_div(w, 2 * cfg.cp_size), 1)
  else:
    bound = min(w, tl) if step == 0 else max(min(w - 1, tl), 1)
  seg = row_segments(meta.q_lens, meta.kv_lens, meta.q_offsets,
                     meta.kv_offsets, tl, tl, bound, bound,
                     rows_see_keys=True, heaviest_first=True)
  return RowsCall(seg, mask, -1, exchanged=step > 0)


def poisoned(plan: list, poison) -> list:
  """``plan`` (calls of :func:`forward_plan`, :func:`backward_plan` or
  :func:`ring_plan`) with ``poison`` (:attr:`CPConfig.poison`, an int32
  scalar) in every call's segments (:attr:`Segments.poison`); unchanged
  for None."""
  if poison is None:
    return plan
  put = lambda seg: dataclasses.replace(seg, poison=poison)
  out = []
  for call in plan:
    if isinstance(call, RowsCall):
      call = dataclasses.replace(call, segments=put(call.segments))
    elif isinstance(call, HaloCall):
      call = dataclasses.replace(
          call, call=call.call._replace(segments=put(call.call.segments)))
    else:
      call = dataclasses.replace(
          call, calls=tuple((put(seg), mask) for seg, mask in call.calls))
    out.append(call)
  return out
