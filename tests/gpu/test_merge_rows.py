"""GPU tests: the in-place row merge of the ``"cudnn"`` backend
(``jax_cp_merge_rows``) against numpy, on buffers XLA aliases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend = cudnn_backend_or_skip()

from jax_cp.attention.decompose.merge import merge_rows_jnp


def _reference(dst, src, off, op):
  out = np.array(dst, np.float32)
  s = np.array(src, np.float32)
  rows = slice(off, off + s.shape[1])
  out[:, rows] = out[:, rows] + s if op == "add" else np.maximum(out[:, rows],
                                                                s)
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("op", ["add", "max"])
@pytest.mark.parametrize("shape,src_rows,off", [
    ((1, 4096, 8, 128), 1023, 0),       # a straddle prefix
    ((2, 300, 4, 64), 77, 223),         # the tail (halo gradients), B=2
    ((3, 50, 6), 50, 0),                # lse-like, whole buffer
    ((1, 10, 2, 8), 0, 5),              # nothing to merge
])
def test_merge_rows_matches_numpy(dtype, op, shape, src_rows, off):
  rng = np.random.default_rng(hash((shape, off, op)) % 2**32)
  dst = rng.standard_normal(shape).astype(np.float32)
  src = rng.standard_normal((shape[0], src_rows) + shape[2:]).astype(
      np.float32)
  dst_j, src_j = jnp.asarray(dst, dtype), jnp.asarray(src, dtype)
  # The kernel gets dst_j * 2 (exact in every dtype).
  want = _reference(dst_j.astype(jnp.float32) * 2, src_j.astype(jnp.float32),
                    off, op)

  # dst is an intermediate (x * 2, exact), so XLA can alias it without a
  # copy; the untouched rows must come through exactly.
  @jax.jit
  def f(x, s):
    return cudnn_backend.merge_rows(x * 2, s, off, op)
  got = np.asarray(f(dst_j, src_j).astype(jnp.float32))
  exact = np.ones(shape[1], bool)
  exact[off:off + src_rows] = False
  np.testing.assert_array_equal(got[:, exact], want[:, exact])
  tol = 0 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(got[:, ~exact], want[:, ~exact], rtol=tol,
                             atol=tol)
  # Same as the portable version, up to one rounding of the 16-bit types
  # (XLA may keep the fused x * 2 in float32).
  ref = np.asarray(jax.jit(lambda x, s: merge_rows_jnp(x * 2, s, off, op))(
      dst_j, src_j).astype(jnp.float32))
  np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * 1e-3)


def test_merge_rows_keeps_a_dst_still_in_use():
  """When dst is used after the merge, XLA must copy it first: the caller's
  value stays unchanged."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 4)),
                  jnp.float32)
  s = jnp.ones((1, 8, 4), jnp.float32)

  @jax.jit
  def f(x, s):
    y = x + 0
    return cudnn_backend.merge_rows(y, s, 8, "add"), y
  merged, y = f(x, s)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(merged)[:, 8:16],
                                np.asarray(x)[:, 8:16] + 1)


def test_merge_rows_bad_arguments():
  x = jnp.zeros((1, 16, 4), jnp.float32)
  with pytest.raises(ValueError, match="row_offset"):
    cudnn_backend.merge_rows(x, jnp.zeros((1, 8, 4), jnp.float32), 9, "add")
  with pytest.raises(ValueError, match="dtype"):
    cudnn_backend.merge_rows(x, jnp.zeros((1, 8, 4), jnp.bfloat16), 0, "add")
  with pytest.raises(ValueError, match="op"):
    cudnn_backend.merge_rows(x, jnp.zeros((1, 8, 4), jnp.float32), 0, "min")
