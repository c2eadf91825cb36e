"""Tiled calls (one document per row, bounded by the row): which calls are
tiled, or may be by their traced metadata, what the cuDNN wrapper sends
for them, and the rules it enforces.

The numbers of a tiled cuDNN call are checked on the GPU
(tests/gpu/test_tiled_cudnn.py, tests/gpu/test_dense_by_metadata_cudnn.py);
here the plan, the device-side test of the metadata
(``backend.row_tiling``) and the tiled call it rebuilds, on the xla
backend against the reference, the lowering (CUDA custom-call attributes
and the ``lax.cond`` between the graphs, on CPU) and the stats layout.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention import backend as backend_lib
from jax_cp.attention.backend import Segments, row_segments
from jax_cp.attention.registry import resolve_backend
from jax_cp.cp.config import CPConfig
from jax_cp.cp.exchange import choose_exchange
from jax_cp.cp.strategies import call_plan
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy as S
from tests import reference
from tests._devices import devices
from tests._lowering import lower_for_cuda

T = 64


def cp1_config(w, causal=True):
  return CPConfig(strategy=S.DUAL_CHUNK_SWAP, cp_axis=None, cp_size=1,
                  causal=causal, scale=0.1, backend=resolve_backend("xla"),
                  total_tokens=T, max_seqlen=w,
                  exchange=choose_exchange(False, None, 1, T, w),
                  window_left=-1)


def nlb_config(cp, w):
  return CPConfig(strategy=S.NO_LOAD_BALANCE, cp_axis="cp", cp_size=cp,
                  causal=True, scale=0.1, backend=resolve_backend("xla"),
                  total_tokens=T, max_seqlen=w,
                  exchange=choose_exchange(True, "cp", cp, T, w),
                  window_left=-1)


def one_doc_rows(lens):
  lens = np.asarray(lens, np.int32)
  cu = np.stack([np.zeros_like(lens), lens], axis=1)
  return cu, np.tile(np.array([0, T], np.int32), (len(lens), 1))


@pytest.mark.parametrize("causal", [True, False])
def test_cp1_one_document_per_row_is_tiled(causal):
  cu, cuP = one_doc_rows([64, 40, 3])
  (fwd,) = call_plan.forward_plan(cp1_config(T, causal), cu, cuP, 0)
  (bwd,) = call_plan.backward_plan(cp1_config(T, causal), cu, cuP, 0)
  seg = fwd.segments
  assert seg.tiled == causal and bwd.segments.tiled == causal
  if causal:
    # Row order kept: segment i is row i (no heaviest-first sort).
    np.testing.assert_array_equal(seg.q_lens, [64, 40, 3])
    np.testing.assert_array_equal(seg.q_offsets, [0, T, 2 * T])
    assert (seg.max_seqlen_q, seg.max_seqlen_kv) == (T, T)


def test_not_tiled_with_two_documents_or_a_tighter_bound():
  cu = np.array([[0, 10, 30]], np.int32)
  cuP = np.array([[0, 32, 64]], np.int32)
  (call,) = call_plan.forward_plan(cp1_config(T), cu, cuP, 0)
  assert not call.segments.tiled
  cu1, cuP1 = one_doc_rows([40])
  (call,) = call_plan.forward_plan(cp1_config(48), cu1, cuP1, 0)
  assert not call.segments.tiled


def slot_rows(lens, slots=4):
  """cu/cuP [B, slots+1] of one document per row (valid lengths ``lens``,
  padded to the row) in a batch of ``slots`` document slots, the others
  empty."""
  lens = np.asarray(lens, np.int32)
  cu = np.concatenate([np.zeros((len(lens), 1), np.int32),
                       np.repeat(lens[:, None], slots, axis=1)], axis=1)
  cuP = np.concatenate([np.zeros((len(lens), 1), np.int32),
                        np.full((len(lens), slots), T, np.int32)], axis=1)
  return cu, cuP


def test_cp1_document_slots_may_tile_by_their_metadata():
  """cp=1 with several document slots per row and the row as the bound:
  the call may be tiled, the device tells (tile_rows = B); not with a
  tighter bound or without a causal mask, and one slot is tiled outright."""
  cu, cuP = slot_rows([64, 40, 3])
  for plan in (call_plan.forward_plan, call_plan.backward_plan):
    (call,) = plan(cp1_config(T), cu, cuP, 0)
    assert (call.segments.tiled, call.segments.tile_rows) == (False, 3)
    (call,) = plan(cp1_config(48), cu, cuP, 0)
    assert call.segments.tile_rows == 0
    (call,) = plan(cp1_config(T, causal=False), cu, cuP, 0)
    assert call.segments.tile_rows == 0
  cu1, cuP1 = one_doc_rows([64, 40, 3])
  (call,) = call_plan.forward_plan(cp1_config(T), cu1, cuP1, 0)
  assert (call.segments.tiled, call.segments.tile_rows) == (True, 0)
  # What the device finds: each row one document; then one row of two.
  (call,) = call_plan.forward_plan(cp1_config(T), cu, cuP, 0)
  holds, tiled = backend_lib.row_tiling(call.segments, call.mask, 3 * T,
                                        3 * T)
  assert bool(holds)
  np.testing.assert_array_equal(tiled.q_lens, [64, 40, 3])
  cu[1, 2:], cuP[1, 1:] = 60, [40, T, T, T]
  (call,) = call_plan.forward_plan(cp1_config(T), cu, cuP, 0)
  assert not bool(backend_lib.row_tiling(call.segments, call.mask, 3 * T,
                                         3 * T)[0])


@pytest.mark.parametrize("rank", [0, 1])
def test_no_load_balance_local_call_may_tile_at_cp2(rank):
  """NO_LOAD_BALANCE at cp=2 with the row as the bound: the chunk's
  local call (local K/V, top-left) may be tiled; the halo call is not; a
  bound below the chunk keeps the local call ragged."""
  cu, cuP = slot_rows([64, 50])
  plan = call_plan.forward_plan(nlb_config(2, T), cu, cuP, rank)
  local = plan[0]
  assert isinstance(local, call_plan.RowsCall) and not local.exchanged
  assert local.segments.tile_rows == 2
  assert all(not isinstance(c, call_plan.RowsCall)
             or c.segments.tile_rows == 0 for c in plan[1:])
  back = call_plan.backward_plan(nlb_config(2, T), cu, cuP, rank)
  assert [c.segments.tile_rows for c in back
          if isinstance(c, call_plan.RowsCall)] == [2]
  plan = call_plan.forward_plan(nlb_config(2, 24), cu, cuP, rank)
  assert plan[0].segments.tile_rows == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_no_load_balance_chunk_inside_one_document_tiles(rank):
  """The device's test on the local call at cp=2: a row of one document
  tiles on both ranks (the first chunk holds its start, the second its
  straddling part); a document boundary inside a rank's chunk does not
  (the second row: documents of 40 and 24 tokens, a boundary in rank
  1's chunk)."""
  tl = T // 2
  cu = np.array([[0, 64, 64], [0, 40, 64]], np.int32)
  cuP = np.array([[0, 64, 64], [0, 40, 64]], np.int32)
  for rows, want in ((slice(0, 1), True), (slice(1, 2), rank == 0)):
    (local, *_) = call_plan.forward_plan(nlb_config(2, T), cu[rows],
                                         cuP[rows], rank)
    seg = local.segments
    assert backend_lib.tiling_applies(seg, local.mask, tl, tl)
    holds, tiled = backend_lib.row_tiling(seg, local.mask, tl, tl)
    assert bool(holds) == want, (rank, rows)
    if want:
      np.testing.assert_array_equal(tiled.q_lens, [tl])


def _reads_as_tiled(ql, kl, qo, ko, n, sq, skv, bottom_right):
  """The rule of ``row_tiling`` read segment by segment (a Python loop):
  ``(holds, per-row q lengths)``."""
  rows = [[] for _ in range(n)]
  for q, kv, qoff, kvoff in zip(ql, kl, qo, ko):
    if q <= 0:
      continue
    b, r = divmod(int(qoff), sq)
    if r or not 0 <= b < n or kvoff != b * skv or q > sq or kv > skv or \
        (kv != q if bottom_right else kv < q):
      return False, None
    rows[b].append(int(q))
  if any(len(r) > 1 for r in rows):
    return False, None
  return True, [r[0] if r else 0 for r in rows]


@pytest.mark.parametrize("seed", range(6))
def test_row_tiling_reads_the_metadata_segment_by_segment(seed):
  """Random batches of slots (one document per row, empty rows, two
  documents, a document off the row's start, fewer keys than queries),
  flattened in a random order: ``row_tiling`` holds exactly where the
  loop says, with each row's lengths."""
  rng = np.random.default_rng(seed)
  n, slots, sq = 3, 4, 16
  for _ in range(40):
    ql = np.zeros((n, slots), np.int32)
    qo = np.zeros((n, slots), np.int32)
    kl = np.zeros((n, slots), np.int32)
    for b in range(n):
      kind = rng.choice(["one", "one", "empty", "two", "offset", "short"])
      qo[b] = rng.integers(0, sq + 1, slots)   # empty slots: anywhere
      kl[b] = rng.integers(0, sq + 1, slots)
      if kind == "empty":
        continue
      length = int(rng.integers(1, sq + 1))
      ql[b, 0], kl[b, 0], qo[b, 0] = length, length, 0
      if kind == "two" and length < sq:
        ql[b, 1], kl[b, 1], qo[b, 1] = sq - length, sq - length, length
      elif kind == "offset" and length < sq:
        qo[b, 0] = 1
      elif kind == "short" and length > 1:
        kl[b, 0] = length - 1
    mask = str(rng.choice(["causal_top_left", "causal_bottom_right"]))
    seg = row_segments(ql, kl, qo, qo, sq, sq, sq, sq, rows_see_keys=True,
                       heaviest_first=True, may_tile=True)
    order = rng.permutation(n * slots)
    seg = Segments(*(x[order] for x in (seg.q_lens, seg.kv_lens,
                                        seg.q_offsets, seg.kv_offsets)),
                   sq, sq, tile_rows=n)
    assert backend_lib.tiling_applies(seg, mask, n * sq, n * sq)
    holds, tiled = backend_lib.row_tiling(seg, mask, n * sq, n * sq)
    want, lens = _reads_as_tiled(
        *(np.asarray(x) for x in (seg.q_lens, seg.kv_lens, seg.q_offsets,
                                  seg.kv_offsets)), n, sq, sq,
        mask == "causal_bottom_right")
    assert bool(holds) == want
    if want:
      np.testing.assert_array_equal(tiled.q_lens, lens)
      np.testing.assert_array_equal(tiled.q_offsets, np.arange(n) * sq)
      assert tiled.tiled and (tiled.max_seqlen_q, tiled.max_seqlen_kv) == (
          sq, sq)


def test_tiling_applies_only_with_whole_rows_and_a_causal_mask():
  seg = row_segments(np.array([[8, 0]]), np.array([[8, 0]]),
                     np.array([[0, 8]]), np.array([[0, 8]]), 16, 16, 16, 16,
                     may_tile=True)
  assert seg.tile_rows == 1
  assert backend_lib.tiling_applies(seg, "causal_top_left", 16, 16)
  assert not backend_lib.tiling_applies(seg, "no_mask", 16, 16)
  assert not backend_lib.tiling_applies(seg, "causal_top_left", 16, 24)
  tight = row_segments(np.array([[8, 0]]), np.array([[8, 0]]),
                       np.array([[0, 8]]), np.array([[0, 8]]), 16, 16, 8, 8,
                       may_tile=True)
  assert tight.tile_rows == 0


@pytest.mark.parametrize("mask", ["causal_top_left", "causal_bottom_right"])
def test_tiled_rebuild_gives_the_ragged_call_results_on_xla(mask):
  """Where ``row_tiling`` holds (one document per row among empty slots,
  one row shorter than the row, one empty, in the heaviest-first order),
  its tiled call with the top-left mask gives what the ragged call gives
  (out, lse, dq, dk, dv), and both match plain masked attention in
  float32 on each row; two documents in a row do not hold."""
  xla = resolve_backend("xla")
  b, hq, hkv, d = 3, 4, 2, 8
  lens = np.array([T, 37, 0], np.int32)
  cu, cuP = slot_rows(lens)
  rng = np.random.default_rng(7)
  mk = lambda h: jnp.asarray(rng.standard_normal((b, T, h, d)), jnp.float32)
  q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
  ql = np.diff(cu, axis=1)
  seg = row_segments(ql, ql, cuP[:, :-1], cuP[:, :-1], T, T, T, T,
                     rows_see_keys=True, heaviest_first=True, may_tile=True)
  holds, tiled = backend_lib.row_tiling(seg, mask, b * T, b * T)
  assert bool(holds)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  results = []
  for s, m in ((seg, mask), (tiled, "causal_top_left")):
    out, lse = xla.forward(flat(q), flat(k), flat(v), s, mask=m, scale=0.3)
    grads = xla.backward(flat(q), flat(k), flat(v), out, lse, flat(dout), s,
                         mask=m, scale=0.3)
    results.append((out, lse) + tuple(grads))
  for got, want in zip(*results):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  ref_fn = lambda q, k, v: reference.batched_attention(q, k, v, cu, cuP)
  d_scale = lambda q: q * (0.3 * np.sqrt(d))  # the reference's 1/sqrt(d)
  ref_out, vjp = jax.vjp(lambda q, k, v: ref_fn(d_scale(q), k, v), q, k, v)
  assert reference.rel_err(results[1][0].reshape(q.shape), ref_out) < 1e-5
  for got, want in zip(results[1][2:], vjp(dout)):
    assert reference.rel_err(got.reshape(want.shape), want) < 1e-5
  two = row_segments(np.array([[30, 34]]), np.array([[30, 34]]),
                     np.array([[0, 30]]), np.array([[0, 30]]), T, T, T, T,
                     may_tile=True)
  assert not bool(backend_lib.row_tiling(two, mask, T, T)[0])


try:
  from jax_cp.attention.cudnn import backend as cudnn_backend
except ModuleNotFoundError:
  cudnn_backend = None
needs_ext = pytest.mark.skipif(cudnn_backend is None,
                               reason="jax_cp's cuDNN extension is not built")


def tiled_attrs(text):
  return [line.split("tiled = ")[1].split(" ")[0] for line in text.splitlines()
          if "custom_call @jax_cp_cudnn_sdpa" in line]


def qkv(b=2, t=T, hq=4, hkv=2, d=64):
  rng = np.random.default_rng(0)
  mk = lambda h: jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
  return mk(hq), mk(hkv), mk(hkv)


@needs_ext
def test_fused_attention_one_document_rows_lower_tiled():
  import jax_cp
  q, k, v = qkv()
  lens = np.array([[64], [20]], np.int32)
  offs = np.zeros((2, 1), np.int32)

  def loss(q, k, v):
    o = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                               attn_mask_type="causal_bottom_right",
                               backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert tiled_attrs(text) == ["1", "1"]
  assert "mask = 1 : i64" in text  # causal with equal lengths: top-left


@needs_ext
@pytest.mark.parametrize("case", ["two_docs", "offset", "kv_shorter",
                                  "bound"])
def test_fused_attention_other_calls_are_not_tiled(case):
  import jax_cp
  q, k, v = qkv()
  lens = np.array([[64], [20]], np.int32)
  offs = np.zeros((2, 1), np.int32)
  kv_lens, bound = lens, None
  if case == "two_docs":
    lens = np.array([[30, 34], [20, 0]], np.int32)
    offs, kv_lens = np.array([[0, 30], [0, 20]], np.int32), lens
  elif case == "offset":
    offs = np.array([[1], [0]], np.int32)
    lens = kv_lens = np.array([[63], [20]], np.int32)
  elif case == "kv_shorter":
    kv_lens = np.array([[60], [20]], np.int32)
  elif case == "bound":
    lens = kv_lens = np.array([[32], [20]], np.int32)
    bound = 32

  def fwd(q, k, v, offs):
    return jax_cp.fused_attention(q, k, v, lens, kv_lens, offs, offs,
                                  attn_mask_type="causal_top_left",
                                  backend="cudnn", max_seqlen_q=bound,
                                  max_seqlen_kv=bound)
  text = lower_for_cuda(lambda q, k, v: fwd(q, k, v, offs), q, k, v)
  assert tiled_attrs(text) == ["0"]
  assert "stablehlo.case" not in text


def branches(text):
  """Per ``stablehlo.case`` of the program, the ``tiled`` attributes of
  the SDPA custom calls inside it, in order: the ragged call (branch 0,
  the predicate false), then the tiled one. XLA runs one of them."""
  lines, found = text.splitlines(), []
  for i, line in enumerate(lines):
    if '"stablehlo.case"' not in line:
      continue
    depth, calls = 0, []
    for inner in lines[i:]:
      depth += inner.count("({") + inner.count("{") - inner.count("})") \
          - inner.count("}")
      calls += tiled_attrs(inner)
      if depth <= 0 and inner is not line:
        break
    found.append(calls)
  return found


@needs_ext
@pytest.mark.parametrize("mask", ["causal_bottom_right", "causal_top_left"])
def test_traced_offsets_lower_to_a_cond_of_the_tiled_and_ragged_calls(mask):
  """Offsets as jit arguments (one slot per row, or a batch's slots): the
  forward and the backward each run a ``lax.cond`` whose branches are the
  tiled call and the ragged one; constant offsets of one document per
  row stay tiled outright (above), a bound below the row keeps the
  ragged call alone."""
  import jax_cp
  q, k, v = qkv()
  for lens, offs in ((np.array([[64], [20]]), np.zeros((2, 1))),
                     (np.array([[64, 0, 0], [20, 0, 0]]),
                      np.array([[0, 64, 64], [0, 20, 20]]))):
    lens, offs = (jnp.asarray(x, jnp.int32) for x in (lens, offs))

    def loss(q, k, v, lens, offs, bound=None):
      o = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                 attn_mask_type=mask, backend="cudnn",
                                 max_seqlen_q=bound, max_seqlen_kv=bound)
      return jnp.sum(o.astype(jnp.float32))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = lower_for_cuda(grad, q, k, v, lens, offs)
    assert branches(text) == [["0", "1"], ["0", "1"]]
    text = lower_for_cuda(lambda *a, g=grad: g(*a, bound=48), q, k, v, lens,
                          offs)
    assert "stablehlo.case" not in text and tiled_attrs(text) == ["0", "0"]


