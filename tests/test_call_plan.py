"""The call plan on its own (jax_cp.cp.strategies.call_plan): which calls a
rank runs, of which kind (RowsCall, HaloCall), with which segments, and
which calls write into the outputs of earlier ones. No communication, no backend
call: metadata on host arrays, rank as an int."""

import dataclasses

import numpy as np
import pytest

from jax_cp.attention.registry import resolve_backend
from jax_cp.cp import validation
from jax_cp.cp.config import CPConfig
from jax_cp.cp.exchange import choose_exchange
from jax_cp.cp.strategies import call_plan, metadata, no_load_balance
from jax_cp.cp.strategies import dual_chunk_swap as dcs
from jax_cp.cp.strategies.call_plan import HaloCall, RowsCall
from jax_cp.cp.strategies.calls import merge_blocks
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy as S
from tests.inplace_backend import make_backend
from tests.split_backend import SPLIT_XLA

CP, T = 4, 64
TL = T // CP
# Three documents with padding; the second one straddles ranks 0..2.
CU = np.array([[0, 10, 34, 58]], np.int32)
CU_P = np.array([[0, 16, 40, 64]], np.int32)
# The strict in-place test backend (tests/inplace_backend.py), plain and
# splitting bottom-right backward blocks.
IN_PLACE = make_backend("inplace_plan")
IN_PLACE_SPLIT = dataclasses.replace(IN_PLACE, name="inplace_plan_split",
                                     split_bottom_right_backward=True)


def test_metadata_is_valid():
  validation.check_cu_seqlens_padded(CU_P, T)
  validation.check_cu_seqlens(CU, CU_P)


def config(strategy, w, backend=None, cp=CP, left=-1):
  """The config of a plan; ``backend`` a backend object (default xla)."""
  return CPConfig(strategy=strategy, cp_axis="cp", cp_size=cp, causal=True,
                  scale=0.1,
                  backend=backend or resolve_backend("xla"),
                  total_tokens=T, max_seqlen=w,
                  exchange=choose_exchange(strategy is S.NO_LOAD_BALANCE,
                                           "cp", cp, T, w, window_left=left),
                  window_left=left)


def segment_tuples(seg, live_only=False):
  """The segments as sorted ``(q_len, kv_len, q_offset, kv_offset)``."""
  rows = zip(*(np.asarray(x).tolist() for x in (
      seg.q_lens, seg.kv_lens, seg.q_offsets, seg.kv_offsets)))
  return sorted(r for r in rows if r[0] > 0 or not live_only)


def meta_tuples(*metas):
  """Per-document metadata ``[1, n]`` as :func:`segment_tuples` lists
  them."""
  rows = []
  for m in metas:
    rows += zip(*(np.asarray(x)[0].tolist() for x in (
        m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets)))
  return sorted(rows)


def assert_same_segments(a, b):
  for field in ("q_lens", "kv_lens", "q_offsets", "kv_offsets"):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)),
                                  np.asarray(getattr(b, field)))
  assert (a.max_seqlen_q, a.max_seqlen_kv, a.rows_see_keys, a.tiled) == (
      b.max_seqlen_q, b.max_seqlen_kv, b.rows_see_keys, b.tiled)


def assert_same_halo(a, b):
  assert (a.call.rows, a.call.reversed, a.before_chunk) == (
      b.call.rows, b.call.reversed, b.before_chunk)
  assert_same_segments(a.call.segments, b.call.segments)
  np.testing.assert_array_equal(np.asarray(a.call.doc_rows),
                                np.asarray(b.call.doc_rows))


