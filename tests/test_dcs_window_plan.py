"""DUAL_CHUNK_SWAP with a sliding window: its call plan runs no
bottom-right call (docs/internals.md, Call plans). The three parts of a
windowed block cover its band exactly; the plan's calls (a RowsCall, then
CompactCalls) and their masks, each way, also on a backend that splits
bottom-right backward blocks; cp_attention at cp 1/2/4/8 against the
windowed reference on the unpartitioned rows, forward and gradients, on
the xla backend and on the strict in-place test backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention import registry, xla
from jax_cp.attention.backend import Segments
from jax_cp.cp.config import make_config
from jax_cp.cp.strategies import call_plan, metadata
from jax_cp.cp.strategies import dual_chunk_swap as dcs
from jax_cp.cp.strategies import dual_chunk_window as dcw
from jax_cp.cp.strategies.call_plan import CompactCalls, RowsCall
from jax_cp.data import get_partition_indices
from jax_cp.planning import recommend_strategy
from tests import test_inplace_planner as planner
from tests.inplace_backend import make_backend
from tests.test_sliding_window import check_cp

DCS = S.DUAL_CHUNK_SWAP
T = 64


# ---------------------------------------------------------------------------
# The split of one windowed bottom-right block
# ---------------------------------------------------------------------------


def _pairs(q_len, kv_len, q_off, kv_off, mask, tq, tkv, left=-1):
  """Boolean [tq, tkv]: the (Q row, KV row) pairs one segment sees."""
  i32 = lambda x: jnp.asarray([x], jnp.int32)
  seg = Segments(i32(q_len), i32(kv_len), i32(q_off), i32(kv_off), tq, tkv)
  ok, _ = xla.segment_mask(seg, tq, tkv, mask, left)
  return np.asarray(ok)


def _split_pairs(q, kv, q_off, kv_off, left, tq, tkv):
  """The pairs of the windowed bottom-right block and of each of its three
  parts (the far part mapped back from the mirrored buffers)."""
  one = lambda x: jnp.asarray([[x]], jnp.int32)
  meta = metadata.StepMetadata(one(q), one(q_off), one(kv), one(kv_off))
  want = _pairs(q, kv, q_off, kv_off, "causal_bottom_right", tq, tkv, left)
  d, n, f = (metadata.StepMetadata(*(int(np.asarray(x)[0, 0]) for x in m))
             for m in dcw.split_windowed_block(meta, left, tq, tkv))
  seg = lambda m: (m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets)
  diag = _pairs(*seg(d), "causal_top_left", tq, tkv, left)
  near = _pairs(*seg(n), "no_mask", tq, tkv)
  far = _pairs(*seg(f), "causal_top_left", tq, tkv)[::-1, ::-1]
  return want, diag, near, far, f


@pytest.mark.parametrize("left", [0, 1, 2, 5, 9, 16, 30])
def test_split_covers_the_band_exactly(left):
  """For blocks of every shape (Q shorter, equal to and longer than the
  window, keys before it fewer and more than the window): the diagonal
  band, the near rectangle and the far triangle are disjoint and
  together are the bottom-right band; the far part is top-left causal
  in the mirrored buffers, at most ``left`` rows and keys."""
  tq, tkv = 24, 40
  for q in (1, 3, 8, 12):
    for before in (0, 1, 4, 9, 20):
      q_off, kv_off = 5, 3
      kv = before + q
      want, diag, near, far, f = _split_pairs(q, kv, q_off, kv_off, left,
                                              tq, tkv)
      got = diag.astype(int) + near + far
      assert got.max() <= 1, (q, before, left)
      np.testing.assert_array_equal(got.astype(bool), want,
                                    err_msg=f"q={q} before={before}")
      assert f.q_lens <= max(left, 0) and f.kv_lens <= max(left, 0)
      assert f.kv_lens <= f.q_lens


def test_split_of_an_empty_block_has_no_work():
  zero = jnp.zeros((1, 2), jnp.int32)
  meta = metadata.StepMetadata(zero, zero, jnp.full((1, 2), 7), zero + 4)
  for part in dcw.split_windowed_block(meta, 5, 16, 32):
    np.testing.assert_array_equal(part.q_lens, 0)
    np.testing.assert_array_equal(part.kv_lens, 0)


# ---------------------------------------------------------------------------
# The call plan
# ---------------------------------------------------------------------------


def _shape(heads):
  return jax.ShapeDtypeStruct((1, T, heads, 8), jnp.bfloat16)


def _config(left, cp=2, backend="xla", max_seqlen=None):
  cuP = np.array([[0, 24, 40, 64]], np.int32)
  cu = np.array([[0, 20, 34, 58]], np.int32)
  cfg = make_config(
      CPLayout(strategy=DCS, backend=backend, max_seqlen=max_seqlen),
      _shape(4), _shape(2), _shape(2), cu, cuP, cp_size=cp, total_tokens=T,
      attn_mask_type="causal", softmax_scale=None, window_size=(left, 0),
      trusted=False)
  return cfg, cu, cuP


def _describe(calls):
  """The kinds of the calls, and ``(mask, window_left, compact)`` of every
  backend call they make (the compact calls run without a band)."""
  kinds, described = [], []
  for c in calls:
    kinds.append(type(c))
    if isinstance(c, RowsCall):
      described.append((c.mask, c.window_left, False))
    else:
      described += [(mask, -1, True) for _, mask in c.calls]
  return kinds, described


def _plan(cfg, cu, cuP, rank=1):
  """The described forward and backward calls, and their kinds (forward,
  backward)."""
  r = jnp.int32(rank)
  fwd_kinds, fwd = _describe(call_plan.forward_plan(cfg, cu, cuP, r))
  bwd_kinds, bwd = _describe(call_plan.backward_plan(cfg, cu, cuP, r))
  return fwd, bwd, (fwd_kinds, bwd_kinds)


@pytest.mark.parametrize("left", [2, 7, 30])
def test_windowed_plan_has_no_bottom_right_call(left):
  """Each way: a RowsCall of the diagonal bands (top-left, banded), then
  CompactCalls of the near rectangles (unmasked) and the far triangles
  (top-left, no band needed), each over both steps."""
  cfg, cu, cuP = _config(left)
  assert cfg.window_left == left
  fwd, bwd, kinds = _plan(cfg, cu, cuP)
  assert kinds == ([RowsCall, CompactCalls],) * 2
  diag = ("causal_top_left", left, False)
  near = ("no_mask", -1, True)
  far = ("causal_top_left", -1, True)
  assert fwd == bwd == [diag, near, far]


def test_windows_zero_and_one_and_above_every_document():
  """Window 0: the diagonals alone; window 1: no key is near; a window
  reaching past the longest document is plain causal (the unwindowed
  plan: one bottom-right forward call without a band)."""
  cfg, cu, cuP = _config(0)
  fwd, bwd, kinds = _plan(cfg, cu, cuP)
  assert kinds == ([RowsCall],) * 2
  assert fwd == bwd == [("causal_top_left", 0, False)]
  cfg, cu, cuP = _config(1)
  fwd, bwd, kinds = _plan(cfg, cu, cuP)
  assert kinds == ([RowsCall, CompactCalls],) * 2
  assert fwd == bwd == [("causal_top_left", 1, False),
                        ("causal_top_left", -1, True)]
  cfg, cu, cuP = _config(23, max_seqlen=24)
  assert cfg.window_left == -1
  fwd, _, kinds = _plan(cfg, cu, cuP)
  assert kinds[0] == [RowsCall]
  assert fwd == [("causal_bottom_right", -1, False)]


@pytest.fixture
def fake_cudnn(monkeypatch):
  """The strict in-place test backend, splitting bottom-right backward
  blocks as cudnn does, registered as "cudnn" for one test."""
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  registry.register_backend(make_backend("cudnn",
                                         split_bottom_right_backward=True))


def test_windowed_plan_on_cudnn_is_the_split_plan(fake_cudnn):
  """On a backend that splits bottom-right backward blocks and writes in
  place (cudnn), the windowed plan is the same: no bottom-right call, no
  call writing into another's outputs; its split of the backward is for
  unwindowed blocks (one bottom-right forward call, then two rectangles
  and one triangle)."""
  del fake_cudnn
  cfg, cu, cuP = _config(7, backend="cudnn")
  assert not cfg.split_bottom_right_backward
  fwd, bwd, kinds = _plan(cfg, cu, cuP)
  assert kinds == ([RowsCall, CompactCalls],) * 2
  assert fwd == bwd == [("causal_top_left", 7, False), ("no_mask", -1, True),
                        ("causal_top_left", -1, True)]
  cfg, cu, cuP = _config(-1, backend="cudnn")
  assert cfg.split_bottom_right_backward
  fwd, bwd, _ = _plan(cfg, cu, cuP)
  assert fwd == [("causal_bottom_right", -1, False)]
  assert bwd == [("no_mask", -1, False)] * 2 + [("causal_top_left", -1,
                                                 False)]


# ---------------------------------------------------------------------------
# cp_attention against the reference
# ---------------------------------------------------------------------------

# (cp, window). The rows of tests/test_sliding_window.py: many short
# documents and one long one, whose chunks are T / 2cp = 32, 16, 8, 4
# tokens at cp 1, 2, 4, 8: windows 0 and 1, below, equal to and above a
# chunk, and above every document (the plain causal plan).
CASES = [(1, 9), (2, 0), (2, 1), (2, 7), (2, 16), (2, 40), (2, 70),
         (4, 8), (4, 21), (8, 3)]
SLOW_CASES = [(1, 40), (4, 1), (4, 5), (8, 4), (8, 13)]


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("cp,left", CASES)
def test_matches_reference(cp, left):
  check_cp(cp, DCS, left, seed=cp + left)


@pytest.mark.slow
@pytest.mark.parametrize("cp,left", SLOW_CASES)
def test_matches_reference_more(cp, left):
  check_cp(cp, DCS, left, seed=cp + left)


# The strict in-place test backend's fixture (its call log).
inplace = planner.inplace

# (cp, window, batch, max_seqlen): on the strict backend, which turns
# overlapping Q rows of one call, or overlapping KV rows of one backward
# call (cuDNN writes dK/dV per segment), into NaN.
INPLACE_CASES = [(2, 3, 2, None), (2, 12, 1, None), (4, 6, 1, 32),
                 (8, 2, 1, None)]


@pytest.mark.parametrize("cp,left,batch,max_seqlen", INPLACE_CASES)
def test_in_place_backend(inplace, cp, left, batch,
                          max_seqlen):
  log = planner.check_case(inplace, 7 * cp + left, cp, DCS, batch,
                   max_seqlen=max_seqlen, window=left)
  for kind in ("forward", "backward"):
    masks = sorted(c["mask"] for c in log if c["kind"] == kind)
    assert masks == ["causal_top_left"] * 2 + ["no_mask"], log


def test_in_place_backend_traced_metadata(inplace):
  """Traced metadata and a bound: both programs of the guard."""
  log = planner.check_case(inplace, 3, 2, DCS, 1, max_seqlen=32, window=5,
                   traced=True)
  assert all(c["mask"] != "causal_bottom_right" for c in log), log


# ---------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("left,calls", [(0, 2), (1, 4), (4095, 6)])
def test_recommend_strategy_charges_the_windowed_plans_calls(left, calls):
  """With a window DUAL_CHUNK_SWAP is charged the calls of its windowed
  plan (forward + backward: 1 + 1, 2 + 2, 3 + 3), NO_LOAD_BALANCE its two
  each way; a window past every document is the plain causal plan."""
  cu = np.array([0, 65536])
  kw = dict(num_heads_q=32, num_heads_kv=8, window_size=(left, 0))
  rec = recommend_strategy(cu, cu, 2, **kw)
  free = recommend_strategy(cu, cu, 2, call_overhead_s=0.0, **kw)
  extra = {s: rec.predicted_time_s[s] - free.predicted_time_s[s]
           for s in rec.predicted_time_s}
  assert extra["dual_chunk_swap"] == pytest.approx(calls * 20e-6)
  assert extra["no_load_balance"] == pytest.approx(
      (2 if left == 0 else 4) * 20e-6)
  docs = np.arange(0, 65537, 4096)
  rec = recommend_strategy(docs, docs, 2, max_seqlen=4096,
                           call_overhead_s=1e-3, **kw)
  free = recommend_strategy(docs, docs, 2, max_seqlen=4096,
                            call_overhead_s=0.0, **kw)
  extra = (rec.predicted_time_s["dual_chunk_swap"]
           - free.predicted_time_s["dual_chunk_swap"])
  assert extra == pytest.approx((calls if left < 4095 else 2) * 1e-3)


def test_traced_metadata_takes_the_guard_on_xla():
  """The windowed plan depends on the bound (the compact buffers' sizes,
  a window of W - 1 or more dropped), so with traced metadata even the
  xla backend, exact past the kernels' bounds, keeps the fallback."""
  cfgs = []

  def config(cu, cuP):
    sds = lambda h: jax.ShapeDtypeStruct((1, T, h, 8), jnp.float32)
    cfgs.append(make_config(
        CPLayout(strategy=DCS, backend="xla", max_seqlen=16), sds(4),
        sds(2), sds(2), cu, cuP, cp_size=2, total_tokens=T,
        attn_mask_type="causal", softmax_scale=None, window_size=(20, 0),
        trusted=False))
    return cu

  jax.eval_shape(config, *[jax.ShapeDtypeStruct((1, 3), jnp.int32)] * 2)
  (cfg,) = cfgs
  assert cfg.window_left == -1 and cfg.bound_check == "fallback"
  assert cfg.unbounded.window_left == 20


