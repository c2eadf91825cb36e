"""The call plan on its own (jax_cp.call_plan): which calls a rank runs,
how the backward's dq is written, and the flat segment lists. No
communication, no backend: metadata on host arrays, rank as an int."""

import numpy as np
import pytest

from jax_cp import call_plan, checks, metadata
from jax_cp.attention.registry import resolve_backend
from jax_cp.cp_config import CPConfig
from jax_cp.kv_exchange import choose_exchange
from jax_cp.strategy import CPLoadBalancingStrategy as S

CP, T = 4, 64
TL = T // CP
# Three documents with padding; the second one straddles ranks 0..2.
CU = np.array([[0, 10, 34, 58]], np.int32)
CU_P = np.array([[0, 16, 40, 64]], np.int32)


def test_metadata_is_valid():
  checks.check_cu_seqlens_padded(CU_P, T)
  checks.check_cu_seqlens(CU, CU_P)


def config(strategy, w, split=False, cp=CP, left=-1):
  return CPConfig(strategy=strategy, cp_axis="cp", cp_size=cp, causal=True,
                  scale=0.1, backend=resolve_backend("xla"),
                  total_tokens=T, max_seqlen=w, split_causal_backward=split,
                  exchange=choose_exchange(strategy is S.NO_LOAD_BALANCE,
                                           "cp", cp, T, w, window_left=left),
                  window_left=left)


def test_no_load_balance_plan():
  """The straddling document splits where the chunk starts: its local rows
  against its local keys run in the chunk's local call (top-left), its
  rows against its keys before the chunk in an unmasked halo call on the
  received halo alone. No call is bottom-right, in either direction, and
  both directions run the same two calls (the halo call last in the
  forward, first in the backward)."""
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  assert cfg.exchange.kind == "halo" and cfg.exchange.halo_tokens == 23
  fwd = call_plan.forward_calls(cfg, CU, CU_P, 2)
  bwd = call_plan.backward_calls(cfg, CU, CU_P, 2)
  assert [(c.mask, c.exchanged) for c in fwd] == [
      ("causal_top_left", False), ("no_mask", True)]
  assert [c.mask for c in bwd] == ["no_mask", "causal_top_left"]
  for a, b in zip(fwd, bwd[::-1]):
    for field in metadata.StepMetadata._fields:
      np.testing.assert_array_equal(np.asarray(getattr(a.meta, field)),
                                    np.asarray(getattr(b.meta, field)))
  local, halo = fwd
  # Rank 2 holds tokens [32, 48); document 1 (padded [16, 40), 24 valid
  # tokens) straddles into it: its 8 rows [32, 40) see its 16 keys before
  # the chunk, rows [7, 23) of the 23-row halo (tokens [9, 32)).
  assert not halo.reversed and halo.kv_rows == 23
  # It reaches at most W-1 = 23 rows, above Tl = 16: all Q rows.
  assert halo.q_rows is None and halo.max_q == TL
  m = halo.meta
  assert [int(np.asarray(x)[0, 0]) for x in m] == [8, 0, 16, 7]
  assert np.asarray(halo.halo_rows).tolist() == [8]
  # The local call: the straddling document's rows [0, 8) against its
  # local keys first, then document 2 (padded [40, 64)): rows [8, 16) of
  # the chunk, 8 valid tokens, 8 keys.
  lm = local.meta
  assert [np.asarray(x)[0, 0].item() for x in lm] == [8, 0, 8, 0]
  assert 8 in np.asarray(lm.q_lens)[0, 1:].tolist()
  # Rank 0 has no straddling document: the halo call has no segment.
  assert np.asarray(call_plan.forward_calls(cfg, CU, CU_P, 0)[1]
                    .meta.q_lens).tolist() == [[0]]


