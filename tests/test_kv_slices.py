"""The backward over ranges of the K/V rows (jax_cp.attention.cudnn.kv_slices):
the ``xla`` backend's backward split the same way equals one call (every
mask, Tq != Tkv, rows without keys, empty segments, ``dq_into``); a CP
step whose backward is split over head groups and K/V slices equals the
float32 reference; the split's size from the workspace formula; the
cudnn backend's lowering of a split backward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp.attention import register_backend, xla
from jax_cp.attention.backend import Segments
from jax_cp.attention.cudnn import kv_slices, split
from jax_cp.attention.cudnn import workspace as cudnn_workspace
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

MASKS = ("no_mask", "causal_top_left", "causal_bottom_right")
# (q_len, kv_len, q_offset, kv_offset): a long segment, one with no query,
# one with fewer keys than queries (bottom-right: rows without a key), one
# with no key, one straddling most slice edges; Tq = 90, Tkv = 120.
SEGS = [(20, 30, 0, 0), (0, 6, 20, 30), (35, 50, 22, 36), (9, 4, 60, 88),
        (12, 0, 70, 92), (8, 28, 82, 92)]
TQ, TKV = 90, 120


def _segments(segs=SEGS):
  cols = [jnp.asarray(np.array(c, np.int32)) for c in zip(*segs)]
  return Segments(*cols, max(s[0] for s in segs), max(s[1] for s in segs))


def _inputs(seed, mask, seg, hq=4, hkv=2, d=16):
  rng = np.random.default_rng(seed)
  mk = lambda t, h: jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
  q, k, v, do = mk(TQ, hq), mk(TKV, hkv), mk(TKV, hkv), mk(TQ, hq)
  out, lse = xla.forward(q, k, v, seg, mask=mask, scale=0.3)
  return q, k, v, out, lse, do


def test_slice_bounds():
  assert kv_slices.slice_bounds(10, 1) == [(0, 10)]
  assert kv_slices.slice_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
  assert kv_slices.slice_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
  assert kv_slices.slice_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="slices"):
      kv_slices.slice_bounds(10, bad)


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("slices", [2, 3, 7, TKV])
@pytest.mark.parametrize("mask", MASKS)
def test_sliced_backward_equals_one_call(mask, slices):
  seg = _segments()
  q, k, v, out, lse, do = _inputs(slices, mask, seg)
  want = xla.backward(q, k, v, out, lse, do, seg, mask=mask, scale=0.3)
  got = kv_slices.backward_in_kv_slices(xla.backward, slices, q, k, v, out,
                                        lse, do, seg, mask=mask, scale=0.3)
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)
    assert float(jnp.abs(w).max()) > 0.1, name    # not trivially zero


@pytest.mark.parametrize("mask", MASKS)
def test_every_pair_once(mask):
  """The parts of all slices cover each (query row, key) pair the mask
  allows exactly once, and no other pair."""
  seg = _segments()
  allowed = np.zeros((TQ, TKV), int)
  ok, _ = xla.segment_mask(seg, TQ, TKV, mask)
  allowed = np.asarray(ok).astype(int)
  covered = np.zeros((TQ, TKV), int)
  for a, b in kv_slices.slice_bounds(TKV, 7):
    for part, part_mask in kv_slices.slice_parts(seg, mask, a, b):
      assert part.rows_see_keys and not part.tiled
      assert part.max_seqlen_kv <= b - a
      p_ok, _ = xla.segment_mask(part, TQ, b - a, part_mask)
      covered[:, a:b] += np.asarray(p_ok).astype(int)
      # Every row a part covers sees a key of the slice.
      lens = np.asarray(part.q_lens)
      assert (np.asarray(part.kv_lens)[lens > 0] > 0).all()
  np.testing.assert_array_equal(covered, allowed)


def test_sliced_backward_writes_into_dq():
  """With ``dq_into`` (0 on the covered rows) the covered rows get the
  gradient and every other row keeps its value."""
  mask = "causal_bottom_right"
  seg = _segments()
  q, k, v, out, lse, do = _inputs(4, mask, seg)
  covered = np.zeros(TQ, bool)
  for ql, _, qo, _ in SEGS:
    covered[qo:qo + ql] = True
  fill = jnp.where(covered[:, None, None], 0.0,
                   jnp.full(q.shape, 7.0, jnp.float32))
  want = xla.backward(q, k, v, out, lse, do, seg, mask=mask, scale=0.3)[0]
  got = kv_slices.backward_in_kv_slices(
      xla.backward, 3, q, k, v, out, lse, do, seg, mask=mask, scale=0.3,
      dq_into=fill)[0]
  np.testing.assert_allclose(got[covered], want[covered], atol=2e-5)
  np.testing.assert_array_equal(got[~covered], 7.0)


def test_windows_and_tiled_segments_are_not_cut():
  seg = _segments()
  q, k, v, out, lse, do = _inputs(5, "causal_top_left", seg)
  with pytest.raises(ValueError, match="window"):
    kv_slices.backward_in_kv_slices(
        xla.backward, 2, q, k, v, out, lse, do, seg, mask="causal_top_left",
        scale=0.3, window_left=4)
  tiled = dataclasses.replace(seg, tiled=True)
  with pytest.raises(ValueError, match="tiled"):
    kv_slices.backward_in_kv_slices(
        xla.backward, 2, q, k, v, out, lse, do, tiled,
        mask="causal_top_left", scale=0.3)


def test_split_sizes_from_the_workspace_formula():
  """The 16 x 2048 model's heads (32 / 8 of 64) under an all-gather at
  cp=8, 1088k tokens per rank: eight head groups still need 19.4 GB each,
  so each runs over K/V slices whose workspace fits the 4 GiB bound; the
  dQ buffers alone fit, so the slices bring the total under it."""
  tq, tkv, limit = 1088 * 1024, 8 * 1088 * 1024, 4 * 2**30
  groups, slices = cudnn_workspace.backward_split(tq, tkv, 32, 8, 64,
                                                  limit=limit)
  assert groups == 8 and slices > 1
  ws = lambda n: cudnn_workspace.backward_workspace(
      tq, -(-tkv // n), 4, 1, 64).total
  assert ws(slices) <= limit < ws(slices - 1)
  # Below the bound: no slices; with slices off (a window): none.
  assert cudnn_workspace.backward_split(4096, 4096, 32, 8, 64,
                                        limit=limit) == (1, 1)
  assert cudnn_workspace.backward_split(tq, tkv, 32, 8, 64, limit=limit,
                                        kv_slices=False) == (8, 1)
  # Query buffers alone past the bound: slices make dK/dV no larger.
  n = cudnn_workspace.backward_kv_slices(tq, tkv, 4, 1, 64, limit=2**20)
  w = cudnn_workspace.backward_workspace(tq, -(-tkv // n), 4, 1, 64)
  assert w.dk_full_heads + w.dv_full_heads <= w.dq_accum + w.softmax_sum
  assert n <= cudnn_workspace.MAX_KV_SLICES


def _split_xla_backward(q, k, v, out, lse, dout, seg, *, mask, scale,
                        window_left=-1, **kwargs):
  """The xla backward with the cudnn backend's split (head groups, then K/V
  slices) for its shapes."""
  return split.backward_within_scratch_limit(
      xla.backward, q, k, v, out, lse, dout, seg,
      max_seqlen_q=min(seg.max_seqlen_q, q.shape[0]), mask=mask, scale=scale,
      window_left=window_left, **kwargs)


register_backend(dataclasses.replace(xla.BACKEND, name="xla_kv_sliced",
                                     backward=_split_xla_backward,
                                     split_bottom_right_backward=True))


@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance"])
def test_cp_step_with_a_sliced_backward_equals_the_reference(monkeypatch,
                                                             strategy):
  """cp=4, all-gather, a scratch bound so small that every backward call
  runs as one sub-call per KV head and K/V slices: outputs and gradients
  equal the float32 reference on the unpartitioned row."""
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-9")
  t, cp = 256, 4
  rng = np.random.default_rng(6)
  cu, cuP = ref.random_layout(rng, t, cp, "mixed",
                              dual_chunk=strategy == "dual_chunk_swap")
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", strategy=strategy,
                           backend="xla_kv_sliced")
  mk = lambda h: rng.standard_normal((t, h, 16)).astype(np.float32)
  q, k, v, w = mk(4), mk(2), mk(2), mk(4)
  qs, ks, vs, ws = (reorder_for_cp(x, cuP, layout, seq_dim=0)
                    for x in (q, k, v, w))

  def loss(q, k, v):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return jnp.sum(out * ws)

  with jax.set_mesh(mesh):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qs, ks, vs)
  grads = [restore_from_cp(np.asarray(g), cuP, layout, seq_dim=0)
           for g in grads]
  f = lambda q, k, v: ref.attention(q, k, v, cu, cuP)
  want = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
  valid = ref.valid_token_mask(cu, cuP)
  for name, g, r in zip(("dq", "dk", "dv"), grads, want):
    np.testing.assert_allclose(g[valid], np.asarray(r)[valid], atol=5e-5,
                               rtol=5e-5, err_msg=name)