@needs_ext
def test_tiled_stats_are_head_major_with_a_huge_lse_past_the_length():
  s, w, hq = 2, 8, 3
  seg = Segments(jnp.array([8, 5], jnp.int32), jnp.array([8, 5], jnp.int32),
                 jnp.array([0, 8], jnp.int32), jnp.array([0, 8], jnp.int32),
                 w, w, rows_see_keys=True, tiled=True)
  lse = np.arange(s * w * hq, dtype=np.float32).reshape(s * w, hq)
  lse[8 + 5:] = -np.inf
  got = np.asarray(cudnn_backend._tiled_stats(seg, jnp.asarray(lse)))
  flat = got.reshape(-1)
  for i in range(s):
    for h in range(hq):
      for t in range(w):
        want = lse[i * w + t, h]
        want = cudnn_backend.TILED_PAST_LENGTH_LSE if np.isneginf(want) \
            else want
        assert flat[(i * hq + h) * w + t] == want


@needs_ext
def test_tiled_segments_need_top_left_and_whole_rows():
  q, k, v = (x[0] for x in qkv())
  seg = Segments(jnp.array([64], jnp.int32), jnp.array([64], jnp.int32),
                 jnp.array([0], jnp.int32), jnp.array([0], jnp.int32),
                 T, T, tiled=True)
  with pytest.raises(ValueError, match="tiled=True"):
    cudnn_backend.forward(q, k, v, seg, mask="causal_bottom_right",
                          scale=0.1)
  short = Segments(seg.q_lens, seg.kv_lens, seg.q_offsets, seg.kv_offsets,
                   32, 32, tiled=True)
  with pytest.raises(ValueError, match="S \\* max_seqlen"):
    cudnn_backend.forward(q, k, v, short, mask="causal_top_left", scale=0.1)


