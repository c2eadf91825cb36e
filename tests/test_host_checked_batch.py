"""A CPBatch checked on the host carries the fact through ``jit``: attention
given it compiles no fallback branch, and its NaN poison of a broken
promise costs no memory; a batch not checked keeps the fallback (more
memory); metadata changed after the check give NaN, never a silently
wrong answer."""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPBatch, CPLayout
from jax_cp.attention import register_backend, xla
from jax_cp.attention.backend import Backend
from jax_cp.cp import guard
from jax_cp.data import make_global_batch
from jax_cp.flax import TransformerLayer
from tests import reference as ref
from tests._devices import devices

CP, W = 4, 64
NLB = "no_load_balance"


def _mesh():
  return jax.make_mesh((CP,), ("cp",), devices=devices(CP),
                       axis_types=(jax.sharding.AxisType.Auto,))


def _metadata(rng, total, longest):
  """[1, N+1] cu_seqlens, cu_seqlens_padded: random padded documents of at
  most ``longest`` tokens filling ``total``, valid lengths below them."""
  plens = []
  while sum(plens) < total:
    plens.append(min(int(rng.integers(1, longest + 1)), total - sum(plens)))
  lens = [int(rng.integers(1, p + 1)) for p in plens]
  cum = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)[None]
  return cum(lens), cum(plens)


def _layout():
  return CPLayout(mesh=_mesh(), strategy=NLB, max_seqlen=W, backend="xla")


def _layer_step(layout):
  """jit(grad) of a TransformerLayer over a batch given as an argument."""
  layer = TransformerLayer(num_heads=4, num_kv_heads=2, head_dim=16,
                           mlp_dim=64, layout=layout)

  def loss(params, batch):
    y = layer.apply(params, batch.tensors["x"], batch)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  return layer, jax.jit(jax.grad(loss))


def _compiled(layout, batch):
  layer, step = _layer_step(layout)
  with jax.set_mesh(layout.mesh):
    params = jax.eval_shape(
        lambda: layer.init(jax.random.key(0), batch.tensors["x"], batch))
    return step.lower(params, batch).compile()


def test_host_checked_batch_costs_no_fallback_memory():
  """A bounded NO_LOAD_BALANCE gradient step taking a batch from
  ``make_global_batch`` as a jit argument: no all-gather and no
  conditional, and the NaN poison of its trusted bound within 2 % of the
  program without it; the same batch not checked compiles the fallback
  (all-gather, conditional, more than 1.2x the memory)."""
  rng = np.random.default_rng(0)
  t = 1024
  cu, cuP = _metadata(rng, t, W)
  x = rng.standard_normal((1, t, 32)).astype(np.float32)
  layout = _layout()
  batch = make_global_batch(dict(x=x), cuP, layout, cu_seqlens=cu)
  assert batch.checked_max_seqlen == W

  def temp_and_text(layout, batch):
    c = _compiled(layout, batch)
    return c.memory_analysis().temp_size_in_bytes, c.as_text()

  got, text = temp_and_text(layout, batch)
  assert "all-gather" not in text and " conditional(" not in text
  # The NaN poison of a trusted bound is free: no more than the program
  # without it.
  with mock.patch.object(guard, "poisoned_config",
                         lambda cfg, cu, cuP: cfg):
    bare, _ = temp_and_text(layout, batch)
  assert got <= 1.02 * bare, (got, bare)

  raw = CPBatch(batch.tensors, batch.cu_seqlens_padded, batch.cu_seqlens,
                layout=layout)
  assert raw.checked_max_seqlen is None
  fallback, text = temp_and_text(layout, raw)
  assert "all-gather" in text and " conditional(" in text
  assert fallback > 1.2 * got, (fallback, got)


def _attention_step(batch):
  """jit(value, grads) of cp_attention on the batch's q, k, v."""

  def loss(q, k, v, b, w):
    out = jax_cp.cp_attention(q, k, v, b)
    return jnp.sum(out * w), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _qkv_batch(rng, t, cu, cuP, layout):
  mk = lambda h: rng.standard_normal((1, t, h, 8)).astype(np.float32)
  host = dict(q=mk(4), k=mk(2), v=mk(2))
  return host, make_global_batch(host, cuP, layout, cu_seqlens=cu)


