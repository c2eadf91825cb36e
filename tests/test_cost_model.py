"""Tests of jax_cp.planning's cost model against brute force and the
formulas of docs/concepts.md, Strategies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_cp import CPLayout, data, planning
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.planning import cost_model


def _cp(cp, strategy, max_seqlen=None):
  return CPLayout(cp_size=cp, strategy=strategy, max_seqlen=max_seqlen)


def _layout(rng, cp, n_docs, strategy, max_len=40, empty_tail=0):
  """Random packed row: valid lengths (some 0), padded per strategy, plus
  trailing empty slots; ``T`` divisible by ``cp`` (NLB) or every padded
  length by ``2cp`` (DCS)."""
  lens = rng.integers(0, max_len, n_docs)
  mult = 2 * cp if strategy is S.DUAL_CHUNK_SWAP else 1
  plens = -(-lens // mult) * mult + mult * rng.integers(0, 2, n_docs)
  if strategy is S.NO_LOAD_BALANCE:
    plens[-1] += (-plens.sum()) % cp           # make T divisible by cp
  lens = np.minimum(lens, plens)
  lens = np.concatenate([lens, np.zeros(empty_tail, int)])
  plens = np.concatenate([plens, np.zeros(empty_tail, int)])
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  cuP = np.concatenate([[0], np.cumsum(plens)]).astype(np.int32)
  if cuP[-1] == 0:                              # keep T > 0
    cuP[-1:] = cp * mult
  return cu, cuP


def _brute_pairs(cu, cuP, cp, strategy):
  """Per-rank allowed (q, k) pairs from the actual token indices each rank
  holds: a causal same-document mask between valid tokens, counted."""
  cu, cuP = np.asarray(cu), np.asarray(cuP)
  t = int(cuP[-1])
  pos = np.arange(t)
  doc = np.searchsorted(cuP, pos, side="right") - 1
  doc = np.clip(doc, 0, len(cuP) - 2)
  valid = (pos - cuP[doc]) < (cu[doc + 1] - cu[doc])
  out = []
  for r in range(cp):
    qi = np.asarray(data.get_partition_indices(cuP, _cp(cp, strategy), r))
    mask = ((doc[qi][:, None] == doc[None, :]) & valid[qi][:, None]
            & valid[None, :] & (pos[None, :] <= qi[:, None]))
    out.append(int(mask.sum()))
  return out


@pytest.mark.parametrize("strategy", list(S))
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_matches_brute_force_on_random_layouts(cp, strategy):
  rng = np.random.default_rng(1000 * cp + len(strategy.value))
  for trial in range(8):
    cu, cuP = _layout(rng, cp, n_docs=int(rng.integers(1, 7)),
                      strategy=strategy, empty_tail=trial % 3)
    est = planning.estimate_cp_imbalance(cu, cuP, _cp(cp, strategy),
                                         num_heads_q=4, head_dim=8)
    want = _brute_pairs(cu, cuP, cp, strategy)
    assert list(est.pairs_per_rank) == want, (cu, cuP)
    assert list(est.flops_per_rank) == [4 * 8 * 4 * p for p in want]
    mean = np.mean(want)
    assert est.imbalance == pytest.approx(max(want) / mean if mean else 1.0)
    assert est.valid_tokens == int(cu[-1])
    assert est.longest_padded_doc == int(np.diff(cuP).max())


@pytest.mark.parametrize("strategy", list(S))
def test_batched_rows_sum_per_rank(strategy):
  cp = 2
  rng = np.random.default_rng(7)
  rows = []
  while len(rows) < 3:
    cu, cuP = _layout(rng, cp, 4, strategy)
    if not rows or cuP[-1] == rows[0][1][-1]:
      rows.append((cu, cuP))
  cu = np.stack([r[0] for r in rows])
  cuP = np.stack([r[1] for r in rows])
  est = planning.estimate_cp_imbalance(
      cu, cuP, _cp(cp, strategy, int(cuP[0, -1])), num_heads_q=2,
      num_heads_kv=2, head_dim=4)
  per_row = [planning.estimate_cp_imbalance(
      a, b, _cp(cp, strategy), num_heads_q=2, num_heads_kv=2, head_dim=4)
             for a, b in rows]
  assert est.pairs_per_rank == tuple(
      sum(e.pairs_per_rank[r] for e in per_row) for r in range(cp))
  assert est.allgather_bytes == sum(e.allgather_bytes for e in per_row)
  assert est.num_rows == 3


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_one_document_no_load_balance(cp):
  """One document: rank r does (2r+1)/cp^2 of the work, imbalance (2cp-1)/cp.
  Exactly, rank r has Tl^2 (2r+1)/2 + Tl/2 pairs (the diagonal adds Tl/2),
  so the ratios hold up to O(1/Tl)."""
  t = 4096 * cp
  tl = t // cp
  nlb = _cp(cp, "no_load_balance")
  est = planning.estimate_cp_imbalance([0, t], [0, t], nlb)
  assert list(est.pairs_per_rank) == [tl * tl * (2 * r + 1) // 2 + tl // 2
                                      for r in range(cp)]
  total = sum(est.pairs_per_rank)
  for r, p in enumerate(est.pairs_per_rank):
    assert p / total == pytest.approx((2 * r + 1) / cp**2, rel=2 / tl)
  assert est.imbalance == pytest.approx((2 * cp - 1) / cp, rel=2 / tl)
  assert est.calls_per_rank == (1 if cp == 1 else 2)
  # With a window: the local call and the straddling document's halo call;
  # a window of 0 sees no halo, so the local call alone
  # (call_plan.forward_calls; tests/test_call_plan.py checks the plans).
  for left, calls in ((5, 2), (0, 1)):
    est = planning.estimate_cp_imbalance([0, t], [0, t], nlb,
                                         window_size=(left, 0))
    assert est.calls_per_rank == (1 if cp == 1 else calls)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_one_document_dual_chunk_swap_is_exactly_balanced(cp):
  t = 2 * cp * 1000
  est = planning.estimate_cp_imbalance([0, t], [0, t],
                                       _cp(cp, "dual_chunk_swap"))
  assert len(set(est.pairs_per_rank)) == 1
  assert est.imbalance == 1.0
  assert est.calls_per_rank == 1


def test_three_quarters_and_quarter():
  """Per-document chunking against contiguous chunks with cp=2 and
  documents of 3S/4 and S/4. In causal work DCS
  balances each document exactly (imbalance 1), contiguous chunks give
  rank 1 the last quarter of the long document plus the short one
  (6/32 S^2 vs 4/32 S^2: imbalance 1.2)."""
  s = 4096
  cu = cuP = [0, 3 * s // 4, s]
  nlb = planning.estimate_cp_imbalance(cu, cuP, _cp(2, "no_load_balance"))
  dcs = planning.estimate_cp_imbalance(cu, cuP, _cp(2, "dual_chunk_swap"))
  assert dcs.imbalance == 1.0
  assert nlb.imbalance == pytest.approx(1.2, rel=1e-3)
  assert nlb.imbalance > dcs.imbalance
  # With valid == padded, DCS is exactly balanced for any layout, so it can
  # never lose on work balance; it loses only through padding that fills
  # the tail chunks, e.g. 5 valid tokens padded to 8 at cp=2:
  nlb = planning.estimate_cp_imbalance([0, 5], [0, 8],
                                       _cp(2, "no_load_balance"))
  dcs = planning.estimate_cp_imbalance([0, 5], [0, 8],
                                       _cp(2, "dual_chunk_swap"))
  assert nlb.pairs_per_rank == (10, 5) and dcs.pairs_per_rank == (3, 12)
  assert dcs.imbalance > nlb.imbalance


def test_bytes_and_halo():
  t, cp, hkv, d = 4096, 4, 8, 128
  tl = t // cp
  est = planning.estimate_cp_imbalance(
      [0, 100, 1000, t], [0, 100, 1000, t], _cp(cp, "no_load_balance", 3096),
      num_heads_q=32, num_heads_kv=hkv, head_dim=d)
  token = hkv * d * 2 * 2
  assert est.allgather_bytes == (cp - 1) * t * token // cp
  # A halo of 3095 tokens reaches back over the whole row ((cp - 1) * Tl
  # = 3072): the layout all-gathers, and is charged so.
  assert est.halo_bytes_per_rank is None
  assert est.exchange_bytes == est.allgather_bytes
  # A bound of 1100: rank r receives min(1099, r * Tl) tokens.
  cu = [0, 100, 1000, 2000, 3000, t]
  est = planning.estimate_cp_imbalance(
      cu, cu, _cp(cp, "no_load_balance", 1100), num_heads_q=32,
      num_heads_kv=hkv, head_dim=d)
  assert est.halo_bytes_per_rank == tuple(min(1099, r * tl) * token
                                          for r in range(cp))
  assert est.halo_bytes == 1099 * token
  assert est.exchange_bytes == est.halo_bytes
  # A short bound: every rank needs W-1 tokens (rank 0 none).
  cu = [0, 100, 200, 1200, 2200, 3200, t]
  est = planning.estimate_cp_imbalance(
      cu, cu, _cp(cp, "no_load_balance", 1000),
      num_heads_q=hkv, num_heads_kv=hkv, head_dim=d)
  assert est.halo_bytes_per_rank == (0,) + (999 * token,) * (cp - 1)
  dcs = planning.estimate_cp_imbalance([0, t], [0, t],
                                       _cp(cp, "dual_chunk_swap", t))
  assert dcs.halo_bytes is None and dcs.exchange_bytes == dcs.allgather_bytes
  one = planning.estimate_cp_imbalance([0, t], [0, t],
                                       _cp(1, "dual_chunk_swap"))
  assert one.allgather_bytes == 0 and one.imbalance == 1.0


def test_predicted_time_and_recommendation():
  t = 65536
  one = dict(cu_seqlens=[0, t], cu_seqlens_padded=[0, t], cp_size=2,
             num_heads_q=32, num_heads_kv=8, head_dim=128)
  rec = planning.recommend_strategy(**one)
  # One long document: the imbalance (1.5) dominates -> DCS.
  assert rec.strategy is S.DUAL_CHUNK_SWAP
  dcs = rec.estimates["dual_chunk_swap"]
  want = (dcs.max_rank_flops * 3.5 / 600e12 + dcs.allgather_bytes * 3 / 150e9
          + 2 * 20e-6)     # one call forward, one backward
  assert rec.predicted_time_s["dual_chunk_swap"] == pytest.approx(want)
  assert "dual_chunk_swap" in rec.reason
  # It names the all-gathered K/V per rank and layer (the whole row's K and
  # V in bf16) against the ring's chunk.
  kv = t * 8 * 128 * 2 * 2
  assert f"holds {kv} B of K/V" in rec.reason
  assert f"one chunk of {kv // 2} B" in rec.reason
  # Many short documents with a tight bound: halo is tiny, imbalance small
  # -> NLB, although it runs two calls.
  lens = np.full(128, t // 128)
  cu = np.concatenate([[0], np.cumsum(lens)])
  rec = planning.recommend_strategy(cu, cu, 2, num_heads_q=32,
                                    num_heads_kv=8, head_dim=128,
                                    max_seqlen=t // 128)
  assert rec.strategy is S.NO_LOAD_BALANCE
  # The model's knobs are arguments: free communication and calls, perfect
  # balance -> tie -> the default.
  rec = planning.recommend_strategy(cu, cu, 2, bandwidth=1e30,
                                    call_overhead_s=0.0)
  assert rec.strategy is S.DUAL_CHUNK_SWAP
  # A layout DCS cannot use is re-padded for the DCS estimate.
  rec = planning.recommend_strategy([0, 5, 11], [0, 5, 12], 2)
  assert rec.estimates["dual_chunk_swap"].total_tokens == 16
  assert "re-padded" in rec.reason
  cu, cu_p = cost_model.pad_cu_seqlens([0, 5, 11], 4)
  np.testing.assert_array_equal(cu, [0, 5, 11, 11])
  np.testing.assert_array_equal(cu_p, [0, 8, 16, 16])
  # Rows of other lengths end at the longest one's, in the extra slot.
  cu, cu_p = cost_model.pad_cu_seqlens([[0, 5, 11], [0, 1, 2]], 4)
  np.testing.assert_array_equal(cu, [[0, 5, 11, 11], [0, 1, 2, 2]])
  np.testing.assert_array_equal(cu_p, [[0, 8, 16, 16], [0, 4, 8, 16]])


@pytest.mark.parametrize("args, layout, kwargs, match", [
    (([0, 5], [0, 8]), (0, "no_load_balance"), {}, "cp_size"),
    (([0, 5], [0, 8]), (3, "no_load_balance"), {}, "divisible"),
    (([0, 6], [0, 6]), (2, "dual_chunk_swap"), {}, "2\\*cp_size"),
    (([0, 9], [0, 8]), (2, "no_load_balance"), {}, "above its padded"),
    (([0, 4], [1, 8]), (2, "no_load_balance"), {}, "start at 0"),
    (([0, 4, 2], [0, 4, 8]), (2, "no_load_balance"), {}, "non-decreasing"),
    (([0, 4], [0, 4, 8]), (2, "no_load_balance"), {}, "same shape"),
    (([[0, 4]], [[0, 4, 8]][0:1]), (2, "no_load_balance"), {}, "same shape"),
    (([0, 4], [0, 8]), (2, "round_robin"), {}, "CPLoadBalancingStrategy"),
    (([0.0, 4.0], [0.0, 8.0]), (2, "no_load_balance"), {}, "integers"),
    (([0, 8], [0, 8]), (2, "no_load_balance", 4), {}, "max_seqlen"),
    (([0, 8], [0, 8]), (2, "no_load_balance", 0), {}, "max_seqlen"),
    (([0, 8], [0, 8]), (2, "no_load_balance"), {"num_heads_q": 3,
                                                "num_heads_kv": 2},
     "multiple"),
    (([0, 8], [0, 8]), (2, "no_load_balance"), {"head_dim": 0}, "head_dim"),
    (([0, 8], [0, 8]), (2, "no_load_balance"), {"dtype_bytes": -2},
     "dtype_bytes"),
    (([[0, 4], [0, 4]], [[0, 8], [0, 4]]), (2, "no_load_balance"), {},
     "same T"),
    ((np.zeros((1, 1, 2), int), np.zeros((1, 1, 2), int)),
     (2, "no_load_balance"), {}, "shape"),
])
def test_bad_input_raises(args, layout, kwargs, match):
  """Bad metadata, layouts (the CPLayout refuses some itself) and sizes."""
  with pytest.raises(ValueError, match=match):
    planning.estimate_cp_imbalance(*args, _cp(*layout), **kwargs)


def test_bad_model_parameters_raise():
  est = planning.estimate_cp_imbalance([0, 8], [0, 8],
                                       _cp(2, "no_load_balance"))
  with pytest.raises(ValueError, match="peak_flops"):
    est.predicted_time_s(peak_flops=0)
  with pytest.raises(ValueError, match="bandwidth"):
    est.predicted_time_s(bandwidth=-1.0)
  with pytest.raises(ValueError, match="call_overhead_s"):
    est.predicted_time_s(call_overhead_s=float("nan"))


def test_estimate_is_frozen_and_exported():
  est = planning.estimate_cp_imbalance([0, 8], [0, 8],
                                       _cp(2, S.NO_LOAD_BALANCE))
  assert isinstance(est, planning.CPCostEstimate)
  with pytest.raises(dataclasses.FrozenInstanceError):
    est.imbalance = 2.0  # type: ignore[misc]
  assert "estimate_cp_imbalance" in planning.__all__
  assert "recommend_strategy" in planning.__all__


def test_imbalance_at_32m_tokens_and_128_heads_does_not_wrap():
  """FLOPs past int64 (one 32M-token document, 128 heads of 128) stay
  positive and exact: NO_LOAD_BALANCE's imbalance is that of the pairs."""
  t = 32 * 2**20
  cu = np.array([0, t], np.int32)
  est = planning.estimate_cp_imbalance(cu, cu, _cp(4, "no_load_balance"),
                                       num_heads_q=128, num_heads_kv=8,
                                       head_dim=128)
  assert max(est.flops_per_rank) > 2**63 and min(est.flops_per_rank) > 0
  assert est.flops_per_rank == tuple(p * 4 * 128 * 128
                                     for p in est.pairs_per_rank)
  pairs = np.asarray(est.pairs_per_rank, np.float64)
  assert est.imbalance == pytest.approx(pairs.max() / pairs.mean())


