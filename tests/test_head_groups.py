"""The backward in sub-calls over whole GQA head groups
(:mod:`jax_cp.attention.head_groups`), on CPU with the ``xla`` backend and
the strict in-place test backend: the same gradients as one call, for
every mask, a sliding window, Tq != Tkv and ``dq_into``, checked against
the float64 gradient of plain masked attention on the unpartitioned row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention import xla
from jax_cp.attention.backend import Segments
from jax_cp.attention.head_groups import (
  backward_in_head_groups,
  fewest_groups,
)
from tests.inplace_backend import make_backend


def _segments(rng, tq, tkv, n, mask):
  """``n`` random documents; bottom-right ones with Q the last part of each
  KV range (as a CP rank's calls have them), a gap between some."""
  cuts = np.sort(rng.choice(np.arange(1, tkv), n - 1, replace=False))
  kv_off = np.concatenate([[0], cuts])
  kv_len = np.diff(np.concatenate([kv_off, [tkv]]))
  if tq == tkv:
    q_off, q_len = kv_off, kv_len
  else:
    q_len = np.maximum(1, (kv_len * tq) // tkv)
    q_len[-1] = tq - q_len[:-1].sum()
    assert np.all(q_len >= 1) and np.all(q_len <= kv_len)
    q_off = np.concatenate([[0], np.cumsum(q_len)[:-1]])
  if mask == "causal_top_left":
    kv_len = np.maximum(kv_len, q_len)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return Segments(i32(q_len), i32(kv_len), i32(q_off), i32(kv_off),
                  int(q_len.max()), int(kv_len.max()), rows_see_keys=True)


def _reference_grads(q, k, v, dout, seg, mask, scale, window_left):
  """float64 gradients of plain masked attention over the whole buffers."""
  ok, _ = xla.segment_mask(seg, q.shape[0], k.shape[0], mask, window_left)
  ok = np.asarray(ok)
  g = q.shape[1] // k.shape[1]

  def attend(q, k, v):
    kk, vv = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, kk) * scale
    s = jnp.where(ok[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(ok[None], p, 0.0)
    return jnp.einsum("hqk,khd->qhd", p, vv)

  with jax.enable_x64():
    args = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)]
    _, vjp = jax.vjp(attend, *args)
    return [np.asarray(x) for x in vjp(jnp.asarray(np.asarray(dout),
                                                   jnp.float64))]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("mask,tq,window", [
    ("causal_bottom_right", 96, -1),
    ("causal_bottom_right", 40, -1),
    ("causal_bottom_right", 96, 7),
    ("causal_top_left", 96, -1),
    ("no_mask", 40, -1),
])
@pytest.mark.parametrize("hq,hkv", [(8, 4), (4, 4)])
def test_groups_equal_one_call_and_the_reference(mask, tq, window, hq, hkv):
  rng = np.random.default_rng(0)
  tkv, d, scale = 96, 16, 0.3
  seg = _segments(rng, tq, tkv, 5, mask)
  q, out_ct = (jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.float32)
               for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((tkv, hkv, d)), jnp.float32)
          for _ in range(2))
  kw = dict(mask=mask, scale=scale, window_left=window)
  out, lse = xla.forward(q, k, v, seg, **kw)
  ref = _reference_grads(q, k, v, out_ct, seg, mask, scale, window)
  one = xla.backward(q, k, v, out, lse, out_ct, seg, **kw)
  for groups in [n for n in (1, 2, 4) if hkv % n == 0]:
    got = jax.jit(lambda *a, n=groups: backward_in_head_groups(
        xla.backward, n, *a, seg, **kw))(q, k, v, out, lse, out_ct)
    for name, g, o, r in zip(("dq", "dk", "dv"), got, one, ref):
      assert _rel(g, r) < 1e-5, (groups, name, _rel(g, r))
      np.testing.assert_allclose(np.asarray(g), np.asarray(o), rtol=1e-5,
                                 atol=1e-6, err_msg=f"{groups} {name}")