@needs_ext
def test_traced_lengths_with_offsets_none_lower_tiled():
  """One document per row, lengths as jit arguments, ``q_offsets=None``:
  the forward and backward run the dense (tiled) graph."""
  import jax_cp
  q, k, v = qkv()
  lens = jnp.asarray([[64], [20]], jnp.int32)

  def loss(q, k, v, lens):
    o = jax_cp.fused_attention(q, k, v, lens, lens,
                               attn_mask_type="causal_bottom_right",
                               backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, lens)
  assert tiled_attrs(text) == ["1", "1"]


@needs_ext
@pytest.mark.parametrize("mask", ["causal_bottom_right", "causal_top_left",
                                  "no_mask"])
def test_traced_metadata_add_no_pass_over_out_or_dq(mask):
  """Two documents per row, lengths and offsets as jit arguments: rows
  that see no key are the handler's to fill, so nothing around the custom
  calls selects over their results. The only selects of out's or dq's
  size clear the padding rows of q before the forward and of dout before
  the backward (docs/internals.md, Padding tokens)."""
  import jax_cp
  q, k, v = qkv()
  lens = jnp.asarray([[30, 34], [20, 0]], jnp.int32)
  kv_lens = jnp.asarray([[20, 34], [20, 0]], jnp.int32)
  offs = jnp.asarray([[0, 30], [0, 20]], jnp.int32)

  def loss(q, k, v, lens, kv_lens, offs):
    o = jax_cp.fused_attention(q, k, v, lens, kv_lens, offs, offs,
                               attn_mask_type=mask, backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, lens,
                        kv_lens, offs)
  # A causal call may be tiled by its metadata: a cond with both graphs.
  want = [["0", "1"]] * 2 if mask != "no_mask" else []
  assert branches(text) == want
  assert sorted(tiled_attrs(text)) == sorted(sum(want, []) or ["0", "0"])
  results = re.findall(r"(%\w+):\d+ = stablehlo\.custom_call", text)
  size = f"{2 * T}x4x64x"
  selects = [line for line in text.splitlines()
             if ("stablehlo.select" in line or "call @_where" in line)
             and size in line]
  assert selects and not any(f"{r}#" in line for line in selects
                             for r in results), selects
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
      q, k, v, lens, kv_lens, offs)
  assert count_selects(jaxpr.jaxpr, (2 * T, 4, 64)) == 2



