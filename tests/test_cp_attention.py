"""cp_attention forward and gradients, global and local views, against
plain masked attention on the unpartitioned rows (tests/reference.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import (
  get_batch_on_this_cp_rank,
  reorder_for_cp,
  restore_from_cp,
)
from tests import reference as ref
from tests._devices import devices
from tests.split_backend import SPLIT_XLA

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
T = 128          # tokens per row: cp=8 -> 16 local tokens
D = 16


def make_rows(seed, cp_layout, strategy, batch=2, max_docs=64):
  """Random packed rows; DUAL_CHUNK_SWAP rows padded to multiples of
  2*cp_layout."""
  rng = np.random.default_rng(seed)
  kinds = ("mixed", "many_short", "one_long")
  cus, cuPs = zip(*[ref.random_layout(
      rng, T, cp_layout, kinds[i % 3],
      dual_chunk=strategy == S.DUAL_CHUNK_SWAP, max_docs=max_docs)
      for i in range(batch)])
  return np.stack(cus), np.stack(cuPs), rng


def make_qkv(rng, batch, hq, hkv, dtype):
  q = rng.standard_normal((batch, T, hq, D))
  k = rng.standard_normal((batch, T, hkv, D))
  v = rng.standard_normal((batch, T, hkv, D))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def mesh_for(cp, data):
  devs = np.array(devices(cp * data)).reshape(data, cp)
  return jax.sharding.Mesh(devs, ("data", "cp"))


def reference_out_and_grads(q, k, v, cu, cuP, w, causal=True):
  attn = ref.batched_attention if q.ndim == 4 else ref.attention
  f = lambda q, k, v: attn(q, k, v, cu, cuP, causal)
  out = f(q, k, v)
  grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
  return out, grads


def check_close(got, want, valid, dtype, what, record):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert np.all(np.isfinite(got)), f"{what}: non-finite values"
  err = ref.rel_err(got[valid], want[valid])
  record(dtype, what, err)
  assert err < TOL[dtype], f"{what}: relative error {err:.2e}"
  # Padding tokens: exactly zero output / gradient.
  np.testing.assert_array_equal(got[~valid], 0.0, err_msg=what)


def run_global(q, k, v, cu, cuP, w, *, cp, data, strategy, backend="xla",
               max_seqlen=None, **kw):
  """Global view: reorder, jit over a (data, cp) mesh, restore."""
  layout = CPLayout(mesh=mesh_for(cp, data), cp_axis="cp", batch_axis="data",
                    strategy=strategy, backend=backend,
                    max_seqlen=max_seqlen)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)
  attn = functools.partial(jax_cp.cp_attention, layout=layout, **kw)

  def loss(q, k, v, w):
    out = attn(q, k, v, (cu, cuP))
    return jnp.sum(out.astype(jnp.float32) * w), out

  # One program for the output and the gradients (one compile).
  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(re(q), re(k), re(v), re(w))
  out = back(out)
  grads = tuple(back(g) for g in grads)
  return out, grads


@pytest.mark.sweep(fast=6)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_cp_attention_matches_reference(cp, strategy, heads, dtype,
                                        record_error):
  batch = 2
  data = 2 if cp <= 4 else 1
  cu, cuP, rng = make_rows(cp * 7 + heads[1], cp, strategy, batch)
  q, k, v = make_qkv(rng, batch, *heads, dtype)
  w = jnp.asarray(rng.standard_normal((batch, T, heads[0], D)), jnp.float32)
  out, grads = run_global(q, k, v, cu, cuP, w, cp=cp, data=data,
                          strategy=strategy)
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i])
                    for i in range(batch)])
  assert out.dtype == dtype
  check_close(out, want, valid, dtype, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(g, gw, valid, dtype, name, record_error)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4])
def test_split_bottom_right_backward_and_max_seqlen(cp, strategy,
                                                    record_error):
  """With a tight max_seqlen bound, a backend that runs bottom-right
  backward blocks as a rectangle and a top-left triangle
  (tests/split_backend.py) and the plain xla backend both give the
  reference gradients, and agree with each other (one MQA case)."""
  cu, cuP, rng = make_rows(100 + cp, cp, strategy)
  q, k, v = make_qkv(rng, 2, 4, 1, jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, T, 4, D)), jnp.float32)
  longest = int(np.diff(cuP, axis=-1).max())
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(2)])
  results = []
  for backend in ("xla", SPLIT_XLA):
    out, grads = run_global(q, k, v, cu, cuP, w, cp=cp, data=1,
                            strategy=strategy, backend=backend,
                            max_seqlen=longest)
    check_close(out, want, valid, jnp.float32, "out", record_error)
    for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
      check_close(g, gw, valid, jnp.float32, name, record_error)
    results.append((out,) + tuple(grads))
  for name, plain, split in zip(("out", "dq", "dk", "dv"), *results):
    assert ref.rel_err(split, plain) < 1e-5, name


@pytest.mark.parametrize("cp", [2, 4])
def test_dual_chunk_swap_no_mask(cp, record_error):
  cu, cuP, rng = make_rows(200 + cp, cp, S.DUAL_CHUNK_SWAP)
  q, k, v = make_qkv(rng, 2, 4, 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, T, 4, D)), jnp.float32)
  out, grads = run_global(q, k, v, cu, cuP, w, cp=cp, data=1,
                          strategy=S.DUAL_CHUNK_SWAP,
                          attn_mask_type="no_mask")
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w,
                                             causal=False)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(2)])
  check_close(out, want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_local_view_inside_user_shard_map(strategy, record_error):
  """A user's own shard_map over per-rank batches from
  get_batch_on_this_cp_rank, 3-D inputs (no batch dim)."""
  cp = 4
  cu, cuP, rng = make_rows(300, cp, strategy, batch=1)
  cu, cuP = cu[0], cuP[0]
  q, k, v = (x[0] for x in make_qkv(rng, 1, 4, 2, jnp.float32))
  w = jnp.asarray(rng.standard_normal((T, 4, D)), jnp.float32)
  layout = CPLayout(cp_size=cp, strategy=strategy, backend="xla",
                    view="local")
  per_rank = [get_batch_on_this_cp_rank(cuP, q, k, v, w, layout=layout,
                                        cp_rank=r) for r in range(cp)]
  stacked = [jnp.concatenate([p[i] for p in per_rank]) for i in range(4)]
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def local(q, k, v, w, cu, cuP):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return out, jnp.sum(out * w)[None]

  def loss(q, k, v, w):
    out, part = jax.shard_map(
        local, mesh=mesh, in_specs=(P("cp"),) * 4 + (P(), P()),
        out_specs=(P("cp"), P("cp")), check_vma=False)(
            q, k, v, w, jnp.asarray(cu), jnp.asarray(cuP))
    return jnp.sum(part), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(*stacked)
  back = lambda x: restore_from_cp(x, cuP, layout)
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = ref.valid_token_mask(cu, cuP)
  check_close(back(out), want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(back(g), gw, valid, jnp.float32, name, record_error)


def test_context_mesh_and_3d_inputs(record_error):
  """mesh=None takes the context mesh set with jax.set_mesh."""
  cp = 2
  cu, cuP, rng = make_rows(400, cp, S.DUAL_CHUNK_SWAP, batch=1)
  cu, cuP = cu[0], cuP[0]
  q, k, v = (x[0] for x in make_qkv(rng, 1, 2, 2, jnp.float32))
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp))
  layout = CPLayout(backend="xla")
  re = lambda x: reorder_for_cp(x, cuP, layout)
  with jax.set_mesh(mesh):
    out = jax.jit(lambda q, k, v: jax_cp.cp_attention(
        q, k, v, (cu, cuP), layout=layout))(re(q), re(k), re(v))
    out = np.asarray(restore_from_cp(out, cuP, layout))
  want = ref.attention(q, k, v, cu, cuP)
  valid = ref.valid_token_mask(cu, cuP)
  check_close(out, want, valid, jnp.float32, "out", record_error)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_head_axis_tensor_parallel(strategy, record_error):
  """Heads sharded over a 'tp' axis next to 'cp' (and a batch axis)."""
  cp, tp = 2, 2
  cu, cuP, rng = make_rows(500, cp, strategy)
  q, k, v = make_qkv(rng, 2, 4, 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, T, 4, D)), jnp.float32)
  devs = np.array(devices(2 * cp * tp)).reshape(2, cp, tp)
  mesh = jax.sharding.Mesh(devs, ("data", "cp", "tp"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
  layout = CPLayout(mesh=mesh, cp_axis="cp", batch_axis="data",
                    head_axis="tp", strategy=strategy, backend="xla")
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)

  def loss(q, k, v, w):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return jnp.sum(out * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(re(q), re(k), re(v), re(w))
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(2)])
  check_close(back(out), want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(back(g), gw, valid, jnp.float32, name, record_error)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("hq, kept", [(8, True), (4, False)])
def test_backward_reuses_gathered_kv_when_small(strategy, hq, kept,
                                                record_error):
  """At cp = 2 with Hkv = 2: Hq = 8 keeps the all-gathered K/V for the
  backward (they are no larger than the local Q), Hq = 4 gathers them
  again; same gradients either way."""
  cp, batch = 2, 2
  cu, cuP, rng = make_rows(31 + hq, cp, strategy, batch)
  q, k, v = make_qkv(rng, batch, hq, 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  out, grads = run_global(q, k, v, cu, cuP, w, cp=cp, data=1,
                          strategy=strategy)
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i])
                    for i in range(batch)])
  check_close(out, want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)
  layout = CPLayout(mesh=mesh_for(cp, 1), cp_axis="cp", batch_axis="data",
                    strategy=strategy, backend="xla")
  loss = lambda q, k, v: jnp.sum(jax_cp.cp_attention(
      q, k, v, (cu, cuP), layout=layout))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
  # One all-gather of K|V in the forward, one more in the backward unless
  # kept.
  assert text.count("stablehlo.all_gather") == (1 if kept else 2)