def test_dual_chunk_swap_plan_and_backward_split():
  cfg = config(S.DUAL_CHUNK_SWAP, w=24, split=True)
  # Both steps in one forward call: per document, chunk r = 0 and chunk
  # 2cp-1 = 7 of the step formulas, side by side.
  (fwd,) = call_plan.forward_calls(cfg, CU, CU_P, 0)
  assert fwd.mask == "causal_bottom_right" and fwd.exchanged
  steps = [metadata.dual_chunk_swap_step(CU, CU_P, CP, 0, s) for s in (0, 1)]
  for field in metadata.StepMetadata._fields:
    np.testing.assert_array_equal(
        np.asarray(getattr(fwd.meta, field)),
        np.concatenate([np.asarray(getattr(m, field)) for m in steps], -1))
  assert fwd.max_q == 3 and fwd.max_kv == 24   # c = ceil(24 / 8), W
  bwd = call_plan.backward_calls(cfg, CU, CU_P, 0)
  # Reverse order, each step's rectangle, then both triangles in one call.
  assert [(c.mask, c.overlaps_previous) for c in bwd] == [
      ("no_mask", False), ("no_mask", False), ("causal_top_left", True)]
  rect1, rect0 = (metadata.split_bottom_right(m)[0] for m in steps[::-1])
  np.testing.assert_array_equal(np.asarray(bwd[0].meta.kv_lens),
                                np.asarray(rect1.kv_lens))
  np.testing.assert_array_equal(np.asarray(bwd[1].meta.kv_lens),
                                np.asarray(rect0.kv_lens))
  # The triangles' Q rows and KV rows are disjoint (one dK/dV write each).
  tri = bwd[2].meta
  q_lens, q_off = np.asarray(tri.q_lens)[0], np.asarray(tri.q_offsets)[0]
  kv_off = np.asarray(tri.kv_offsets)[0]
  live = q_lens > 0
  for off in (q_off, kv_off):
    rows = np.concatenate([np.arange(o, o + n) for o, n in
                           zip(off[live], q_lens[live])])
    assert len(rows) == len(set(rows.tolist()))
  unsplit = call_plan.backward_calls(config(S.DUAL_CHUNK_SWAP, w=24), CU,
                                     CU_P, 0)
  assert [c.mask for c in unsplit] == ["causal_bottom_right"] * 2
  # The step-1 call comes first in the backward.
  np.testing.assert_array_equal(np.asarray(unsplit[0].meta.q_offsets),
                                np.asarray(steps[1].q_offsets))


def test_merge_calls_refuses_calls_it_cannot_merge():
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  local, halo = call_plan.forward_calls(cfg, CU, CU_P, 2)
  with pytest.raises(ValueError, match="cannot merge"):
    call_plan.merge_calls([local, halo])
  assert call_plan.merge_calls([local]) is local


def _call(q_rows=None, overlaps=False, halo_rows=None):
  return call_plan.Call(meta=None, mask="no_mask", max_q=1, max_kv=1,
                        exchanged=True, q_rows=q_rows,
                        overlaps_previous=overlaps, halo_rows=halo_rows)


def test_dq_writes():
  W = call_plan.DqWrite
  # NO_LOAD_BALANCE: the halo call's dq (its first 7 rows) is summed, the
  # local call makes the full dq.
  calls = [_call(q_rows=7, halo_rows=np.array([3])), _call()]
  assert call_plan.dq_writes(calls, in_place=True) == [W(q_rows=7), W()]
  assert call_plan.dq_writes(calls, in_place=False) == [W(q_rows=7), W()]
  # DUAL_CHUNK_SWAP, split: the first rectangle makes the dq, the second
  # writes into it, the triangles are summed.
  calls = [_call(), _call(), _call(overlaps=True)]
  assert call_plan.dq_writes(calls, in_place=True) == [
      W(), W(into=True), W()]
  # Without in-place writes every call returns a fresh dq, summed.
  assert call_plan.dq_writes(calls, in_place=False) == [W(), W(), W()]


def test_segments_heaviest_first_and_flat_offsets():
  cfg = config(S.NO_LOAD_BALANCE, w=24)
  cu = np.concatenate([CU, np.array([[0, 4, 12, 58]], np.int32)])
  cuP = np.concatenate([CU_P, np.array([[0, 8, 16, 64]], np.int32)])
  call = call_plan.forward_calls(cfg, cu, cuP, 0)[0]
  seg = call_plan.segments(call, TL, TL)
  q, kv = np.asarray(seg.q_lens), np.asarray(seg.kv_lens)
  work = q * (2 * kv - q)
  assert list(work) == sorted(work, reverse=True)
  assert seg.rows_see_keys
  # Row b's segments are offset by b * Tl in the flat buffer.
  m = call.meta
  want = sorted(zip(np.asarray(m.q_offsets + np.arange(2)[:, None] * TL)
                    .reshape(-1).tolist(),
                    np.asarray(m.q_lens).reshape(-1).tolist()))
  assert sorted(zip(np.asarray(seg.q_offsets).tolist(), q.tolist())) == want


@pytest.mark.parametrize("cp", [1])
def test_single_rank_is_one_top_left_call(cp):
  cfg = config(S.NO_LOAD_BALANCE, w=T, cp=cp)
  (call,) = call_plan.forward_calls(cfg, CU, CU_P, 0)
  assert call.mask == "causal_top_left" and not call.exchanged