def test_model_predicts_the_measured_cp_speedups():
  """The all-gather model against the kept H200 runs of bench_cp
  (DUAL_CHUNK_SWAP, one document, forward + backward): the predicted
  speed-up of cp = N over cp = 1 within 3 % of the measured one."""
  from benchmarks import results
  rows = [r for _, r in results.load("cp")
          if r.get("dist") == "one_doc" and r.get("pass") == "fwd_bwd"
          and r["strategy"] == "dual_chunk_swap"]
  assert sorted(r["cp"] for r in rows) == [2, 4]
  for r in rows:
    cu = np.array([0, r["tokens"]])
    heads = dict(num_heads_q=r["hq"], num_heads_kv=r["hkv"],
                 head_dim=r["head_dim"])
    t = {cp: planning.estimate_cp_imbalance(cu, cu, CPLayout(
        cp_size=cp, strategy="dual_chunk_swap"), **heads).predicted_time_s(
            include_backward=True) for cp in (1, r["cp"])}
    predicted = t[1] / t[r["cp"]]
    assert abs(predicted / r["ratio"] - 1) < 0.03, (r["cp"], predicted,
                                                    r["ratio"])


def test_ring_charges_only_what_compute_does_not_hide():
  cp, t = 8, 1 << 16
  cu = np.array([0, t])
  est = planning.estimate_cp_imbalance(cu, cu, CPLayout(cp_size=cp,
                                               strategy="dual_chunk_swap"),
                              num_heads_q=32, num_heads_kv=8, head_dim=128)
  compute = est.max_rank_flops * 3.5 / 600e12
  chunk = est.allgather_bytes / (cp - 1)
  # Fast links: every hop hidden but the home hop of the accumulator.
  fast = est.predicted_time_s(include_backward=True, comm_type="ring",
                              bandwidth=1e15, call_overhead_s=0)
  assert fast == pytest.approx(compute + 2 * chunk / 1e15, rel=1e-9)
  # Slow links: every hop exposed past its step.
  bw = 1e6
  step = est.max_rank_flops / 600e12 / cp
  want = (compute + (cp - 1) * (chunk / bw - step)
          + (cp - 1) * (3 * chunk / bw - 2.5 * step) + 2 * chunk / bw)
  slow = est.predicted_time_s(include_backward=True, comm_type="ring",
                              bandwidth=bw, call_overhead_s=0)
  assert slow == pytest.approx(want, rel=1e-9)
  with pytest.raises(ValueError, match="comm_type"):
    est.predicted_time_s(comm_type="p2p")
