"""GPU test: ``fused_attention`` on the cudnn backend with *traced*
out-of-range metadata (negative offsets and lengths, segments running past
the end of their row or longer than their bound, offsets past the end)
reads and writes nothing outside the clamped segments' rows (marker gpu).

The row under test sits between rows filled with NaN (q, k, v and dO), in
the one flat buffer the backend sees, and, in a second layout, at the very
end of the buffer. A read of a poisoned row would turn results into NaN; a
write to one would leave something other than the 0 (``-inf`` for lse) of
uncovered rows. Results equal the xla backend's on the same metadata.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax_cp  # noqa: E402

T, HQ, HKV, D, BOUND = 512, 4, 2, 64, 200
TOL = 2e-2

# One row's metadata (6 segments) and, in comments, what clamping to
# [0, T] and to the bound BOUND makes of it: Q rows / KV rows.
Q_OFFS = [-7, 60, 100, 470, 2000, 320]
Q_LENS = [40, -3, 300, 100, 10, 50]
KV_OFFS = [-20, 40, 100, 470, -5, 320]
KV_LENS = [60, -1, 1000, 100, -5, 30]
# seg 0: Q [0, 40)     KV [0, 60)     negative offsets
# seg 1: Q empty       KV empty       negative lengths
# seg 2: Q [100, 300)  KV [100, 300)  longer than the bound
# seg 3: Q [470, 512)  KV [470, 512)  runs past the end of the row
# seg 4: Q empty       KV empty       offset past the end / negative
# seg 5: Q [320, 370)  KV [320, 350)  kv < q: 20 rows see no key (causal)
COVERED_Q = [(0, 40), (100, 300), (470, 512), (320, 370)]
READ_KV = [(0, 60), (100, 300), (470, 512), (320, 350)]
# Metadata of a poisoned row: every segment clamps to nothing.
EMPTY_OFFS = [-10, 600, 10**6, 3, -1, 512]
EMPTY_LENS = [-5, 0, 0, -100, 0, 7]


def rows_mask(ranges):
  m = np.zeros(T, bool)
  for lo, hi in ranges:
    m[lo:hi] = True
  return m


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("mask", ["causal_bottom_right", "no_mask"])
@pytest.mark.parametrize("layout", ["between_poisoned_rows", "at_buffer_end"])
def test_traced_out_of_range_metadata_stays_inside_its_segments(mask,
                                                                layout):
  rows = (["nan", "test", "nan"] if layout == "between_poisoned_rows" else
          ["nan", "test"])
  b = len(rows)
  test_row = rows.index("test")
  pick = lambda test, empty: np.array(
      [test if r == "test" else empty for r in rows], np.int32)
  meta = [pick(Q_LENS, EMPTY_LENS), pick(KV_LENS, EMPTY_LENS),
          pick(Q_OFFS, EMPTY_OFFS), pick(KV_OFFS, EMPTY_OFFS)]

  rng = np.random.default_rng(0)
  mk = lambda h: rng.standard_normal((b, T, h, D)).astype(np.float32)
  q, k, v, dout = mk(HQ), mk(HKV), mk(HKV), mk(HQ)
  clean = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, dout)]
  poisoned_rows = np.array([r == "nan" for r in rows])[:, None, None, None]
  poisoned = [jnp.asarray(np.where(poisoned_rows, np.nan, x), jnp.bfloat16)
              for x in (q, k, v, dout)]

  def run(backend, q, k, v, dout, *meta):
    def f(q, k, v):
      return jax_cp.fused_attention(
          q, k, v, *meta, attn_mask_type=mask, backend=backend,
          max_seqlen_q=BOUND, max_seqlen_kv=BOUND, return_lse=True)
    (out, lse), pull = jax.vjp(f, q, k, v)
    return (out, lse) + pull((dout, jnp.zeros_like(lse)))

  # The metadata are arguments of the jitted function: traced, unchecked,
  # clamped in-graph.
  meta_j = [jnp.asarray(m) for m in meta]
  got = jax.jit(lambda *a: run("cudnn", *a))(*poisoned, *meta_j)
  want = jax.jit(lambda *a: run("xla", *a))(*clean, *meta_j)
  got = [np.asarray(x, np.float32) for x in got]
  want = [np.asarray(x, np.float32) for x in want]
  names = ("out", "lse", "dq", "dk", "dv")

  covered = rows_mask(COVERED_Q)
  read = rows_mask(READ_KV)
  for name, g, w in zip(names, got, want):
    # Poisoned rows are covered by no segment: 0 (lse -inf), never NaN.
    fill = -np.inf if name == "lse" else 0.0
    for r in np.nonzero(poisoned_rows[:, 0, 0, 0])[0]:
      np.testing.assert_array_equal(g[r], np.full_like(g[r], fill),
                                    err_msg=f"{name}, poisoned row {r}")
    g, w = g[test_row], w[test_row]
    live = read if name in ("dk", "dv") else covered
    # The test row: outside its segments 0 / -inf, like xla.
    np.testing.assert_array_equal(g[~live], w[~live], err_msg=name)
    if name == "lse":
      finite = np.isfinite(w[live])
      np.testing.assert_array_equal(np.isfinite(g[live]), finite)
      np.testing.assert_allclose(g[live][finite], w[live][finite],
                                 atol=2e-2, rtol=2e-2, err_msg=name)
    else:
      assert np.isfinite(g).all(), name
      assert rel_err(g[live], w[live]) < TOL, (name,
                                              rel_err(g[live], w[live]))