def test_groups_write_into_dq_into_and_keep_other_rows():
  """dq_into: each sub-call writes its heads' covered rows in place; rows
  no segment covers keep dq_into's values (the strict backend writes NaN
  where a precondition breaks)."""
  rng = np.random.default_rng(1)
  tq, tkv, hq, hkv, d = 64, 64, 8, 2, 16
  backend = make_backend("strict_groups")
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  # Rows [50, 64) are covered by no segment.
  seg = Segments(i32([20, 30]), i32([20, 30]), i32([0, 20]), i32([0, 20]),
                 30, 30, rows_see_keys=True)
  q, dout = (jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.float32)
             for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((tkv, hkv, d)), jnp.float32)
          for _ in range(2))
  kw = dict(mask="causal_bottom_right", scale=0.25)
  out, lse = xla.forward(q, k, v, seg, **kw)
  base = jnp.asarray(rng.standard_normal((tq, hq, d)), jnp.float32)
  dq_into = base.at[:50].set(0.0)
  want = backend.backward(q, k, v, out, lse, dout, seg, dq_into=dq_into, **kw)
  got = jax.jit(lambda *a: backward_in_head_groups(
      backend.backward, 2, *a, seg, dq_into=dq_into, **kw))(
          q, k, v, out, lse, dout)
  for g, w in zip(got, want):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got[0][50:]),
                                np.asarray(base[50:]))


def test_groups_run_one_after_another():
  """The sub-calls are one call in a loop body: the program holds one
  backward of Hq / n heads, not n of them."""
  calls = []

  def counting_backward(q, k, v, out, lse, dout, seg, **kw):
    calls.append((q.shape, k.shape))
    return xla.backward(q, k, v, out, lse, dout, seg, **kw)

  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((32, 8, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((32, 4, 16)), jnp.float32)
  seg = _segments(rng, 32, 32, 3, "causal_bottom_right")
  kw = dict(mask="causal_bottom_right", scale=0.25)
  out, lse = xla.forward(q, k, k, seg, **kw)
  jax.jit(lambda *a: backward_in_head_groups(counting_backward, 4, *a, seg,
                                             **kw)).lower(q, k, k, out, lse,
                                                          out)
  assert calls == [((32, 2, 16), (32, 1, 16))]


def test_groups_must_divide_the_kv_heads():
  q = jnp.zeros((8, 8, 4))
  k = jnp.zeros((8, 4, 4))
  seg = _segments(np.random.default_rng(0), 8, 8, 2, "causal_bottom_right")
  for bad in (3, 0, 8, True, 2.0):
    with pytest.raises(ValueError, match=r"groups=.* must be a positive int "
                       r"dividing the KV heads \(4\)"):
      backward_in_head_groups(xla.backward, bad, q, k, k, q, q[..., 0], q,
                              seg, mask="no_mask", scale=1.0)


def test_fewest_groups():
  assert fewest_groups(8, lambda n: n >= 3) == 4   # divisors only
  assert fewest_groups(8, lambda n: True) == 1
  assert fewest_groups(8, lambda n: False) == 8    # the finest split
  assert fewest_groups(1, lambda n: False) == 1


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("case", ["dcs-cp2-batch", "dcs-cp4-split",
                                  "dcs-cp4-window", "nlb-cp4-halo-again"])
def test_cp_attention_with_head_groups(monkeypatch, case):
  """cp_attention on the strict in-place backend with its backward run as
  2 head-group sub-calls (dq_into included, in DUAL_CHUNK_SWAP's second
  step) against the float32 reference on the unpartitioned rows."""
  import dataclasses

  from jax_cp.attention import registry
  from tests import test_inplace_planner as planner

  def in_two_groups(strict):
    return dataclasses.replace(
        strict, backward=lambda *a, dq_into=None, **kw:
        backward_in_head_groups(strict.backward, 2, *a, dq_into=dq_into,
                                **kw))

  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  log = []
  for name, split in ((planner.NAME, False), (planner.SPLIT_NAME, True)):
    registry.register_backend(in_two_groups(make_backend(
        name, log, split_bottom_right_backward=split)))
  (strategy, cp, batch, max_seqlen, window, split), = [
      c[1:] for c in planner.CASES if c[0] == case]
  planner.check_case(log, 10 * cp + batch, cp, strategy, batch, max_seqlen,
                     window, split, hq=4)
  backwards = [c for c in log if c["kind"] == "backward"]
  assert backwards and all(c["heads"] == (2, 1) for c in backwards), log
