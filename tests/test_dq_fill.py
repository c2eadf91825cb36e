"""``dq_fill``: two backward calls on disjoint rows split the zeroing of
uncovered dq rows between them (the first fills ``[0, r)``, the second,
writing into the first's dq, ``[r, T)``). In-place writes are the cudnn
backend's capability: its checks and lowering here, its GPU run in
tests/gpu; the planner's side is in tests/test_call_plan.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention.backend import Segments

T, H, D, R = 64, 2, 8, 24


def _segments(sel):
  # Four documents with padding gaps: rows [0,10) [12,20) | [30,45) [50,60).
  q_off = np.array([0, 12, 30, 50])
  lens = np.array([10, 8, 15, 10])
  lens = np.where(sel, lens, 0)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return Segments(i32(lens), i32(lens), i32(q_off), i32(q_off), 15, 15,
                  rows_see_keys=True)


@pytest.fixture
def cudnn():
  try:
    from jax_cp.attention import cudnn as module
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built")
  return module


@pytest.mark.parametrize("fill", [(5, 3), (-1, 4), (0, T + 1), [0, 4],
                                  (0.0, 4)])
def test_cudnn_checks_dq_fill(cudnn, fill):
  with pytest.raises(ValueError, match="dq_fill must be a static"):
    cudnn.check_dq_fill(fill, T, False)
  assert cudnn.check_dq_fill(None, T, False) == (0, T)
  assert cudnn.check_dq_fill(None, T, True) == (0, 0)


def test_cudnn_lowering_carries_the_fill_range(cudnn):
  seg = _segments(np.ones(4, bool))
  sds = jax.ShapeDtypeStruct((T, H, 64), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((T, H), jnp.float32)

  def bwd(q, k, v, o, l, do):
    dq, _, _ = cudnn.backward(q, k, v, o, l, do, seg, mask="causal_top_left",
                              scale=0.1, dq_fill=(0, R))
    return cudnn.backward(q, k, v, o, l, do, seg, mask="causal_top_left",
                          scale=0.1, dq_into=dq, dq_fill=(R, T))[0]

  text = jax.jit(bwd).trace(sds, sds, sds, sds, lse, sds).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = lambda name: [l for l in text.splitlines() if f"@{name}(" in l]
  fresh, into = calls(cudnn.BWD_TARGET), calls(cudnn.BWD_INTO_TARGET)
  assert len(fresh) == len(into) == 1
  assert "dq_fill_lo = 0 : i64" in fresh[0] and \
      f"dq_fill_hi = {R} : i64" in fresh[0]
  assert f"dq_fill_lo = {R} : i64" in into[0] and \
      f"dq_fill_hi = {T} : i64" in into[0]
