"""GPU tests: the ``"cudnn"`` backend's K/V assembly (``jax_cp_assemble_kv``)
against the portable concatenation, and cuDNN reading only the rows it
copies (marker gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend = cudnn_backend_or_skip()

from jax_cp.attention.assemble import assemble_kv_jnp  # noqa: E402
from jax_cp.attention.registry import Segments  # noqa: E402

TAIL = cudnn_backend.ASSEMBLE_ZERO_TAIL


def _inputs(rng, b, h0, tl, hkv, d, dtype):
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return mk(b, h0, 2 * hkv, d), mk(b, tl, hkv, d), mk(b, tl, hkv, d)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("b,h0,tl,hkv,d,rows,first,count", [
    # halo and local rows, the straddle case
    (1, 700, 1024, 8, 128, 700 + 1023, [650], [900]),
    # B = 3: inside the halo, inside the local part, and nothing (rank 0:
    # only the zero tail is written)
    (3, 300, 512, 2, 64, 600, [10, 320, 0], [200, 150, 0]),
    # a range reaching the end (tail cut off), and one past it (clamped)
    (2, 64, 256, 4, 32, 300, [100, 290], [200, 40]),
    # a halo of 0 rows (copy of local rows only); count < 0 reads as 0
    (2, 0, 256, 1, 8, 256, [5, 7], [100, -3]),
])
def test_assemble_kv_copies_the_range_and_zeroes_the_tail(
    dtype, b, h0, tl, hkv, d, rows, first, count):
  rng = np.random.default_rng(rows + b)
  halo, k, v = _inputs(rng, b, h0, tl, hkv, d, dtype)
  first_j = jnp.asarray(first, jnp.int32)
  count_j = jnp.asarray(count, jnp.int32)
  kx, vx = jax.jit(cudnn_backend.assemble_kv, static_argnums=3)(
      halo, k, v, rows, first_j, count_j)
  assert kx.shape == vx.shape == (b, rows, hkv, d) and kx.dtype == dtype
  want_k, want_v = assemble_kv_jnp(halo, k, v, rows)
  for got, want in ((kx, want_k), (vx, want_v)):
    got, want = np.asarray(got), np.asarray(want)
    for i in range(b):
      lo = min(max(first[i], 0), rows)
      end = min(lo + max(count[i], 0), rows)
      np.testing.assert_array_equal(got[i, lo:end], want[i, lo:end])
      tail = got[i, end:min(end + TAIL, rows)]
      np.testing.assert_array_equal(tail, np.zeros_like(tail))


def test_assemble_kv_rejects_bad_shapes():
  halo, k, v = _inputs(np.random.default_rng(0), 1, 8, 16, 2, 8,
                       jnp.bfloat16)
  z = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="rows must be a static int"):
    cudnn_backend.assemble_kv(halo, k, v, 25, z, z)
  with pytest.raises(ValueError, match="halo \\[B, H0, 2\\*Hkv, D\\]"):
    cudnn_backend.assemble_kv(halo[:, :, :3], k, v, 10, z, z)
  with pytest.raises(ValueError, match="first must be an integer \\[B\\]"):
    cudnn_backend.assemble_kv(halo, k, v, 10, jnp.zeros((2,), jnp.int32), z)
  with pytest.raises(ValueError, match="bfloat16/float16"):
    cudnn_backend.assemble_kv(halo.astype(jnp.float32),
                              k.astype(jnp.float32), v.astype(jnp.float32),
                              10, z, z)


def test_cudnn_reads_nothing_outside_the_range_and_tail():
  """The straddle call (bottom-right causal) on an assembled buffer whose
  rows outside ``[first, end + tail)`` hold NaN gives exactly the result on
  the fully concatenated buffer, forward and backward: the uninitialised
  rows assemble_kv leaves are never read."""
  rng = np.random.default_rng(7)
  b, h0, tl, hq, hkv, d = 1, 1500, 2048, 8, 2, 128
  rows = h0 + 1499
  halo, k, v = _inputs(rng, b, h0, tl, hkv, d, jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((tl, hq, d)), jnp.bfloat16)
  dout = jnp.asarray(rng.standard_normal((tl, hq, d)), jnp.bfloat16)
  first, count = 1100, 400 + 937      # 400 halo rows, 937 local rows
  seg = Segments(jnp.asarray([937], jnp.int32), jnp.asarray([count],
                                                            jnp.int32),
                 jnp.zeros((1,), jnp.int32), jnp.asarray([first], jnp.int32),
                 1499, 1500 + 1499, rows_see_keys=True)
  kx, vx = cudnn_backend.assemble_kv(halo, k, v, rows,
                                     jnp.asarray([first], jnp.int32),
                                     jnp.asarray([count], jnp.int32))
  r = jnp.arange(rows)[None, :, None, None]
  keep = (r >= first) & (r < first + count + TAIL)
  poison = lambda x: jnp.where(keep, x, jnp.nan).astype(x.dtype)
  full_k, full_v = assemble_kv_jnp(halo, k, v, rows)

  def run(kk, vv):
    out, lse = cudnn_backend.forward(q, kk[0], vv[0], seg,
                                     mask="causal_bottom_right", scale=0.1)
    grads = cudnn_backend.backward(q, kk[0], vv[0], out, lse, dout, seg,
                                   mask="causal_bottom_right", scale=0.1)
    return (out, lse) + tuple(grads)

  got = jax.jit(run)(poison(kx), poison(vx))
  want = jax.jit(run)(full_k, full_v)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if name in ("dk", "dv"):   # rows outside the segment: 0 on both
      g, w = g[first:first + count], w[first:first + count]
    assert np.isfinite(g[:937]).all(), name
    if name in ("out", "lse"):
      np.testing.assert_array_equal(g, w, err_msg=name)
    else:   # the backward may accumulate in a different order
      np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2, err_msg=name)
