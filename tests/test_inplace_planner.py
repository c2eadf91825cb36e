"""The CP planner's in-place branch (``supports_in_place``: forward calls
writing ``into`` the first call's out/lse, backward calls writing
``dq_into``) on CPU, through the strict test backend of
tests/inplace_backend.py (with and without the split of bottom-right
backward blocks), against the float32 reference on the unpartitioned
rows (tests/reference.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention import registry
from jax_cp.attention.backend import Segments
from jax_cp.attention.xla import BACKEND as XLA
from jax_cp.cp.config import make_config
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices
from tests.inplace_backend import make_backend
from tests.test_sliding_window import STRADDLE_CU, STRADDLE_CU_P

NAME = "inplace_test"
# The same backend, splitting bottom-right backward blocks (as cudnn).
SPLIT_NAME = "inplace_test_split"
T, D, HQ, HKV = 64, 8, 4, 2     # GQA
TOL = 1e-4                      # float32
DCS, NLB = S.DUAL_CHUNK_SWAP, S.NO_LOAD_BALANCE


@pytest.fixture
def inplace(monkeypatch):
  """Registers the strict in-place backend as ``NAME``, and as
  ``SPLIT_NAME`` with the split of bottom-right backward blocks, for one
  test (the registry's table is restored afterwards); yields their call
  log."""
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  log = []
  for name, split in ((NAME, False), (SPLIT_NAME, True)):
    backend = make_backend(name, log, split_bottom_right_backward=split)
    registry.register_backend(backend)
    assert registry.resolve_backend(name) is backend
    assert backend.supports_in_place
  yield log


# ---------------------------------------------------------------------------
# The test backend itself
# ---------------------------------------------------------------------------


def _seg(sel, tq=32):
  """Documents at rows [0,6) [8,15) | [18,26) [26,32) (self-attention)."""
  off, lens = np.array([0, 8, 18, 26]), np.array([6, 7, 8, 6])
  lens = np.where(sel, lens, 0)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return Segments(i32(lens), i32(lens), i32(off), i32(off), 8, 8,
                  rows_see_keys=True)


def _qkv(rng, t=32):
  return [jnp.asarray(rng.standard_normal((t, h, D)), jnp.float32)
          for h in (HQ, HKV, HKV)]


def test_backend_in_place_writes_follow_the_contract():
  """Two calls on disjoint rows: forward ``into`` and backward ``dq_into``
  give the xla backend's merged results; a fresh dq is 0 on the rows its
  call does not cover."""
  be = make_backend(NAME)
  rng = np.random.default_rng(0)
  q, k, v = _qkv(rng)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  a, b = _seg([1, 1, 0, 0]), _seg([0, 0, 1, 1])
  kw = dict(mask="causal_top_left", scale=0.3)
  o1, l1 = be.forward(q, k, v, a, **kw)
  out, lse = be.forward(q, k, v, b, into=(o1, l1), **kw)
  want_o, want_l = XLA.forward(q, k, v, _seg([1, 1, 1, 1]), **kw)
  np.testing.assert_allclose(out, want_o, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_l))
  np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0),
                             np.where(np.isfinite(want_l), want_l, 0),
                             rtol=1e-6)
  dq1, _, _ = be.backward(q, k, v, out, lse, do, a, **kw)
  assert (dq1[15:] == 0).all() and np.isfinite(dq1).all()
  dq, _, _ = be.backward(q, k, v, out, lse, do, b, dq_into=dq1, **kw)
  want_dq, _, _ = XLA.backward(q, k, v, want_o, want_l, do,
                               _seg([1, 1, 1, 1]), **kw)
  np.testing.assert_allclose(dq, want_dq, rtol=1e-5, atol=1e-6)


def test_backend_marks_broken_preconditions():
  be = make_backend(NAME)
  q, k, v = _qkv(np.random.default_rng(1))
  kw = dict(mask="causal_top_left", scale=0.3)
  a, b = _seg([1, 1, 0, 0]), _seg([0, 0, 1, 1])
  o1, l1 = be.forward(q, k, v, a, **kw)
  # into rows this call covers that do not hold 0 / -inf.
  out, _ = be.forward(q, k, v, a, into=(o1, l1), **kw)
  assert np.isnan(out[:6]).all() and np.isfinite(out[18:]).all()
  # A segment longer than its static bound.
  tight = Segments(a.q_lens, a.kv_lens, a.q_offsets, a.kv_offsets, 6, 6,
                   rows_see_keys=True)
  assert np.isnan(be.forward(q, k, v, tight, **kw)[0]).all()
  # rows_see_keys promised, but a bottom-right row sees nothing.
  short = Segments(b.q_lens, jnp.maximum(b.kv_lens - 2, 0), b.q_offsets,
                   b.kv_offsets, 8, 8, rows_see_keys=True)
  out, _ = be.forward(q, k, v, short, mask="causal_bottom_right", scale=0.3)
  assert np.isnan(out[18:20]).all() and np.isfinite(out[20:26]).all()
  with pytest.raises(ValueError, match="rows_see_keys"):
    be.forward(q, k, v, Segments(a.q_lens, a.kv_lens, a.q_offsets,
                                 a.kv_offsets, 8, 8), into=(o1, l1), **kw)


# ---------------------------------------------------------------------------
# cp_attention on the in-place backend
# ---------------------------------------------------------------------------


def bounded_layout(rng, w, batch, max_docs=32):
  """Rows of T tokens whose padded documents are at most ``w`` long, one of
  exactly ``w`` per row, some with padding."""
  return ref.rows_with_longest(rng, T, w, batch, max_docs)


def layout(seed, cp, strategy, batch, max_seqlen):
  """(cu, cuP, rng, max_seqlen): NO_LOAD_BALANCE rows bounded by
  ``max_seqlen``; random DUAL_CHUNK_SWAP rows, with ``max_seqlen`` (when
  given) replaced by their longest padded document."""
  rng = np.random.default_rng(seed)
  if max_seqlen is not None and strategy is NLB:
    cu, cuP = bounded_layout(rng, max_seqlen, batch)
    return cu, cuP, rng, max_seqlen
  kinds = ("mixed", "many_short", "one_long")
  cu, cuP = map(np.stack, zip(*[ref.random_layout(
      rng, T, cp, kinds[i % 3], dual_chunk=strategy is DCS, max_docs=32)
      for i in range(batch)]))
  if max_seqlen is not None:
    max_seqlen = int(np.diff(cuP, axis=-1).max())
  return cu, cuP, rng, max_seqlen


def run_cp(q, k, v, w, cu, cuP, *, cp, strategy, traced=False,
           max_seqlen=None, split=False, **kw):
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, cp_axis="cp", strategy=strategy,
                    backend=SPLIT_NAME if split else NAME,
                    max_seqlen=max_seqlen)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)
  attn = functools.partial(jax_cp.cp_attention, layout=layout, **kw)

  def loss(q, k, v, w, cu, cuP):
    out = attn(q, k, v, (cu, cuP))
    return jnp.sum(out * w), out

  args = (re(q), re(k), re(v), re(w))
  if traced:
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = f(*args, jnp.asarray(cu), jnp.asarray(cuP))
  else:
    f = jax.jit(jax.value_and_grad(
        lambda *a: loss(*a, cu, cuP), argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = f(*args)
  return back(out), tuple(back(g) for g in grads)


def check_close(got, want, valid, what):
  got, want = np.asarray(got), np.asarray(want)
  assert np.all(np.isfinite(got)), f"{what}: non-finite values"
  err = ref.rel_err(got[valid], want[valid])
  assert err < TOL, f"{what}: relative error {err:.2e}"
  np.testing.assert_array_equal(got[~valid], 0.0, err_msg=what)


def check_case(log, seed, cp, strategy, batch, max_seqlen=None, window=-1,
               split=False, traced=False, rows=None, hq=HQ):
  """cp_attention on the in-place backend (``split``: the one splitting
  bottom-right backward blocks) against the reference; ``rows`` (cu,
  cuP): given rows instead of random ones."""
  if rows is None:
    cu, cuP, rng, max_seqlen = layout(seed, cp, strategy, batch, max_seqlen)
  else:
    cu, cuP = (x[:batch] for x in rows)
    rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((batch, T, h, D)), jnp.float32)
             for h in (hq, HKV, HKV))
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  kw = dict(split=split, max_seqlen=max_seqlen)
  if window >= 0:
    kw["window_size"] = (window, 0)
  out, grads = run_cp(q, k, v, w, cu, cuP, cp=cp, strategy=strategy,
                      traced=traced, **kw)
  f = functools.partial(ref.batched_attention, cu=cu, cuP=cuP, window=window)
  want = f(q, k, v)
  want_grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
      q, k, v)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i])
                    for i in range(batch)])
  check_close(out, want, valid, "out")
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(g, gw, valid, name)
  if cp > 1 and strategy is NLB:
    # The straddling document: no call is bottom-right; its local rows run
    # in the local call, and its keys before the chunk in a halo call
    # merged by log-sum-exp (forward) or summed (backward), so no call
    # writes into another's outputs or dq.
    assert all(c["mask"] != "causal_bottom_right" for c in log), log
    assert not any(c["into"] for c in log), log
  elif cp > 1 and strategy is DCS and window >= 0:
    # Windowed: a top-left band, an unmasked near rectangle and a mirrored
    # far triangle per step, each way; the last two overlap the first's
    # rows, so they are merged (forward) or summed (dq), never written in.
    assert all(c["mask"] != "causal_bottom_right" for c in log), log
    assert not any(c["into"] for c in log), log
  elif cp > 1 and strategy is DCS:
    # Both steps run as one forward call (one per branch of the max_seqlen
    # guard), so none writes into another's; in the backward a later call
    # writes into the first's dq. The backward's bottom-right blocks run
    # as rectangles and triangles on the backend that splits them, whole
    # on the other.
    assert not any(c["kind"] == "forward" and c["into"] for c in log), log
    assert any(c["kind"] == "backward" and c["into"] for c in log), log
    backward = {c["mask"] for c in log if c["kind"] == "backward"}
    assert ("causal_bottom_right" in backward) != split, log
  return log


# (id, strategy, cp, batch, max_seqlen, window, split). T = 64: chunks of
# 32 (cp 2) and 16 (cp 4) tokens. NO_LOAD_BALANCE with max_seqlen W:
# halo W-1; kept from the forward when <= Tl/2, else exchanged again.
CASES = [
    ("cp1", DCS, 1, 2, None, -1, False),
    ("dcs-cp2-batch", DCS, 2, 2, None, -1, False),
    ("dcs-cp4-split", DCS, 4, 1, None, -1, True),
    ("dcs-cp4-window", DCS, 4, 1, None, 5, False),
    ("nlb-cp2-gather-split-batch", NLB, 2, 2, None, -1, True),
    ("nlb-cp4-kept-halo-split", NLB, 4, 1, 8, -1, True),
    ("nlb-cp4-halo-again", NLB, 4, 1, 14, -1, False),
    ("nlb-cp4-halo-again-batch", NLB, 4, 2, 12, -1, True),
    ("nlb-cp4-two-hops-batch-split", NLB, 4, 2, 30, -1, True),
    ("nlb-cp4-window-kept-halo", NLB, 4, 1, None, 6, False),
    ("nlb-cp2-window-and-bound", NLB, 2, 1, 20, 12, False),
]


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("strategy, cp, batch, max_seqlen, window, split",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cp_attention_in_place(inplace, strategy, cp, batch, max_seqlen,
                               window, split):
  log = check_case(inplace, 10 * cp + batch, cp, strategy, batch,
                   max_seqlen, window, split)
  tl = T // cp
  if strategy is NLB and cp > 1 and window < 0:
    # Each direction: the local call over the whole chunk and the unmasked
    # halo call over the straddling document's first rows, at most W-1.
    rows = min(tl, (max_seqlen or T) - 1)
    for kind in ("forward", "backward"):
      calls = [(c["mask"], c["tq"]) for c in log if c["kind"] == kind]
      assert sorted(calls) == sorted([("causal_top_left", batch * tl),
                                      ("no_mask", batch * rows)]), log


# (cp, window, batch): the straddle rows of tests/test_sliding_window.py,
# windows below and above a chunk and the straddling documents, a halo
# (one or three hops) or the all-gather (cp 2, window 40).
STRADDLE_CASES = [(2, 12, 2), (2, 40, 1), (4, 5, 2), (4, 20, 1), (4, 40, 2)]


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("cp, window, batch", STRADDLE_CASES)
def test_no_load_balance_straddle_with_window_in_place(inplace, cp, window,
                                                       batch):
  """The windowed straddle call on the strict backend: in both directions
  a reversed halo call reads a Q buffer of ``left`` rows (``left`` past
  ``Tl`` rows padded), next to the local call over the whole chunk; its
  forward rows are merged by log-sum-exp, its dq is summed."""
  log = check_case(inplace, cp + window, cp, NLB, batch, window=window,
                   rows=(STRADDLE_CU, STRADDLE_CU_P))
  tl = T // cp
  for kind in ("forward", "backward"):
    calls = [c for c in log if c["kind"] == kind]
    halo = [c for c in calls if c["tq"] != batch * tl]
    assert len(halo) == 1 and not halo[0]["into"], log
    assert halo[0]["tq"] == batch * window
    assert len(calls) == 2, log


def test_traced_metadata_takes_the_guarded_program(inplace):
  """Traced metadata and a bound below T: both programs of the guard
  (the bounded halo one runs here) on the in-place backend."""
  check_case(inplace, 5, 4, NLB, 1, max_seqlen=8, split=True, traced=True)


@pytest.mark.parametrize("strategy", [DCS, NLB], ids=lambda s: s.value)
def test_traced_metadata_with_gathered_kv_kept(inplace, strategy):
  """Hq = 4 * Hkv at cp = 2: the forward keeps the all-gathered K/V for the
  backward (CPConfig.keep_gathered_kv); with traced metadata both programs
  of the guard keep them (NO_LOAD_BALANCE's bound 40 still all-gathers)."""
  cfgs = []

  def config(cu, cuP):    # traced metadata
    sds = lambda h: jax.ShapeDtypeStruct((1, T, h, D), jnp.float32)
    cfgs.append(make_config(
        CPLayout(strategy=strategy, backend=NAME, max_seqlen=40),
        sds(4 * HKV), sds(HKV), sds(HKV), cu, cuP, cp_size=2,
        total_tokens=T, attn_mask_type="causal", softmax_scale=None,
        window_size=None, trusted=False))
    return cu

  jax.eval_shape(config, *[jax.ShapeDtypeStruct((1, 3), jnp.int32)] * 2)
  (cfg,) = cfgs
  assert cfg.keep_gathered_kv and cfg.bound_check == "fallback"
  assert cfg.unbounded.keep_gathered_kv
  check_case(inplace, 11, 2, strategy, 2, max_seqlen=40, traced=True,
             hq=4 * HKV)


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("max_seqlen, window", [
    (None, -1), (None, 3), (4, -1), (9, -1), (12, 5), (17, -1), (40, -1)])
@pytest.mark.parametrize("strategy", [DCS, NLB], ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_in_place_grid(inplace, cp, strategy, max_seqlen,
                                    window, batch, split):
  check_case(inplace, 1000 + cp * 100 + (max_seqlen or 0) + batch, cp,
             strategy, batch, max_seqlen, window, split)
