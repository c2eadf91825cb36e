"""The subset reference (benchmarks/exactness.py) against plain masked
attention and jax.grad on whole rows (tests/reference.py), and check_call
on the xla backend, including a backend that is wrong only on the last
document's keys (the kind of error the reference exists to catch)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import exactness
from jax_cp.attention import registry
from jax_cp.attention.backend import Segments
from tests import reference


def _row(seed, t=96, hq=4, hkv=2, d=16):
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t), size=4, replace=False))
  cu = np.concatenate([[0], cuts, [t]]).astype(np.int32)
  mk = lambda h: jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
  lens = np.diff(cu)
  seg = Segments(jnp.asarray(lens), jnp.asarray(lens), jnp.asarray(cu[:-1]),
                 jnp.asarray(cu[:-1]), int(lens.max()), int(lens.max()))
  return cu, seg, mk(hq), mk(hkv), mk(hkv)


@pytest.mark.parametrize("window", [-1, 5])
def test_subset_reference_equals_whole_row_gradients(window):
  cu, seg, q, k, v = _row(0)
  rows = exactness.pick_rows(seg.q_offsets, seg.q_lens, q.shape[0], 12)
  rng = np.random.default_rng(1)
  do_rows = jnp.asarray(rng.standard_normal((rows.size,) + q.shape[1:]),
                        jnp.float32)
  dout = jnp.zeros_like(q).at[rows].set(do_rows)
  f = lambda q, k, v: reference.attention(q, k, v, cu, cu, True,
                                          window=window)
  out, vjp = jax.vjp(f, q, k, v)
  dq, dk, dv = vjp(dout)
  ref = exactness.subset_reference(q, k, v, seg, rows, do_rows,
                                   mask="causal_top_left",
                                   window_left=window)
  np.testing.assert_allclose(ref.out, out[rows], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ref.dq, dq[rows], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ref.dk, dk, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ref.dv, dv, rtol=1e-4, atol=1e-5)
  others = np.setdiff1d(np.arange(q.shape[0]), rows)
  np.testing.assert_allclose(dq[others], 0.0, atol=1e-6)


@pytest.mark.parametrize("mask", ["causal_top_left", "causal_bottom_right",
                                  "no_mask"])
def test_check_call_on_the_xla_backend_is_exact(mask):
  _, seg, q, k, v = _row(2)
  errs = exactness.check_call(registry.resolve_backend("xla"), q, k, v, seg,
                              mask=mask, rows=16)
  assert set(errs) == set(exactness.OUTPUTS)
  assert max(errs.values()) < 1e-5, errs


def test_check_call_catches_a_wrong_last_document():
  """A backend whose dK is wrong only on the last document's keys: dk's
  error is large, the other outputs stay exact."""
  _, seg, q, k, v = _row(3)
  xla = registry.resolve_backend("xla")
  last = int(seg.kv_offsets[-1])

  def backward(*args, **kw):
    dq, dk, dv = xla.backward(*args, **kw)
    return dq, dk.at[last:].multiply(1.5), dv

  broken = dataclasses.replace(xla, backward=backward)
  errs = exactness.check_call(broken, q, k, v, seg, mask="causal_top_left",
                              rows=24)
  assert errs["dk"] > 0.05, errs
  assert max(errs["out"], errs["lse"], errs["dq"], errs["dv"]) < 1e-5, errs
