"""The inference form: a forward that nothing differentiates and that
returns no lse computes and writes no log-sum-exp.

On CPU: which backend call each program makes (a backend that records its
calls, with the xla backend's numerics, against the float64 reference),
and, where the extension is built, which custom call the program lowers
to for CUDA (``jax_cp_cudnn_sdpa_fwd_out`` against ``jax_cp_cudnn_sdpa_fwd``).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp.attention import registry, xla
from jax_cp.attention.backend import Backend
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices
from tests._lowering import lower_for_cuda

HQ, HKV, D, T = 4, 2, 16, 48
LENS = np.array([[20, 28]], np.int32)
OFFS = np.array([[0, 20]], np.int32)


def _inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((1, T, HQ, D)).astype(np.float32)
  k = rng.standard_normal((1, T, HKV, D)).astype(np.float32)
  v = rng.standard_normal((1, T, HKV, D)).astype(np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@dataclasses.dataclass
class _Calls:
  forward: int = 0
  forward_out: int = 0


@pytest.fixture
def recording_backend(monkeypatch):
  """A backend named "recording": the xla backend's numerics, with a
  ``forward_out`` that drops the lse, counting the calls made at trace
  time (registered in a registry of its own)."""
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  calls = _Calls()

  def forward(*args, **kwargs):
    calls.forward += 1
    return xla.forward(*args, **kwargs)

  def forward_out(*args, **kwargs):
    calls.forward_out += 1
    return xla.forward(*args, **kwargs)[0]

  registry.register_backend(Backend(
      name="recording", forward=forward, backward=xla.backward,
      forward_out=forward_out, is_available=xla.is_available,
      exact_past_bounds=True))
  return calls


CU = np.array([0, 20, 48], np.int32)


def _want(q, k, v):
  """The float32 reference output of the two causal documents of a row
  ``[T, H, D]``."""
  return np.asarray(ref.attention(q, k, v, CU, CU), np.float64)


def _fused(q, k, v, **kw):
  return jax_cp.fused_attention(q, k, v, LENS, LENS, OFFS, OFFS,
                                backend="recording", **kw)


def test_undifferentiated_forward_calls_forward_out(recording_backend):
  q, k, v = _inputs()
  out = jax.jit(_fused)(q, k, v)
  assert (recording_backend.forward_out, recording_backend.forward) == (1, 0)
  assert ref.rel_err(out[0], _want(q[0], k[0], v[0])) < 1e-5


def test_return_lse_keeps_the_forward(recording_backend):
  q, k, v = _inputs()
  out, lse = jax.jit(lambda q, k, v: _fused(q, k, v, return_lse=True))(
      q, k, v)
  assert (recording_backend.forward_out, recording_backend.forward) == (0, 1)
  assert np.isfinite(np.asarray(lse)[0, :int(LENS.sum())]).all()


def test_differentiated_forward_keeps_lse_and_gradients_match(
    recording_backend):
  q, k, v = _inputs(1)
  dout = jax.random.normal(jax.random.key(2), q.shape, jnp.float32)

  def loss(q, k, v):
    return jnp.sum(_fused(q, k, v) * dout)
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert recording_backend.forward_out == 0
  assert recording_backend.forward == 1
  want = jax.grad(lambda q, k, v: jnp.sum(jax_cp.fused_attention(
      q, k, v, LENS, LENS, OFFS, OFFS, backend="xla") * dout),
      argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_cp_attention_at_cp1_runs_the_inference_form(recording_backend):
  """cp=1 is one call: undifferentiated it takes forward_out; its
  gradient takes forward (the backward reads lse)."""
  mesh = jax.make_mesh((1,), ("cp",), devices=devices(1, "cpu"),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="recording",
                           strategy="no_load_balance")
  q, k, v = (x[0] for x in _inputs(3))
  attend = lambda q, k, v: jax_cp.cp_attention(q, k, v, (CU, CU),
                                               layout=layout)
  out = jax.jit(attend)(q, k, v)
  assert (recording_backend.forward_out, recording_backend.forward) == (1, 0)
  assert ref.rel_err(out, _want(q, k, v)) < 1e-5
  jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)),
                   argnums=(0, 1, 2)))(q, k, v)
  assert recording_backend.forward == 1


@pytest.mark.parametrize("strategy, inference", [
    ("dual_chunk_swap", True), ("no_load_balance", False)])
def test_cp_attention_at_cp2(recording_backend, strategy, inference):
  """DUAL_CHUNK_SWAP at cp=2 runs both steps as one call: the inference
  form. NO_LOAD_BALANCE with a bound merges the straddling document's
  halo call by log-sum-exp: the forward keeps lse."""
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="recording",
                           strategy=strategy, max_seqlen=28)
  q, k, v = (x[0] for x in _inputs(4))
  order = lambda x: reorder_for_cp(x, CU, layout, seq_dim=0)
  out = jax.jit(lambda q, k, v: jax_cp.cp_attention(q, k, v, (CU, CU),
                                                    layout=layout))(
      order(q), order(k), order(v))
  assert (recording_backend.forward_out > 0) == inference
  assert (recording_backend.forward > 0) != inference
  out = restore_from_cp(out, CU, layout, seq_dim=0)
  assert ref.rel_err(out, _want(q, k, v)) < 1e-5


# ---------------------------------------------------------------------------
# Lowered for CUDA (the extension's custom calls)
# ---------------------------------------------------------------------------


def _targets():
  try:
    from jax_cp.attention.cudnn import backend as cudnn
  except ModuleNotFoundError:
    pytest.skip("jax_cp's cuDNN extension is not built")
  return cudnn.FWD_TARGET, cudnn.FWD_OUT_TARGET, cudnn.BWD_TARGET


def _calls(text):
  names = re.findall(r"stablehlo\.custom_call @(\w+)", text)
  return {n: names.count(n) for n in set(names)}


@pytest.mark.parametrize("traced", [False, True], ids=["constant", "traced"])
def test_cudnn_forward_lowers_to_the_inference_call(traced):
  fwd, fwd_out, bwd = _targets()
  q, k, v = _inputs(dtype=jnp.bfloat16)
  meta = (LENS, LENS, OFFS, OFFS)

  def attend(q, k, v, *meta, **kw):
    return jax_cp.fused_attention(q, k, v, *meta, backend="cudnn", **kw)
  if traced:
    f = attend
    args = (q, k, v, *meta)
  else:
    f = lambda q, k, v, **kw: attend(q, k, v, *meta, **kw)
    args = (q, k, v)
  # Traced metadata with the rows as bounds: each call has its dense
  # (tiled) alternative, chosen on the device (docs/internals.md, Tiled
  # calls): the same targets, twice.
  n = 2 if traced else 1
  assert _calls(lower_for_cuda(f, *args)) == {fwd_out: n}
  with_lse = lambda *a: f(*a, return_lse=True)
  assert _calls(lower_for_cuda(with_lse, *args)) == {fwd: n}
  grad = jax.grad(lambda q, *rest: jnp.sum(f(q, *rest).astype(jnp.float32)))
  assert _calls(lower_for_cuda(grad, *args)) == {fwd: n, bwd: n}


def test_cudnn_inference_call_has_one_result():
  _, fwd_out, _ = _targets()
  q, k, v = _inputs(dtype=jnp.bfloat16)
  text = lower_for_cuda(lambda q, k, v: jax_cp.fused_attention(
      q, k, v, LENS, LENS, OFFS, OFFS, backend="cudnn"), q, k, v)
  line = next(ln for ln in text.splitlines() if f"@{fwd_out}(" in ln)
  results = line.rsplit("->", 1)[1]
  assert results.strip().startswith(f"tensor<{T}x{HQ}x{D}xbf16>"), results
  assert "f32" not in results
