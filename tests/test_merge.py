"""CPU tests of ``merge_rows`` (jax_cp.attention.merge) and of its lowering
for CUDA (an aliased custom call) when the cuDNN extension is built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention.merge import check_merge_rows, merge_rows_jnp


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
    from jax_cp.attention import cudnn as cudnn_backend
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