def _reference(host, w, cu, cuP):
  f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP)
  out = f(host["q"], host["k"], host["v"])
  grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
      host["q"], host["k"], host["v"])
  return out, grads


def _run(batch, w):
  b = batch.tensors
  with jax.set_mesh(batch.layout.mesh):
    (_, out), grads = _attention_step(batch)(b["q"], b["k"], b["v"], batch, w)
  # NO_LOAD_BALANCE keeps the physical order: no restore needed.
  return np.asarray(out), [np.asarray(g) for g in grads]


def test_host_checked_results_and_forged_metadata():
  """Within the bound the host-checked batch gives the reference; its
  metadata swapped after the check for a row with a longer document, by
  pytree ops that keep static data (``tree_unflatten``,
  ``dataclasses.replace``), give NaN outputs and gradients; a new CPBatch
  with those metadata is unchecked and falls back to the right answer."""
  rng = np.random.default_rng(1)
  t = 256
  layout = _layout()
  cu, cuP = _metadata(rng, t, W)
  host, batch = _qkv_batch(rng, t, cu, cuP, layout)
  w = rng.standard_normal((1, t, 4, 8)).astype(np.float32)
  out, grads = _run(batch, w)
  want, want_grads = _reference(host, w, cu, cuP)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  for g, gw in zip(grads, want_grads):
    np.testing.assert_allclose(g, gw, atol=5e-5, rtol=5e-5)

  long_cu, long_cuP = _metadata(rng, t, 3 * W)
  assert np.diff(long_cuP).max() > W
  meta = lambda a: jax.device_put(a, batch.cu_seqlens_padded.sharding)
  leaves, tree = jax.tree.flatten(batch)
  new = {id(batch.cu_seqlens_padded): meta(long_cuP),
         id(batch.cu_seqlens): meta(long_cu)}
  forged = jax.tree.unflatten(tree, [new.get(id(x), x) for x in leaves])
  replaced = dataclasses.replace(batch, cu_seqlens_padded=meta(long_cuP),
                                 cu_seqlens=meta(long_cu))
  valid = ref.valid_token_mask(long_cu[0], long_cuP[0])
  for bad in (forged, replaced):
    assert bad.checked_max_seqlen == W     # the fact survives pytree ops
    out, grads = _run(bad, w)
    assert all(np.isnan(g[0][valid]).all() for g in grads)
    assert np.isnan(out[0][valid]).all()

  fresh = CPBatch(batch.tensors, meta(long_cuP), meta(long_cu),
                  layout=layout)
  assert fresh.checked_max_seqlen is None
  out, grads = _run(fresh, w)
  want, want_grads = _reference(host, w, long_cu, long_cuP)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  for g, gw in zip(grads, want_grads):
    np.testing.assert_allclose(g, gw, atol=5e-5, rtol=5e-5)


def test_check_on_host_and_checked_for():
  """``check_on_host`` checks concrete metadata and records the bound;
  ``checked_for`` trusts it for a layout whose bound is at least as
  large."""
  rng = np.random.default_rng(2)
  cu, cuP = _metadata(rng, 128, 2 * W)
  layout = CPLayout(cp_size=CP, strategy=NLB, max_seqlen=2 * W)
  raw = CPBatch(None, cuP, cu, layout=layout)
  checked = raw.check_on_host()
  assert checked.checked_max_seqlen == 2 * W and raw.checked_max_seqlen is None
  with pytest.raises(ValueError, match="longest padded document"):
    # NO_LOAD_BALANCE counts the valid lengths.
    raw.check_on_host(max_seqlen=int(np.diff(cu).max()) - 1)
  with pytest.raises(ValueError, match="concrete cu_seqlens_padded"):
    jax.jit(lambda c: CPBatch(None, c, cu, layout=layout).check_on_host(
    ).cu_seqlens_padded)(cuP)
  with pytest.raises(ValueError, match="checked_max_seqlen"):
    CPBatch(None, cuP, cu, layout=layout, checked_max_seqlen=0)
  assert checked.checked_for(layout)
  assert checked.checked_for(layout.replace(max_seqlen=4 * W))
  assert not raw.checked_for(layout)
  assert not checked.checked_for(layout.replace(max_seqlen=W))
  assert not checked.checked_for(layout.replace(max_seqlen=None))
  with pytest.raises(ValueError, match="needs a bound"):
    CPBatch(None, cuP, cu, layout=layout.replace(max_seqlen=None)
            ).check_on_host()