@needs_ext
def test_cp1_document_slots_lower_to_a_cond_of_the_tiled_and_ragged_calls():
  """cp_attention at cp=1 with a host-checked batch of document slots as
  jit arguments (the row as the bound): the forward and the backward each
  choose between the tiled and the ragged call on the device; with a
  bound below the row the ragged call runs alone."""
  import jax_cp
  q, k, v = qkv()
  cu, cuP = slot_rows([64, 20])
  # Under a bound of 48: documents of 40 and 24 tokens in each row.
  cu48 = np.array([[0, 40, 64, 64, 64], [0, 30, 50, 50, 50]], np.int32)
  cuP48 = np.array([[0, 40, 64, 64, 64]] * 2, np.int32)
  for bound, want in ((T, [["0", "1"], ["0", "1"]]), (48, [])):
    if bound == 48:
      cu, cuP = cu48, cuP48
    layout = jax_cp.CPLayout(cp_axis=None, backend="cudnn", max_seqlen=bound)
    batch = jax_cp.CPBatch(None, cuP, cu, layout=layout).check_on_host()

    def loss(q, k, v, batch):
      o = jax_cp.cp_attention(q, k, v, batch)
      return jnp.sum(o.astype(jnp.float32))
    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, batch)
    assert branches(text) == want
    if not want:
      assert tiled_attrs(text) == ["0", "0"]


