"""GPU tests: tiled cuDNN calls (one document per row: the dense graph
without ragged offsets or padding mask) against the reference.

A tiled call computes every row, padding included; these tests check that
the rows past a document's length come out exactly 0 (out, dq, dk, dv),
that nothing of them leaks into the valid rows, and that the results equal
the ragged path's (the same call with traced offsets) and plain masked
attention in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend = cudnn_backend_or_skip()

import jax_cp
from benchmarks.bench_fused import ragged_only_backend
from tests import reference

TOL = 2e-2


def _rows(lens, t):
  """cu/cuP [B, 2] of one document per row with these valid lengths."""
  lens = np.asarray(lens, np.int32)
  cu = np.stack([np.zeros_like(lens), lens], axis=1)
  cuP = np.tile(np.array([0, t], np.int32), (len(lens), 1))
  return cu, cuP


def _inputs(b, t, hq, hkv, d, seed=0, pad_scale=1.0, lens=None):
  rng = np.random.default_rng(seed)
  mk = lambda h, dt=jnp.bfloat16: jnp.asarray(
      rng.standard_normal((b, t, h, d)), dt)
  q, k, v, w = mk(hq), mk(hkv), mk(hkv), mk(hq, jnp.float32)
  if lens is not None:
    # Large cotangents on padding rows must not reach any gradient.
    pad = np.arange(t)[None, :] >= np.asarray(lens)[:, None]
    w = jnp.where(jnp.asarray(pad)[..., None, None], w * pad_scale, w)
  return q, k, v, w


def _fused(concrete: bool, window):
  """fused_attention on one document per row; with ``concrete`` the
  offsets are host arrays (a tiled call), else traced, on the backend
  that never chooses the tiled graph by the metadata (the ragged call)."""
  backend = "cudnn" if concrete else ragged_only_backend("cudnn")

  def attn(q, k, v, lens, offs):
    return jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type="causal_bottom_right",
        backend=backend, window_size=window)

  def loss(q, k, v, w, lens, offs):
    return jnp.sum(attn(q, k, v, lens, offs).astype(jnp.float32) * w)
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  if concrete:
    return lambda q, k, v, w, lens, offs: jax.jit(
        lambda q, k, v, w: grad(q, k, v, w, lens, offs))(q, k, v, w)
  return jax.jit(grad)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, (37, 0)])
def test_tiled_fused_attention_matches_reference_and_ragged(d, window):
  b, t, hq, hkv = 3, 384, 8, 2
  lens = np.array([384, 250, 1], np.int32)
  cu, cuP = _rows(lens, t)
  q, k, v, w = _inputs(b, t, hq, hkv, d, pad_scale=1e4, lens=lens)
  offs = np.zeros((b, 1), np.int32)
  lens2 = lens[:, None]
  text = jax.jit(lambda q, k, v: jax_cp.fused_attention(
      q, k, v, lens2, lens2, offs, offs, attn_mask_type="causal_bottom_right",
      backend="cudnn", window_size=window)).lower(q, k, v).as_text()
  assert "tiled = 1" in text
  (_, tiled_g), (_, ragged_g) = (
      _fused(True, window)(q, k, v, w, lens2, offs),
      _fused(False, window)(q, k, v, w, jnp.asarray(lens2),
                            jnp.asarray(offs)))
  out = jax_cp.fused_attention(q, k, v, lens2, lens2, offs, offs,
                               attn_mask_type="causal_bottom_right",
                               backend="cudnn", window_size=window)
  left = -1 if window is None else window[0]
  ref_fn = lambda q, k, v: reference.batched_attention(q, k, v, cu, cuP,
                                                       window=left)
  ref_out, vjp = jax.vjp(ref_fn, q, k, v)
  ref_g = vjp(w)
  assert reference.rel_err(out, ref_out) < TOL
  for i, n in enumerate(lens):
    assert np.all(np.asarray(out[i, n:], np.float32) == 0)
  for name, got, rag, want in zip("qkv", tiled_g, ragged_g, ref_g):
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name
    assert reference.rel_err(got, want) < TOL, name
    assert reference.rel_err(got, rag) < TOL, name
    for i, n in enumerate(lens):
      assert np.all(np.asarray(got[i, n:], np.float32) == 0), (name, i)


def test_cp1_layer_call_is_tiled_and_matches_reference():
  """cp_attention without CP (cp_axis=None) with one document slot per
  row (traced metadata inside jit) runs the tiled call."""
  b, t, hq, hkv, d = 2, 256, 4, 4, 64
  lens = np.array([256, 99], np.int32)
  cu, cuP = _rows(lens, t)
  q, k, v, w = _inputs(b, t, hq, hkv, d, seed=1, pad_scale=1e3, lens=lens)
  layout = jax_cp.CPLayout(cp_axis=None, backend="cudnn")

  def loss(q, k, v, w, cu, cuP):
    o = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return jnp.sum(o.astype(jnp.float32) * w), o
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  text = step.lower(q, k, v, w, cu, cuP).as_text()
  assert text.count("tiled = 1") >= 2
  (_, out), grads = step(q, k, v, w, jnp.asarray(cu), jnp.asarray(cuP))
  ref_fn = lambda q, k, v: reference.batched_attention(q, k, v, cu, cuP)
  ref_out, vjp = jax.vjp(ref_fn, q, k, v)
  assert reference.rel_err(out, ref_out) < TOL
  for name, got, want in zip("qkv", grads, vjp(w)):
    assert reference.rel_err(got, want) < TOL, name
    assert np.all(np.asarray(got[1, 99:], np.float32) == 0), name