@pytest.mark.parametrize("left, kind, halo, lq", [
    (5, "halo", 5, 5), (20, "halo", 20, 20), (60, "all_gather", 48, 60),
    (0, "none", 0, None)])
def test_no_load_balance_window_backward_has_no_bottom_right_call(
    left, kind, halo, lq):
  """With a window (smaller than Tl + H - 1) the straddle call becomes, in
  both directions, a reversed halo call (top-left causal over the first
  ``left`` rows and the ``H`` rows before the chunk, both reversed) plus a
  top-left call on the document's local rows, run as part of the chunk's
  local call: no call is bottom-right (a band's bottom-right cuDNN
  backward is slow, its forward slower than top-left). The forward runs
  the local call first, the backward the halo call first.
  Rank 2 holds tokens [32, 48); document 1 (padded [16, 40), 24 valid
  tokens) reaches 8 rows into it from 16 tokens before the chunk."""
  cfg = config(S.NO_LOAD_BALANCE, w=T, left=left)
  assert cfg.exchange.kind == kind
  assert call_plan.rows_before_chunk(cfg) == halo
  fwd = call_plan.forward_calls(cfg, CU, CU_P, 2)
  bwd = call_plan.backward_calls(cfg, CU, CU_P, 2)
  unwindowed_local = call_plan.forward_calls(
      config(S.NO_LOAD_BALANCE, w=T), CU, CU_P, 2)[0]
  for calls in (fwd, bwd):
    assert "causal_bottom_right" not in [c.mask for c in calls]
    assert not any(c.overlaps_previous for c in calls)
  assert len(fwd) == len(bwd)
  h = min(16, left)
  *halo_call, local = bwd
  for call in (fwd[0], local):
    # The straddling document's local rows run in the local call: its
    # first segment (local rows [0, 8), top-left band), then the chunk's
    # own documents; the same segments as without a window.
    m = call.meta
    assert not call.exchanged and call.mask == "causal_top_left"
    assert (call.q_rows, call.kv_rows) == (None, None)
    assert np.asarray(m.q_lens)[0, 0] == np.asarray(m.kv_lens)[0, 0] == 8
    assert np.asarray(m.q_offsets)[0, 0] == np.asarray(m.kv_offsets)[0, 0] == 0
    for field in metadata.StepMetadata._fields:
      np.testing.assert_array_equal(
          np.asarray(getattr(m, field)),
          np.asarray(getattr(unwindowed_local.meta, field)))
  W = call_plan.DqWrite
  if kind == "none":
    assert not halo_call and len(fwd) == 1
    assert call_plan.dq_writes(bwd, True) == [W()]
    return
  (hc,) = halo_call
  # The forward's halo call is the backward's.
  fhc = fwd[1]
  assert (fhc.mask, fhc.q_rows, fhc.kv_rows) == (hc.mask, hc.q_rows,
                                                 hc.kv_rows)
  for field in metadata.StepMetadata._fields:
    np.testing.assert_array_equal(np.asarray(getattr(fhc.meta, field)),
                                  np.asarray(getattr(hc.meta, field)))
  np.testing.assert_array_equal(fhc.halo_rows, hc.halo_rows)
  assert hc.exchanged and hc.mask == "causal_top_left" and hc.reversed
  assert (hc.q_rows, hc.kv_rows, hc.max_q, hc.max_kv) == (lq, halo, lq, halo)
  assert np.asarray(hc.meta.q_lens).tolist() == [[lq]]
  assert np.asarray(hc.meta.kv_lens).tolist() == [[h]]
  assert np.asarray(hc.halo_rows).tolist() == [8]
  # Its dq is summed like a triangle's; the local call makes the full dq.
  assert call_plan.dq_writes(bwd, in_place=True) == [W(q_rows=lq), W()]


def test_windowed_halo_call_is_unmasked_when_every_row_sees_the_halo():
  """left - Tl >= H - 1: every local row sees all H rows before the chunk,
  so the halo call is the unmasked rectangle in sequence order, as without
  a window. With W = 12 the received halo is 11 rows (tokens [21, 32) on
  rank 2); the document reaches into them from its start at 16 on, so all
  11 are its keys, seen by its 8 rows."""
  cfg = config(S.NO_LOAD_BALANCE, w=12, left=30)
  assert call_plan.rows_before_chunk(cfg) == 11
  hc = call_plan.backward_calls(cfg, CU, CU_P, 2)[0]
  assert hc.mask == "no_mask" and not hc.reversed
  assert (hc.q_rows, hc.kv_rows) == (11, 11)
  assert [int(np.asarray(x)[0, 0]) for x in hc.meta] == [8, 0, 11, 0]
  assert np.asarray(hc.halo_rows).tolist() == [8]
