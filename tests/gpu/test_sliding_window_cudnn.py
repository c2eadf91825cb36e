"""GPU tests of sliding windows on the ``"cudnn"`` backend (marker gpu):
fused_attention (both alignments, forward and gradients) against the
windowed float32 reference and against JAX's own cuDNN sliding window, and
cp_attention with a window over 2, 4 and 8 GPUs, both strategies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

HQ, HKV, D = 8, 2, 128
TOL = 2e-2  # bf16 inputs, float32 reference


def _bf16(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _close(name, got, want, rows):
  got = np.asarray(got, np.float32)[rows]
  want = np.asarray(want, np.float32)[rows]
  assert np.isfinite(got).all(), name
  err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want),
                                               1e-2 * np.sqrt(want.size)))
  assert err < TOL, (name, err)


@pytest.mark.parametrize("left", [0, 1, 127, 1000, 5000])
@pytest.mark.parametrize("mask", ["causal_top_left", "causal_bottom_right"])
def test_fused_attention_window_matches_reference(mask, left):
  """Ragged documents (some shorter than the window); bottom-right calls
  have Q rows that are the last half of each document."""
  rng = np.random.default_rng(left)
  cu = np.array([0, 700, 3000, 3001, 4096])
  t = int(cu[-1])
  q, k, v = _bf16(rng, (t, HQ, D)), _bf16(rng, (t, HKV, D)), _bf16(
      rng, (t, HKV, D))
  lens, starts = np.diff(cu).astype(np.int32), cu[:-1].astype(np.int32)
  if mask == "causal_top_left":
    q_lens, q_starts = lens, starts
  else:
    q_lens = lens - lens // 2
    q_starts = starts + lens // 2
  rows = np.zeros(t, bool)
  for s, n in zip(q_starts, q_lens):
    rows[s:s + n] = True
  w = jnp.asarray(rng.standard_normal((t, HQ, D)), jnp.float32)

  def ours(q, k, v):
    return jax_cp.fused_attention(q, k, v, q_lens, lens, q_starts, starts,
                                  attn_mask_type=mask, backend="cudnn",
                                  window_size=(left, 0))

  def theirs(q, k, v):
    out = ref.attention(q, k, v, cu, cu, window=left)
    return jnp.where(jnp.asarray(rows)[:, None, None], out, 0)

  loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)
  got = jax.jit(ours)(q, k, v)
  got_g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  want = theirs(q, k, v)
  want_g = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
  _close("out", got, want, rows)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[~rows], 0.0)
  _close("dq", got_g[0], want_g[0], rows)
  _close("dk", got_g[1], want_g[1], np.ones(t, bool))
  _close("dv", got_g[2], want_g[2], np.ones(t, bool))


def test_fused_attention_window_matches_jax_cudnn():
  """One document: the same numbers as jax.nn.dot_product_attention(
  implementation="cudnn", local_window_size=(left, 0))."""
  rng = np.random.default_rng(0)
  t, left = 8192, 1023
  q, k, v = _bf16(rng, (t, HQ, D)), _bf16(rng, (t, HKV, D)), _bf16(
      rng, (t, HKV, D))
  n = np.array([t], np.int32)
  o = np.array([0], np.int32)
  ours = jax.jit(lambda q, k, v: jax_cp.fused_attention(
      q, k, v, n, n, o, o, attn_mask_type="causal_top_left",
      backend="cudnn", window_size=(left, 0)))(q, k, v)
  theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q[None], k[None], v[None], is_causal=True, implementation="cudnn",
      local_window_size=(left, 0))[0])(q, k, v)
  _close("out", ours, theirs, np.ones(t, bool))


@pytest.mark.parametrize("left", [0, 100, 1500])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_attention_cudnn_window_matches_reference(cp, strategy, left):
  """Windows below and above a NO_LOAD_BALANCE chunk (4096 / cp tokens)
  and 0; documents shorter and longer than the window."""
  gpus = devices(cp, "gpu")
  t = 4096
  rng = np.random.default_rng(cp * 100 + left)
  cu, cuP = ref.random_layout(rng, t, cp, "mixed",
                              dual_chunk=strategy is S.DUAL_CHUNK_SWAP,
                              max_docs=96)
  cu, cuP = cu[None], cuP[None]
  q = _bf16(rng, (1, t, HQ, D))
  k, v = _bf16(rng, (1, t, HKV, D)), _bf16(rng, (1, t, HKV, D))
  w = jnp.asarray(rng.standard_normal((1, t, HQ, D)), jnp.float32)
  mesh = jax.make_mesh((cp,), ("cp",), devices=gpus,
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, backend="cudnn", strategy=strategy)
  attn = functools.partial(jax_cp.cp_attention, layout=layout,
                           window_size=(left, 0))
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(jax.device_get(x), cuP, layout, seq_dim=1)
  loss = lambda q, k, v, w: jnp.sum(
      attn(q, k, v, (cu, cuP)).astype(jnp.float32) * w)
  out = jax.jit(lambda q, k, v: attn(q, k, v, (cu, cuP)))(re(q), re(k),
                                                          re(v))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(re(q), re(k), re(v),
                                                      re(w))
  with jax.default_device(gpus[0]):
    f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP, window=left)
    want = f(q, k, v)
    want_g = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
        q, k, v)
  valid = ref.valid_token_mask(cu[0], cuP[0])[None]
  for name, got, exp in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads),
                            (want,) + tuple(want_g)):
    got = np.asarray(back(got), np.float32)
    _close(name, got, exp, valid)
    np.testing.assert_array_equal(got[~valid], 0.0, err_msg=name)
