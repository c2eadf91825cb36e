"""Dtype and segment-metadata rules of the public entry points: bad input
raises ValueError naming the argument before any kernel runs; traced
metadata that breaks the rules is clamped into the buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp.data import (
  longest_padded_document,
  make_global_batch,
  reorder_for_cp,
  restore_from_cp,
)
from tests import reference
from tests._devices import devices

T, HQ, HKV, D = 16, 4, 2, 8


def qkv(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((T, HQ, D))
  k = rng.standard_normal((T, HKV, D))
  v = rng.standard_normal((T, HKV, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


LENS = np.array([6, 8], np.int32)
OFFS = np.array([0, 8], np.int32)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_,
                                   jnp.uint16])
def test_fused_attention_rejects_non_float(dtype):
  q, k, v = (x.astype(dtype) for x in qkv())
  with pytest.raises(ValueError, match=r"q must have a floating dtype"):
    jax_cp.fused_attention(q, k, v, LENS, LENS, OFFS, OFFS, backend="xla")


def test_fused_attention_rejects_mixed_dtypes():
  q, k, v = qkv()
  with pytest.raises(ValueError, match=r"one dtype.*k.dtype=bfloat16"):
    jax_cp.fused_attention(q, k.astype(jnp.bfloat16), v, LENS, LENS, OFFS,
                           OFFS, backend="xla")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn])
def test_cp_attention_rejects_dtype(dtype):
  q, k, v = (x.astype(dtype) for x in qkv())
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cu = np.array([0, 6, 14], np.int32)
  cuP = np.array([0, 8, 16], np.int32)
  with pytest.raises(ValueError, match="dtype"):
    jax_cp.cp_attention(q, k, v, (cu, cuP),
                        layout=CPLayout(mesh=mesh, backend="xla"))


@pytest.mark.parametrize("args, match", [
    (dict(q_seqlens=[-1, 8]), r"q_seqlens must be >= 0.*\[0\] = -1"),
    (dict(kv_seqlens=[6, -3]), r"kv_seqlens must be >= 0"),
    (dict(q_offsets=[-2, 8]), r"q_offsets must be >= 0"),
    (dict(kv_offsets=[0, -8]), r"kv_offsets must be >= 0"),
    (dict(q_seqlens=[9, 8], kv_seqlens=[9, 8]), r"Q rows of segments 0 and 1"
     r" overlap"),
    (dict(q_offsets=[0, 9]), r"runs past the end.*q_offsets=9"),
    (dict(kv_offsets=[0, 10]), r"runs past the end.*kv_offsets=10"),
    (dict(q_seqlens=[6.0, 8.0]), r"q_seqlens must be an integer array"),
])
def test_fused_attention_segment_rules(args, match):
  meta = dict(q_seqlens=LENS, kv_seqlens=LENS, q_offsets=OFFS,
              kv_offsets=OFFS)
  meta.update({n: np.asarray(a) for n, a in args.items()})
  with pytest.raises(ValueError, match=match):
    jax_cp.fused_attention(*qkv(), **meta, backend="xla")


def test_fused_attention_shared_kv_rows_are_allowed():
  """Two segments may read the same K/V rows (only Q rows are written)."""
  q, k, v = qkv()
  out = jax_cp.fused_attention(q, k, v, np.array([4, 4]), np.array([8, 8]),
                               np.array([0, 8]), np.array([0, 0]),
                               attn_mask_type="causal_bottom_right",
                               backend="xla")
  assert np.isfinite(np.asarray(out)).all()


def _reference(q, k, v, lens, offs):
  """Causal attention per segment, from the reference (float32)."""
  out = np.zeros(q.shape, np.float32)
  for n, o in zip(lens, offs):
    if n:
      cu = np.array([0, n])
      out[o:o + n] = np.asarray(reference.attention(
          q[o:o + n], k[o:o + n], v[o:o + n], cu, cu))
  return out


def test_traced_out_of_range_metadata_is_clamped():
  """Under jit the values cannot be checked: a segment running past the
  end is cut at the buffer's end, and a negative offset starts at 0."""
  q, k, v = qkv(seed=3)
  f = jax.jit(lambda l, o: jax_cp.fused_attention(
      q, k, v, l, l, o, o, attn_mask_type="causal_top_left", backend="xla"))
  got = np.asarray(f(np.array([6, 20], np.int32), np.array([0, 8], np.int32)))
  want = _reference(np.asarray(q), np.asarray(k), np.asarray(v), [6, 8],
                    [0, 8])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  got = np.asarray(f(np.array([5, 8], np.int32), np.array([-3, 8], np.int32)))
  want = _reference(np.asarray(q), np.asarray(k), np.asarray(v), [5, 8],
                    [0, 8])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_make_global_batch_checks_cu_seqlens():
  """Per process, the valid lengths are checked against the padded ones."""
  mesh = jax.make_mesh((2, 4), ("data", "cp"), devices=devices(8),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  cuP = np.array([[0, 32, 64], [0, 16, 64]], np.int32)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 256, (2, 64)).astype(np.int32)
  layout = CPLayout(mesh=mesh, batch_axis="data")
  good = np.array([[0, 30, 60], [0, 16, 50]], np.int32)
  batch = make_global_batch(ids, cuP, layout, cu_seqlens=good)
  np.testing.assert_array_equal(
      np.asarray(restore_from_cp(batch.tensors, cuP[0], layout,
                                 seq_dim=1))[0], ids[0])
  bad = np.array([[0, 30, 60], [0, 20, 50]], np.int32)   # 20 > 16
  with pytest.raises(ValueError, match=r"document 0 \(row 1\) has valid "
                     r"length 20 above its padded length 16"):
    make_global_batch(ids, cuP, layout, cu_seqlens=bad)
  with pytest.raises(ValueError, match="same shape"):
    make_global_batch(ids, cuP, layout, cu_seqlens=good[:, :2])


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
@pytest.mark.parametrize("docs", ["zero_or_one_token", "all_empty"])
def test_rows_of_tiny_documents(cp, strategy, docs):
  """Rows of 0/1-token documents: NO_LOAD_BALANCE's max_seqlen is 1 (no
  halo); all-empty rows give exact zeros and finite gradients."""
  rng = np.random.default_rng(cp)
  if strategy == "no_load_balance":
    n = t = 4 * cp
    plens = np.ones(n, np.int32)
  else:
    n = 3
    plens = np.full(n, 2 * cp, np.int32)
    t = int(plens.sum())
  lens = (rng.integers(0, 2, n) if docs == "zero_or_one_token"
          else np.zeros(n, np.int64))
  if docs == "zero_or_one_token":
    lens[0] = 1
  cuP = np.concatenate([[0], np.cumsum(plens)]).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  bound = longest_padded_document(cuP)
  assert bound == (1 if strategy == "no_load_balance" else 2 * cp)
  q = jnp.asarray(rng.standard_normal((t, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((t, HKV, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((t, HKV, D)), jnp.float32)
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, backend="xla", strategy=strategy,
                    max_seqlen=bound)

  def f(q, k, v):
    q, k, v = (reorder_for_cp(x, cuP, layout) for x in (q, k, v))
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return restore_from_cp(out, cuP, layout)

  def want_out(q, k, v):
    return reference.attention(q, k, v, cu, cuP)

  w = jnp.asarray(rng.standard_normal((t, HQ, D)), jnp.float32)
  out, grads = jax.jit(jax.value_and_grad(
      lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
  want, want_grads = jax.value_and_grad(
      lambda *a: jnp.sum(reference.attention(*a, cu, cuP) * w),
      argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-5)
  assert abs(float(want)) > 0 or docs == "all_empty"
  for g, gw in zip(grads, want_grads):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(g, gw, atol=1e-5, rtol=1e-5)
  if docs == "all_empty":
    assert not np.asarray(jax.jit(f)(q, k, v)).any()
  if cp == 2:     # op-by-op dispatch too (no zero-sized exchange buffers)
    np.testing.assert_allclose(f(q, k, v), want_out(q, k, v),
                               atol=1e-5, rtol=1e-5)