def test_no_load_balance_plan():
  """The straddling document splits where the chunk starts: its local rows
  against its local keys run in the chunk's local RowsCall (top-left), its
  rows against its keys before the chunk in an unmasked HaloCall on the
  received halo alone. No call is bottom-right, in either direction, and
  both directions run the same two calls (the halo call last in the
  forward, first in the backward)."""
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  assert cfg.exchange.kind == "halo" and cfg.exchange.halo_tokens == 23
  fwd = call_plan.forward_plan(cfg, CU, CU_P, 2)
  bwd = call_plan.backward_plan(cfg, CU, CU_P, 2)
  assert [type(c) for c in fwd] == [RowsCall, HaloCall]
  assert [type(c) for c in bwd] == [HaloCall, RowsCall]
  local, halo = fwd
  assert (local.mask, local.exchanged, local.into) == (
      "causal_top_left", False, False)
  assert_same_segments(local.segments, bwd[1].segments)
  assert_same_halo(halo, bwd[0])
  # Rank 2 holds tokens [32, 48); document 1 (padded [16, 40), 24 valid
  # tokens) straddles into it: its 8 rows [32, 40) see its 16 keys before
  # the chunk, rows [7, 23) of the 23-row halo (tokens [9, 32)), read as
  # the received buffer is.
  hc = halo.call
  assert hc.mask == "no_mask" and not hc.reversed
  assert halo.before_chunk is None and hc.segments.max_seqlen_kv == 23
  # It reaches at most W-1 = 23 rows, above Tl = 16: all Q rows.
  assert hc.rows == TL and hc.segments.max_seqlen_q == TL
  assert segment_tuples(hc.segments) == [(8, 16, 0, 7)]
  assert np.asarray(hc.doc_rows).tolist() == [8]
  # The local call: the straddling document's rows [0, 8) against its
  # local keys, and document 2 (padded [40, 64)): rows [8, 16) of the
  # chunk, 8 valid tokens, 8 keys.
  assert segment_tuples(local.segments, live_only=True) == [
      (8, 8, 0, 0), (8, 8, 8, 8)]
  # Rank 0 has no straddling document: the halo call has no segment.
  halo0 = call_plan.forward_plan(cfg, CU, CU_P, 0)[1]
  assert np.asarray(halo0.call.segments.q_lens).tolist() == [0]
  assert np.asarray(halo0.call.doc_rows).tolist() == [0]


def test_dual_chunk_swap_plan_and_backward_split():
  """One forward RowsCall for both steps; on a backend that splits
  bottom-right backward blocks, the backward runs each step's rectangle,
  then both triangles in one call; on one that does not, one bottom-right
  call per step, step 1 first."""
  cfg = config(S.DUAL_CHUNK_SWAP, w=24, backend=resolve_backend(SPLIT_XLA))
  assert cfg.split_bottom_right_backward
  # Both steps in one forward call: per document, chunk r = 0 and chunk
  # 2cp-1 = 7 of the step formulas, side by side.
  (fwd,) = call_plan.forward_plan(cfg, CU, CU_P, 0)
  assert isinstance(fwd, RowsCall)
  assert fwd.mask == "causal_bottom_right" and fwd.exchanged
  steps = [dcs.dual_chunk_swap_step(CU, CU_P, CP, 0, s) for s in (0, 1)]
  assert segment_tuples(fwd.segments) == meta_tuples(*steps)
  # c = ceil(24 / 8), W
  assert (fwd.segments.max_seqlen_q, fwd.segments.max_seqlen_kv) == (3, 24)
  bwd = call_plan.backward_plan(cfg, CU, CU_P, 0)
  # Reverse order, each step's rectangle, then both triangles in one call.
  assert all(isinstance(c, RowsCall) for c in bwd)
  assert [c.mask for c in bwd] == ["no_mask", "no_mask", "causal_top_left"]
  rect1, rect0 = (metadata.split_bottom_right(m)[0] for m in steps[::-1])
  assert segment_tuples(bwd[0].segments) == meta_tuples(rect1)
  assert segment_tuples(bwd[1].segments) == meta_tuples(rect0)
  triangles = [metadata.split_bottom_right(m)[1] for m in steps]
  assert segment_tuples(bwd[2].segments) == meta_tuples(*triangles)
  # The triangles' Q rows and KV rows are disjoint (one dK/dV write each).
  live = [t for t in segment_tuples(bwd[2].segments) if t[0] > 0]
  for off in (2, 3):
    rows = np.concatenate([np.arange(t[off], t[off] + t[0]) for t in live])
    assert len(rows) == len(set(rows.tolist()))
  unsplit = call_plan.backward_plan(config(S.DUAL_CHUNK_SWAP, w=24), CU,
                                    CU_P, 0)
  assert [c.mask for c in unsplit] == ["causal_bottom_right"] * 2
  # The step-1 call comes first in the backward.
  assert segment_tuples(unsplit[0].segments) == meta_tuples(steps[1])