@needs_ext
def test_no_load_balance_cp2_local_call_lowers_to_a_cond():
  """At cp=2 (NO_LOAD_BALANCE, the row as the bound) each rank's local
  call, forward and backward, chooses its graph on the device; the halo
  call is ragged."""
  import jax_cp
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy="no_load_balance", max_seqlen=T)
  cu, cuP = slot_rows([64])
  batch = jax_cp.CPBatch(None, cuP[0], cu[0], layout=layout).check_on_host()
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp"))
  args = [jax.ShapeDtypeStruct((T, h, 64), jnp.bfloat16, sharding=sh)
          for h in (4, 2, 2)]

  def loss(q, k, v, batch):
    return jnp.sum(jax_cp.cp_attention(q, k, v, batch).astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args, batch)
  assert branches(text) == [["0", "1"], ["0", "1"]]
  assert tiled_attrs(text).count("0") == 4   # two ragged, two halo calls


@needs_ext
def test_flax_attention_chooses_its_graph_on_the_device():
  """The Linen MultiHeadAttention at cp=1 (no bound: the row) over rows
  of document slots, remat saving the context: its forward and backward
  calls each choose between the tiled and the ragged graph."""
  import jax_cp
  from jax_cp import flax as jax_cp_flax
  layout = jax_cp.CPLayout(cp_axis=None, backend="cudnn")
  module = jax_cp_flax.MultiHeadAttention(
      num_heads=4, num_kv_heads=2, layout=layout, dtype=jnp.bfloat16,
      remat="save_context")
  x = jnp.ones((2, T, 64), jnp.bfloat16)
  cu, cuP = slot_rows([64, 30], slots=3)
  params = jax.eval_shape(module.init, jax.random.key(0), x, cu, cuP)

  def loss(params, x, cu, cuP):
    return jnp.sum(module.apply(params, x, cu, cuP).astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss), params, x, cu, cuP)
  assert branches(text) == [["0", "1"], ["0", "1"]]