def _compact_pairs(cp, rank, left, cu, cuP):
  """Per (local Q row, gathered KV row): how many of rank ``rank``'s
  windowed calls compute the pair (the diagonals on the exchanged buffer,
  near and far through the compact buffers' index maps), and the pairs the
  window holds."""
  tl = T // cp
  steps = tuple(dcs.dual_chunk_swap_step(cu, cuP, cp, rank, s)
                for s in (0, 1))
  c = T // (2 * cp)
  sq, skv = dcw.window_compaction_sizes(cu.shape[-1] - 1, cp, left, c,
                                             tl, T)
  near, far, rows = dcw.window_compaction(steps, cuP, cp, left, tl, T,
                                               sq, skv)
  got = np.zeros((tl, T), int)
  for m in steps:
    d = dcw.split_windowed_block(m, left, tl, T)[0]
    for ql, qo, _, ko in zip(*(np.asarray(x)[0] for x in d)):
      for j in range(ql):
        got[qo + j, ko + max(j - left, 0):ko + j + 1] += 1
  q_src, kv_src = np.asarray(rows.q_src[0]), np.asarray(rows.kv_src[0])
  for part, causal in ((near, False), (far, True)):
    for ql, qo, kl, ko in zip(*(np.asarray(x)[0] for x in part)):
      for i in range(ql):
        for m in range(kl if not causal else min(i + 1, kl)):
          got[q_src[qo + i], kv_src[ko + m]] += 1
  want = np.zeros((tl, T), int)
  local = get_partition_indices(cuP[0], CPLayout(cp_size=cp, strategy=DCS),
                                rank)
  for t in range(tl):
    g = int(local[t])
    b = int(np.searchsorted(cuP[0], g, side="right")) - 1
    p = g - cuP[0, b]
    if p < cu[0, b + 1] - cu[0, b]:
      want[t, cuP[0, b] + max(p - left, 0):g + 1] = 1
  return got, want, rows


@pytest.mark.parametrize("cp,left", [(2, 1), (2, 5), (2, 20), (4, 3),
                                     (4, 12)])
def test_compaction_covers_each_rank_window_once(cp, left):
  """On a row of documents shorter and longer than the window and its
  chunks, every pair of a rank's window is computed by exactly one call,
  and the index maps of the compact buffers invert each other."""
  if cp == 2:
    cu = np.array([[0, 3, 14, 16, 33, 57]], np.int32)
    cuP = np.array([[0, 4, 16, 20, 40, 64]], np.int32)
  else:
    cu = np.array([[0, 3, 11, 16, 32, 52]], np.int32)
    cuP = np.array([[0, 8, 16, 24, 40, 64]], np.int32)
  for rank in range(cp):
    got, want, rows = _compact_pairs(cp, rank, left, cu, cuP)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}")
    valid = np.asarray(rows.q_valid[0])
    inv = np.asarray(rows.q_inv[0])[np.asarray(rows.q_src[0])[valid]]
    np.testing.assert_array_equal(inv, np.flatnonzero(valid))