def test_merge_blocks_refuses_blocks_it_cannot_merge():
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  local, straddling = no_load_balance.step_blocks(cfg, CU, CU_P, 2)
  with pytest.raises(ValueError, match="cannot merge"):
    merge_blocks([local, straddling])
  assert merge_blocks([local]) is local


def test_calls_write_into_earlier_calls_on_in_place_backends():
  """NO_LOAD_BALANCE: the halo call's dq (its first rows) is summed, the
  local call makes the full dq. DUAL_CHUNK_SWAP, split: the first
  rectangle makes the dq, the second writes into it where the backend
  writes in place, the triangles are summed. Without in-place writes
  every call returns fresh outputs, summed."""
  into = lambda calls: [c.into for c in calls if isinstance(c, RowsCall)]
  for backend in (IN_PLACE, resolve_backend("xla")):
    cfg = config(S.NO_LOAD_BALANCE, w=24, backend=backend)
    assert into(call_plan.forward_plan(cfg, CU, CU_P, 2)) == [False]
    assert into(call_plan.backward_plan(cfg, CU, CU_P, 2)) == [False]
  cfg = config(S.DUAL_CHUNK_SWAP, w=24, backend=IN_PLACE_SPLIT)
  assert into(call_plan.forward_plan(cfg, CU, CU_P, 0)) == [False]
  assert into(call_plan.backward_plan(cfg, CU, CU_P, 0)) == [
      False, True, False]
  cfg = config(S.DUAL_CHUNK_SWAP, w=24, backend=IN_PLACE)
  assert into(call_plan.backward_plan(cfg, CU, CU_P, 0)) == [False, True]
  cfg = config(S.DUAL_CHUNK_SWAP, w=24, backend=resolve_backend(SPLIT_XLA))
  assert into(call_plan.backward_plan(cfg, CU, CU_P, 0)) == [
      False, False, False]


def test_segments_heaviest_first_and_flat_offsets():
  """Rank 0 of two rows, [0, 16) of each: row 0's document 0 (10 valid
  tokens); row 1's documents [0, 8) (4 valid) and [8, 16) (8 valid), at
  offset Tl in the flat buffer."""
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  cu = np.concatenate([CU, np.array([[0, 4, 12, 58]], np.int32)])
  cuP = np.concatenate([CU_P, np.array([[0, 8, 16, 64]], np.int32)])
  call = call_plan.forward_plan(cfg, cu, cuP, 0)[0]
  seg = call.segments
  q, kv = np.asarray(seg.q_lens), np.asarray(seg.kv_lens)
  work = q * (2 * kv - q)
  assert list(work) == sorted(work, reverse=True)
  assert seg.rows_see_keys
  assert segment_tuples(seg, live_only=True) == [
      (4, 4, TL, TL), (8, 8, TL + 8, TL + 8), (10, 10, 0, 0)]


@pytest.mark.parametrize("cp", [1])
def test_single_rank_is_one_top_left_call(cp):
  cfg = config(S.NO_LOAD_BALANCE, w=T, cp=cp)
  (call,) = call_plan.forward_plan(cfg, CU, CU_P, 0)
  assert isinstance(call, RowsCall)
  assert call.mask == "causal_top_left" and not call.exchanged


