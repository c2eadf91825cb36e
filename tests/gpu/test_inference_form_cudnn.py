"""GPU test: the inference form (``jax_cp_cudnn_sdpa_fwd_out``, marker gpu).

A forward that nothing differentiates and that returns no lse runs a cuDNN
graph that computes no softmax statistics. Its output against the xla
backend in float32 on the same metadata (as jit arguments and as
constants), against the training forward's output (``return_lse=True``)
on the same inputs, and exact zeros on the rows that see no key: every
mask, with and without a window, ragged rows with keyless segments, rows
of one document (the dense graph), and ``cp_attention`` at cp=1.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn = cudnn_backend_or_skip()

import jax_cp  # noqa: E402
from tests.gpu.test_keyless_rows_cudnn import (  # noqa: E402
    SEGS,
    T,
    _inputs,
    _meta,
)
from tests.reference import rel_err  # noqa: E402

TOL = 2e-2


def _keyless(mask, window, meta):
  """bool [B, T]: rows that see no key (from the xla backend's lse)."""
  q, k, v, _ = _inputs(len(SEGS))
  _, lse = jax_cp.fused_attention(q, k, v, *meta, attn_mask_type=mask,
                                  window_size=window, backend="xla",
                                  return_lse=True)
  return np.isneginf(np.asarray(lse)).all(axis=-1)


def _custom_calls(fn, *args):
  text = jax.jit(fn).lower(*args).as_text()
  return set(re.findall(r"custom_call_target=\"(\w+)\"", text)) | set(
      re.findall(r"stablehlo\.custom_call @(\w+)", text))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "constant"])
@pytest.mark.parametrize("mask, window", [
    ("causal_bottom_right", None), ("causal_bottom_right", (15, 0)),
    ("causal_top_left", None), ("causal_top_left", (15, 0)),
    ("no_mask", None)])
def test_inference_form_matches_the_training_forward(mask, window, traced):
  q, k, v, _ = _inputs(len(SEGS))
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  meta = _meta()
  kw = dict(attn_mask_type=mask, window_size=window)

  def infer(backend, q, k, v, *m):
    return jax_cp.fused_attention(q, k, v, *(m or meta), backend=backend,
                                  **kw)

  def train(q, k, v, *m):
    return jax_cp.fused_attention(q, k, v, *(m or meta), backend="cudnn",
                                  return_lse=True, **kw)[0]

  args = (*bf, *meta) if traced else tuple(bf)
  assert cudnn.FWD_OUT_TARGET in _custom_calls(
      lambda *a: infer("cudnn", *a), *args)
  got = np.asarray(jax.jit(lambda *a: infer("cudnn", *a))(*args), np.float32)
  full = np.asarray(jax.jit(train)(*args), np.float32)
  want = np.asarray(infer("xla", q, k, v), np.float32)
  assert np.isfinite(got).all()
  rows = _keyless(mask, window, meta)
  assert rows.any()
  np.testing.assert_array_equal(got[rows], 0.0)
  assert rel_err(got, want) < TOL, rel_err(got, want)
  assert rel_err(got, full) < 1e-2, rel_err(got, full)


def test_inference_form_on_rows_of_one_document():
  """Traced lengths, ``q_offsets=None``: the dense graph, no stats."""
  q, k, v, _ = _inputs(2, seed=1)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  lens = jnp.asarray([[T], [T - 77]], jnp.int32)
  infer = lambda backend, q, k, v, lens: jax_cp.fused_attention(
      q, k, v, lens, lens, backend=backend)
  got = np.asarray(jax.jit(lambda *a: infer("cudnn", *a))(*bf, lens),
                   np.float32)
  want = np.asarray(infer("xla", q, k, v, lens), np.float32)
  np.testing.assert_array_equal(got[1, T - 77:], 0.0)
  assert rel_err(got, want) < TOL, rel_err(got, want)


def test_cp_attention_at_cp1_runs_the_inference_form():
  mesh = jax.make_mesh((1,), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn")
  cu = np.array([0, 100, 232, T], np.int32)
  q, k, v, _ = (x[0] for x in _inputs(1, seed=2))
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  attend = lambda backend: (lambda q, k, v, cu: jax_cp.cp_attention(
      q, k, v, (cu, cu), layout=layout.replace(backend=backend)))
  assert cudnn.FWD_OUT_TARGET in _custom_calls(attend("cudnn"), *bf, cu)
  got = np.asarray(jax.jit(attend("cudnn"))(*bf, cu), np.float32)
  want = np.asarray(jax.jit(attend("xla"))(q, k, v, cu), np.float32)
  assert rel_err(got, want) < TOL, rel_err(got, want)
