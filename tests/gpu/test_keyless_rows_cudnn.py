"""GPU test: rows that see no key, with the metadata as jit arguments
(marker gpu).

The cuDNN handler gives such rows (a segment with no key, the rows before
a bottom-right diagonal, the rows past a top-left window's reach) 0 in
``out`` and ``dq`` and ``-inf`` in ``lse`` on the device, from the segment
list, with no pass over the outputs. Every mask, with and without a
window, against the xla backend in float32 on the same traced metadata:
the same ``-inf`` rows, exact zeros there, and the values elsewhere. Also
``q_offsets=None`` on rows of one document (the dense graph with traced
lengths).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax_cp  # noqa: E402
from tests.reference import rel_err  # noqa: E402

T, HQ, HKV, D = 384, 4, 2, 64
TOL = 2e-2
# Two rows of segments (q_len, kv_len, q_off, kv_off): a segment with no
# key, one with fewer keys than queries (bottom-right: 40 rows see none;
# top-left with a window of 15: rows past 20 + 15 see none), a long one,
# and a gap.
SEGS = [
    [(30, 0, 0, 0), (60, 20, 40, 40), (200, 200, 120, 120), (5, 5, 330, 330)],
    [(100, 100, 0, 0), (50, 10, 110, 110), (0, 7, 170, 170),
     (150, 150, 200, 200)],
]


def _meta():
  a = np.array(SEGS, np.int32)          # [B, N, 4]
  return [jnp.asarray(a[..., i]) for i in range(4)]


def _inputs(b, seed=0):
  rng = np.random.default_rng(seed)
  mk = lambda h: rng.standard_normal((b, T, h, D)).astype(np.float32)
  return mk(HQ), mk(HKV), mk(HKV), mk(HQ)


def _run(backend, mask, window, q, k, v, dout, *meta):
  def f(q, k, v):
    return jax_cp.fused_attention(q, k, v, *meta, attn_mask_type=mask,
                                  backend=backend, window_size=window,
                                  return_lse=True)
  (out, lse), pull = jax.vjp(f, q, k, v)
  return (out, lse) + pull((dout, jnp.zeros_like(lse)))


def _compare(got, want):
  got = [np.asarray(x, np.float32) for x in got]
  want = [np.asarray(x, np.float32) for x in want]
  lse, r_lse = got[1], want[1]
  keyless = np.isneginf(r_lse)
  assert keyless.any() and (~keyless).any()
  np.testing.assert_array_equal(np.isneginf(lse), keyless)
  np.testing.assert_allclose(lse[~keyless], r_lse[~keyless], atol=2e-2,
                             rtol=2e-2)
  rows = keyless.all(axis=-1)            # [B, T]: every head sees no key
  for name, g, w in zip(("out", "dq", "dk", "dv"),
                        got[:1] + got[2:], want[:1] + want[2:]):
    assert np.isfinite(g).all(), name
    if name in ("out", "dq"):
      np.testing.assert_array_equal(g[rows], 0.0, err_msg=name)
    assert rel_err(g, w) < TOL, (name, rel_err(g, w))


@pytest.mark.parametrize("mask, window", [
    ("causal_bottom_right", None), ("causal_bottom_right", (15, 0)),
    ("causal_top_left", None), ("causal_top_left", (15, 0)),
    ("no_mask", None)])
def test_keyless_rows_with_traced_metadata(mask, window):
  q, k, v, dout = _inputs(len(SEGS))
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, dout)]
  meta = _meta()
  run = lambda backend: jax.jit(
      lambda *a: _run(backend, mask, window, *a))
  _compare(run("cudnn")(*bf, *meta), run("xla")(q, k, v, dout, *meta))


def test_one_document_rows_with_offsets_none():
  """Traced lengths of one document per row (shorter than the row, and
  the whole row), ``q_offsets=None``: the dense graph, against xla."""
  q, k, v, dout = _inputs(2, seed=1)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, dout)]
  lens = jnp.asarray([[T], [T - 77]], jnp.int32)

  def run(backend, q, k, v, dout, lens):
    def f(q, k, v):
      return jax_cp.fused_attention(q, k, v, lens, lens, backend=backend,
                                    return_lse=True)
    (out, lse), pull = jax.vjp(f, q, k, v)
    return (out, lse) + pull((dout, jnp.zeros_like(lse)))

  got = jax.jit(lambda *a: run("cudnn", *a))(*bf, lens)
  want = jax.jit(lambda *a: run("xla", *a))(q, k, v, dout, lens)
  _compare(got, want)