@pytest.mark.parametrize("left, kind, halo, lq", [
    (5, "halo", 5, 5), (20, "halo", 20, 20), (60, "all_gather", 48, 60),
    (0, "none", 0, None)])
def test_no_load_balance_window_backward_has_no_bottom_right_call(
    left, kind, halo, lq):
  """With a window (smaller than Tl + H - 1) the straddle block becomes, in
  both directions, a reversed HaloCall (top-left causal over the first
  ``left`` rows and the ``H`` rows before the chunk, both reversed) plus a
  top-left segment of the document's local rows in the chunk's local
  RowsCall: no call is bottom-right (a band's bottom-right cuDNN backward
  is slow, its forward slower than top-left). The forward runs the local
  call first, the backward the halo call first.
  Rank 2 holds tokens [32, 48); document 1 (padded [16, 40), 24 valid
  tokens) reaches 8 rows into it from 16 tokens before the chunk."""
  cfg = config(S.NO_LOAD_BALANCE, w=T, left=left)
  assert cfg.exchange.kind == kind
  assert no_load_balance.rows_before_chunk(cfg) == halo
  fwd = call_plan.forward_plan(cfg, CU, CU_P, 2)
  bwd = call_plan.backward_plan(cfg, CU, CU_P, 2)
  unwindowed_local = call_plan.forward_plan(
      config(S.NO_LOAD_BALANCE, w=T), CU, CU_P, 2)[0]
  for calls in (fwd, bwd):
    masks = [c.mask if isinstance(c, RowsCall) else c.call.mask
             for c in calls]
    assert "causal_bottom_right" not in masks
  assert len(fwd) == len(bwd)
  h = min(16, left)
  *halo_call, local = bwd
  for call in (fwd[0], local):
    # The straddling document's local rows run in the local call (local
    # rows [0, 8), top-left band), next to the chunk's own documents; the
    # same segments as without a window.
    assert isinstance(call, RowsCall) and not call.into
    assert not call.exchanged and call.mask == "causal_top_left"
    assert call.window_left == left
    assert (8, 8, 0, 0) in segment_tuples(call.segments)
    assert_same_segments(call.segments, unwindowed_local.segments)
  if kind == "none":
    assert not halo_call and len(fwd) == 1
    return
  (hc,) = halo_call
  # The forward's halo call is the backward's.
  assert isinstance(hc, HaloCall)
  assert_same_halo(fwd[1], hc)
  assert hc.call.mask == "causal_top_left" and hc.call.reversed
  assert (hc.call.rows, hc.before_chunk) == (lq, halo)
  assert (hc.call.segments.max_seqlen_q,
          hc.call.segments.max_seqlen_kv) == (lq, halo)
  assert np.asarray(hc.call.segments.q_lens).tolist() == [lq]
  assert np.asarray(hc.call.segments.kv_lens).tolist() == [h]
  assert np.asarray(hc.call.doc_rows).tolist() == [8]


def test_windowed_halo_call_is_unmasked_when_every_row_sees_the_halo():
  """left - Tl >= H - 1: every local row sees all H rows before the chunk,
  so the halo call is the unmasked rectangle in sequence order, as without
  a window. With W = 12 the received halo is 11 rows (tokens [21, 32) on
  rank 2); the document reaches into them from its start at 16 on, so all
  11 are its keys, seen by its 8 rows."""
  cfg = config(S.NO_LOAD_BALANCE, w=12, left=30)
  assert no_load_balance.rows_before_chunk(cfg) == 11
  hc = call_plan.backward_plan(cfg, CU, CU_P, 2)[0]
  assert isinstance(hc, HaloCall) and hc.before_chunk is None
  assert hc.call.mask == "no_mask" and not hc.call.reversed
  assert hc.call.rows == 11 and hc.call.segments.max_seqlen_kv == 11
  assert segment_tuples(hc.call.segments) == [(8, 11, 0, 0)]
  assert np.asarray(hc.call.doc_rows).tolist() == [8]