@needs_ext
@pytest.mark.parametrize("window", [-1, 7])
def test_tiled_choice_needs_the_documents_to_fill_the_tiles(window):
  """The cuDNN backend takes the tiled graph where it gives the call's
  results and the documents make at least TILED_MIN_WORK_SHARE of its
  causal pairs (counted with the window): full rows and nearly full ones
  yes; a short document, an empty row, two documents in a row no."""
  share = cudnn_backend.TILED_MIN_WORK_SHARE

  def pairs(q):
    return sum(min(j, window) + 1 if window >= 0 else j + 1
               for j in range(q))

  for lens, two in (([64, 64], False), ([64, 63], False), ([64, 40], False),
                    ([64, 0], False), ([64, 64], True)):
    ql = np.array([[n, 0] for n in lens], np.int32)
    offs = np.array([[0, n] for n in lens], np.int32)
    if two:
      ql[1], offs[1] = [30, 34], [0, 30]
    seg = row_segments(ql, ql, offs, offs, T, T, T, T, may_tile=True)
    take, _ = cudnn_backend.tiled_choice(seg, "causal_top_left", 2 * T,
                                         2 * T, window)
    fill = sum(pairs(n) for n in lens) / (2 * pairs(T))
    assert bool(take) == (not two and fill >= share), (lens, two, fill)


def count_selects(jaxpr, shape) -> int:
  """The ``select_n`` equations with results of ``shape`` in ``jaxpr`` and
  the jaxprs it calls (each call site counted)."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "select_n" and \
        eqn.outvars[0].aval.shape == shape:
      n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          n += count_selects(sub, shape)
  return n