# Trace-time log of the recording backend: whether each call's segments
# carried a poison flag.
_POISON_LOG = []


def _recording(fn, seg_index: int):
  """``fn`` logging whether its segments (positional ``seg_index``, as
  the contract passes them) carry a poison flag."""
  def call(*args, **kwargs):
    _POISON_LOG.append(args[seg_index].poison is not None)
    return fn(*args, **kwargs)
  return call


# The xla backend's math with cuDNN's claim about bounds (kernels sized by
# them), so a host-checked bound below the row is trusted, not exact.
_RECORDER = Backend(name="poison_recorder",
                    forward=_recording(xla.forward, 3),
                    backward=_recording(xla.backward, 6),
                    is_available=xla.is_available, handles_poison=True)
register_backend(_RECORDER)


@pytest.mark.sweep(fast=3)
@pytest.mark.parametrize("strategy,window,comm", [
    (NLB, None, "all_gather"), (NLB, 8, "all_gather"),
    ("dual_chunk_swap", None, "all_gather"),
    ("dual_chunk_swap", 8, "all_gather"),
    (NLB, None, "ring"), ("dual_chunk_swap", None, "ring")])
def test_trusted_bound_poisons_every_call(strategy, window, comm):
  """A backend with ``handles_poison`` gets the trusted bound's flag in the
  segments of every call, forward and backward (no K/V products): within
  the bound the float32 reference, with the metadata forged past it NaN
  outputs and gradients."""
  rng = np.random.default_rng(3)
  t, w_bound = 256, 48
  layout = CPLayout(mesh=_mesh(), strategy=strategy, max_seqlen=w_bound,
                    backend="poison_recorder", comm_type=comm)
  unit = 2 * CP if strategy != NLB else 1
  cu, cuP = _metadata(rng, t // unit, w_bound // unit)
  cu, cuP = cu * unit, cuP * unit
  host, batch = _qkv_batch(rng, t, cu, cuP, layout)
  w = rng.standard_normal((1, t, 4, 8)).astype(np.float32)
  window_size = None if window is None else (window, 0)

  def run(b):
    tensors = b.tensors
    def loss(q, k, v, b):
      out = jax_cp.cp_attention(q, k, v, b, window_size=window_size)
      return jnp.sum(out * w), out
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(layout.mesh):
      (_, out), grads = step(tensors["q"], tensors["k"], tensors["v"], b)
    return np.asarray(out), [np.asarray(g) for g in grads]

  _POISON_LOG.clear()
  out, grads = run(batch)
  assert len(_POISON_LOG) >= 2 and all(_POISON_LOG), _POISON_LOG
  if strategy == NLB:      # physical order: the reference applies as is
    f = lambda q, k, v: ref.batched_attention(
        q, k, v, cu, cuP, window=-1 if window is None else window)
    want = f(host["q"], host["k"], host["v"])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)

  long_cu, long_cuP = _metadata(rng, t // unit, 3 * w_bound // unit)
  long_cu, long_cuP = long_cu * unit, long_cuP * unit
  assert np.diff(long_cuP).max() > w_bound
  meta = lambda a: jax.device_put(a, batch.cu_seqlens_padded.sharding)
  forged = dataclasses.replace(batch, cu_seqlens_padded=meta(long_cuP),
                               cu_seqlens=meta(long_cu))
  assert forged.checked_max_seqlen == w_bound
  out, grads = run(forged)
  assert np.isnan(out).all()
  assert all(np.isnan(g).all() for g in grads)
