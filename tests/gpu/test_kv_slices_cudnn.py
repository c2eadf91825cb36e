"""GPU test: the cuDNN backward over K/V slices (marker gpu).

A scratch bound so small that every backward runs one sub-call per KV
head and, each, over K/V slices (jax_cp.attention.cudnn.kv_slices): per slice a
bottom-right call over the causal parts and an unmasked call over the
rest. Its gradients against the same backward as one call (no bound) and
against the xla backend in float32, on layouts with Tq != Tkv, rows
without keys and empty segments, every mask. The long-row test of the
split at 2^31 elements of K/V is in test_long_rows_exact.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

from jax_cp.attention.cudnn import workspace as cudnn_workspace  # noqa: E402
from jax_cp.attention.registry import resolve_backend  # noqa: E402
from tests.gpu.test_cudnn_backend import (  # noqa: E402
    make_layout,
    random_inputs,
    rel_err,
)

CUDNN = resolve_backend("cudnn")
XLA = resolve_backend("xla")


@pytest.mark.parametrize("kind,mask", [
    ("kv_longer", "causal_bottom_right"), ("kv_shorter", "causal_bottom_right"),
    ("many_short", "causal_top_left"), ("kv_longer", "no_mask")])
def test_sliced_backward_matches_one_call(monkeypatch, kind, mask):
  layout = make_layout(kind, seed=11)
  q, k, v, do = random_inputs(layout, 8, 2, 128, jnp.bfloat16, seed=11)
  seg = layout.segments()
  out, lse = jax.jit(lambda q, k, v: CUDNN.forward(
      q, k, v, seg, mask=mask, scale=0.1))(q, k, v)

  def grads(limit):
    monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, limit)
    cudnn = resolve_backend("cudnn")   # reads the scratch bound
    return [np.asarray(x, np.float32) for x in jax.jit(
        lambda *a: cudnn.backward(*a, seg, mask=mask, scale=0.1))(
            q, k, v, out, lse, do)]

  sliced, whole = grads("1e-9"), grads("inf")
  groups, slices = cudnn_workspace.backward_split(
      q.shape[0], k.shape[0], 8, 2, 128, limit=1.0,
      segments=seg.q_lens.shape[0], max_seqlen_q=seg.max_seqlen_q)
  assert groups == 2 and slices > 1
  f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, out, do)]
  ref = XLA.backward(*f32[:3], f32[3], lse, f32[4], seg, mask=mask,
                     scale=0.1)
  for name, s, w, r in zip(("dq", "dk", "dv"), sliced, whole, ref):
    assert np.isfinite(s).all(), name
    # dq: float32 sums of bfloat16 shares; dk/dv: one slice's calls.
    assert rel_err(s, w) < 1e-2, (name, rel_err(s, w))
    assert rel_err(s, np.asarray(r)) < 2e-2, (name, rel_err(s, r))
