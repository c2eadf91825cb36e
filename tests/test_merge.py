"""CPU tests of ``merge_rows`` (jax_cp.attention.decompose.merge) and of
its lowering for CUDA (an aliased custom call) when the cuDNN extension is
built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention.decompose.merge import (
  check_merge_rows,
  merge_rows_jnp,
  merge_softmax_rows,
)


@pytest.mark.parametrize("op", ["add", "max"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_rows_jnp(op, dtype):
  rng = np.random.default_rng(1)
  dst = jnp.asarray(rng.standard_normal((2, 40, 3, 4)), dtype)
  src = jnp.asarray(rng.standard_normal((2, 7, 3, 4)), dtype)
  got = np.asarray(jax.jit(lambda d, s: merge_rows_jnp(d, s, 30, op))(
      dst, src).astype(jnp.float32))
  want = np.asarray(dst.astype(jnp.float32)).copy()
  s = np.asarray(src.astype(jnp.float32))
  want[:, 30:37] = want[:, 30:37] + s if op == "add" else np.maximum(
      want[:, 30:37], s)
  want = np.asarray(jnp.asarray(want).astype(dtype).astype(jnp.float32))
  np.testing.assert_array_equal(got, want)


def test_merge_rows_max_with_neg_inf():
  dst = jnp.full((1, 6, 2), -jnp.inf, jnp.float32).at[:, 3:].set(1.5)
  src = jnp.asarray([[[0.5, -2.0]] * 4], jnp.float32)
  got = np.asarray(merge_rows_jnp(dst, src, 0, "max"))
  np.testing.assert_array_equal(got[0, :3], [[0.5, -2.0]] * 3)
  np.testing.assert_array_equal(got[0, 3], [1.5, 1.5])
  np.testing.assert_array_equal(got[0, 4:], [[1.5, 1.5]] * 2)


@pytest.mark.parametrize("src_shape,offset,op,match", [
    ((1, 8, 4), 9, "add", "row_offset"),
    ((1, 8, 4), -1, "add", "row_offset"),
    ((1, 8, 5), 0, "add", "trailing"),
    ((2, 8, 4), 0, "add", "equal B"),
    ((1, 8, 4), 0, "sum", "op must be"),
])
def test_check_merge_rows(src_shape, offset, op, match):
  dst = jnp.zeros((1, 16, 4), jnp.float32)
  with pytest.raises(ValueError, match=match):
    check_merge_rows(dst, jnp.zeros(src_shape, jnp.float32), offset, op)


def test_cudnn_merge_rows_lowers_to_aliased_custom_call():
  try:
    from jax_cp.attention.cudnn import backend as cudnn_backend
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built")
  f = lambda d, s: cudnn_backend.merge_rows(d * 2, s, 3, "max")
  text = jax.jit(f).trace(
      jax.ShapeDtypeStruct((2, 10, 4, 8), jnp.bfloat16),
      jax.ShapeDtypeStruct((2, 5, 4, 8), jnp.bfloat16)).lower(
          lowering_platforms=("cuda",)).as_text()
  calls = [l for l in text.splitlines()
           if f"@{cudnn_backend.MERGE_TARGET}(" in l]
  assert len(calls) == 1
  call = calls[0]
  assert "op = 1 : i64" in call and "row_offset = 3 : i64" in call
  assert "output_operand_aliases" in call and "operand_index = 0" in call
  assert "(tensor<2x10x4x8xbf16>, tensor<2x5x4x8xbf16>) -> " \
         "tensor<2x10x4x8xbf16>" in call


def _attention_f64(q, k):
  """(out, lse) of softmax(q k^T) k over all keys in float64: ``q [B, T,
  H, D]``, ``k [B, S, H, D]`` (values = keys); ``S = 0`` gives 0 / -inf."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  s = np.einsum("bthd,bshd->bhts", q, k)
  if k.shape[1] == 0:
    return np.zeros_like(q), np.full(q.shape[:3], -np.inf)
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  lse = (np.log(p.sum(-1)) + m[..., 0]).transpose(0, 2, 1)
  out = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), k)
  return out, lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_softmax_rows_is_attention_over_both_key_sets(dtype):
  """Rows [0, n) merged with attention over a second key set equal
  attention over the union; rows past n, rows not ``valid`` and rows whose
  second part sees no key (lse -inf) keep the first call's values."""
  rng = np.random.default_rng(3)
  b, t, n, h, d = 2, 12, 5, 3, 8
  q = rng.standard_normal((b, t, h, d))
  k1 = rng.standard_normal((b, 9, h, d))
  k2 = rng.standard_normal((b, 4, h, d))
  out1, lse1 = _attention_f64(q, k1)
  out2, lse2 = _attention_f64(q[:, :n], k2)
  lse2[1, 2] = -np.inf            # a row that sees none of the second keys
  out2[1, 2] = 0.0
  lse1[1, 4], out1[1, 4] = -np.inf, 0.0     # and one that sees no key at all
  lse2[1, 4], out2[1, 4] = -np.inf, 0.0
  valid = np.ones((b, n), bool)
  valid[0, 3:] = False            # rows of another document
  got_out, got_lse = jax.jit(merge_softmax_rows)(
      jnp.asarray(out1, dtype), jnp.asarray(lse1, jnp.float32),
      jnp.asarray(out2, dtype), jnp.asarray(lse2, jnp.float32),
      jnp.asarray(valid))
  want_out, want_lse = out1.copy(), lse1.copy()
  both_out, both_lse = _attention_f64(
      q[:, :n], np.concatenate([k1, k2], axis=1))
  use = valid.copy()
  use[1, 2] = use[1, 4] = False
  want_out[:, :n][use] = both_out[use]
  want_lse[:, :n][use] = both_lse[use]
  assert got_out.dtype == dtype and got_lse.dtype == jnp.float32
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(got_out, np.float64), want_out,
                             atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(got_lse), want_lse, atol=1e-5,
                             rtol=1e-5)
  # The kept rows are exactly the first call's.
  keep = np.ones((b, t), bool)
  keep[:, :n] = ~use
  np.testing.assert_array_equal(
      np.asarray(got_out, np.float64)[keep],
      np.asarray(jnp.asarray(out1, dtype), np.float64)[keep])
