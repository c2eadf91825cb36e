"""The ring exchange (``CPLayout(comm_type="ring")``): outputs and
gradients equal to the all-gather's and to plain masked attention on the
unpartitioned rows (tests/reference.py), at cp = 2, 4, 8, both
strategies, with and without a ``max_seqlen`` bound (NO_LOAD_BALANCE then
runs fewer steps), unmasked, traced metadata under the bound's fallback,
the local view; the lowered step has no all-gather and no buffer of the
whole row; the combinations it does not take raise."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention import register_backend, xla
from jax_cp.attention.backend import scratch_bound
from jax_cp.cp.exchange import choose_exchange
from jax_cp.cp.exchange import ring as ring_mod
from jax_cp.data import (
  get_batch_on_this_cp_rank,
  reorder_for_cp,
  restore_from_cp,
)
from tests import reference as ref
from tests._devices import devices
from tests.split_backend import SPLIT_XLA
from tests.test_cp_attention import (
  check_close,
  make_qkv,
  make_rows,
  mesh_for,
  reference_out_and_grads,
)

T, D = 128, 16
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP


def run(q, k, v, w, cu, cuP, *, cp, strategy, comm_type, data=1,
        max_seqlen=None, traced=False, backend="xla", **kw):
  """Output and gradients of ``sum(out * w)`` in sequence order (global
  view, one program); ``traced``: metadata as jit arguments."""
  layout = CPLayout(mesh=mesh_for(cp, data), batch_axis="data",
                    strategy=strategy, backend=backend,
                    max_seqlen=max_seqlen, comm_type=comm_type)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)

  def loss(q, k, v, w, cu_, cuP_):
    meta = (cu_, cuP_) if traced else (cu, cuP)
    out = jax_cp.cp_attention(q, k, v, meta, layout=layout, **kw)
    return jnp.sum(out.astype(jnp.float32) * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(
          re(q), re(k), re(v), re(w), jnp.asarray(cu), jnp.asarray(cuP))
  return back(out), tuple(back(g) for g in grads)


def valid_of(cu, cuP):
  return np.stack([ref.valid_token_mask(cu[i], cuP[i])
                   for i in range(cu.shape[0])])


def one_row(seed, cp, strategy):
  """``(q, k, v, w, cu, cuP)`` of one random row ``[T, H, D]`` (float32,
  4/2 heads) and its metadata."""
  cu, cuP, rng = make_rows(seed, cp, strategy, 1)
  q, k, v = (x[0] for x in make_qkv(rng, 1, 4, 2, jnp.float32))
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  return q, k, v, w, cu[0], cuP[0]


def check_equal_to_all_gather(ring, gather, tol):
  for name, a, b in zip(("out", "dq", "dk", "dv"),
                        (ring[0],) + ring[1], (gather[0],) + gather[1]):
    err = ref.rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert err < tol, f"{name}: ring vs all-gather relative error {err:.2e}"


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_matches_all_gather_and_reference(cp, strategy, dtype,
                                               record_error):
  batch = 2
  cu, cuP, rng = make_rows(cp * 11 + 3, cp, strategy, batch)
  q, k, v = make_qkv(rng, batch, 4, 2, dtype)
  w = jnp.asarray(rng.standard_normal((batch, T, 4, D)), jnp.float32)
  data = 2 if cp <= 4 else 1
  ring = run(q, k, v, w, cu, cuP, cp=cp, data=data, strategy=strategy,
             comm_type="ring")
  gather = run(q, k, v, w, cu, cuP, cp=cp, data=data, strategy=strategy,
               comm_type="all_gather")
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = valid_of(cu, cuP)
  assert ring[0].dtype == dtype
  check_close(ring[0], want, valid, dtype, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), ring[1], want_grads):
    check_close(g, gw, valid, dtype, name, record_error)
  if dtype == jnp.float32:
    check_equal_to_all_gather(ring, gather, 1e-5)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_unmasked(cp, record_error):
  cu, cuP, rng = make_rows(cp + 40, cp, DCS, 2)
  q, k, v = make_qkv(rng, 2, 4, 4, jnp.float32)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ring = run(q, k, v, w, cu, cuP, cp=cp, strategy=DCS, comm_type="ring",
             attn_mask_type="no_mask")
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w,
                                             causal=False)
  valid = valid_of(cu, cuP)
  check_close(ring[0], want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), ring[1], want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("cp, w, steps", [
    (4, 50, 3),          # NO_LOAD_BALANCE: 1 + ceil(49 / 32) steps of 4
    (8, 40, 4),          # 1 + ceil(39 / 16) of 8
    (8, 100, 8),         # reaches every predecessor
])
@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
def test_ring_with_a_bound_runs_fewer_steps(cp, w, steps, traced,
                                            record_error):
  rng = np.random.default_rng(cp * 100 + w)
  cu, cuP = ref.rows_with_longest(rng, T, w, 2, max_docs=40)
  exchange = choose_exchange(True, "cp", cp, T, w, comm_type="ring")
  assert (exchange.kind, exchange.ring_steps) == ("ring", steps)
  q, k, v = make_qkv(rng, 2, 4, 2, jnp.float32)
  wt = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ring = run(q, k, v, wt, cu, cuP, cp=cp, strategy=NLB, comm_type="ring",
             max_seqlen=w, traced=traced)
  gather = run(q, k, v, wt, cu, cuP, cp=cp, strategy=NLB,
               comm_type="all_gather")
  check_equal_to_all_gather(ring, gather, 1e-5)
  want, _ = reference_out_and_grads(q, k, v, cu, cuP, wt)
  check_close(ring[0], want, valid_of(cu, cuP), jnp.float32, "out",
              record_error)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ring_fallback_past_the_bound(strategy, record_error):
  """Traced metadata with a document longer than the bound: the in-graph
  fallback runs the unbounded ring, exact all the same."""
  cp = 4
  cu, cuP, rng = make_rows(77, cp, strategy, 2)
  assert int(np.diff(cuP).max()) > 40
  q, k, v = make_qkv(rng, 2, 4, 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ring = run(q, k, v, w, cu, cuP, cp=cp, strategy=strategy,
             comm_type="ring", max_seqlen=40, traced=True,
             backend=SPLIT_XLA)
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = valid_of(cu, cuP)
  check_close(ring[0], want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), ring[1], want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)


def test_ring_window_under_no_load_balance_takes_the_halo(record_error):
  cp, left = 4, 20
  cu, cuP, rng = make_rows(5, cp, NLB, 2)
  layout = CPLayout(cp_size=cp, strategy=NLB, comm_type="ring")
  ex = choose_exchange(True, "cp", cp, T, T, window_left=left,
                       comm_type=layout.comm_type)
  assert (ex.kind, ex.halo_tokens) == ("halo", left)
  q, k, v = make_qkv(rng, 2, 4, 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ring = run(q, k, v, w, cu, cuP, cp=cp, strategy=NLB, comm_type="ring",
             window_size=(left, 0))
  f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP, window=left)
  want = f(q, k, v)
  want_grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
      q, k, v)
  valid = valid_of(cu, cuP)
  check_close(ring[0], want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), ring[1], want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ring_local_view(strategy, record_error):
  """Inside the caller's shard_map, on this rank's chunk."""
  cp = 4
  q, k, v, w, cu, cuP = one_row(9, cp, strategy)
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = CPLayout(cp_size=cp, strategy=strategy, view="local",
                    comm_type="ring", backend="xla")

  def local(q, k, v, w):
    rank = jax.lax.axis_index("cp")
    qs, ks, vs, ws = get_batch_on_this_cp_rank(cuP, q, k, v, w,
                                               layout=layout,
                                               cp_rank=rank, seq_dim=0)
    out = jax_cp.cp_attention(qs, ks, vs, (cu, cuP), layout=layout)
    return jax.lax.psum(jnp.sum(out * ws), "cp")

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(),
                            check_vma=False))
  got = jax.grad(f, argnums=(0, 1, 2))(q, k, v, w)
  g = lambda q, k, v: jnp.sum(ref.attention(q, k, v, cu, cuP) * w)
  want = jax.grad(g, argnums=(0, 1, 2))(q, k, v)
  valid = ref.valid_token_mask(cu, cuP)
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    check_close(a, b, valid, jnp.float32, name, record_error)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ring_lowers_to_permutes_of_one_chunk(strategy):
  """No all-gather, ``cp`` K|V hops each way (one hop home for dK|dV),
  and no buffer of the step holds the whole row's tokens."""
  cp, t = 8, 1024
  rng = np.random.default_rng(1)
  cu, cuP = ref.random_layout(rng, t, cp, "mixed",
                              dual_chunk=strategy == DCS)
  layout = CPLayout(mesh=mesh_for(cp, 1), batch_axis="data",
                    strategy=strategy, backend="xla", comm_type="ring")
  q = jnp.zeros((1, t, 4, D), jnp.float32)
  k = jnp.zeros((1, t, 2, D), jnp.float32)
  meta = (jnp.asarray(cu)[None], jnp.asarray(cuP)[None])
  f = lambda q, k, v: jnp.sum(jax_cp.cp_attention(q, k, v, meta,
                                                  layout=layout))
  hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, k).compile(
      ).as_text()
  assert "all-gather" not in hlo and "reduce-scatter" not in hlo
  # forward: cp - 1 hops of K|V; backward: cp - 1 of K|V and of dK|dV,
  # then one home.
  permutes = hlo.count("collective-permute-start(") or hlo.count(
      "collective-permute(")
  assert permutes == 3 * (cp - 1) + 1, permutes
  # Each rank's buffers hold T/cp = 128 tokens: no dimension of the
  # sharded step is the row's length T.
  body = hlo.split("ENTRY")[0]
  assert f"[1,{t}," not in body and f",{t}," not in body


@pytest.mark.parametrize("strategy, window, match", [
    (DCS, (8, 0), "no window_size under strategy=dual_chunk_swap"),
    (NLB, (96, 0), "left window below"),
])
def test_ring_rejects_windows_it_does_not_take(strategy, window, match):
  cp = 4
  cu, cuP, rng = make_rows(3, cp, strategy, 1)
  q, k, v = make_qkv(rng, 1, 4, 2, jnp.float32)
  layout = CPLayout(mesh=mesh_for(cp, 1), batch_axis="data",
                    strategy=strategy, comm_type="ring")
  with pytest.raises(ValueError, match=match):
    jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout,
                        window_size=window)


def test_comm_type_is_checked():
  with pytest.raises(ValueError, match="comm_type='p2p' is not one of"):
    CPLayout(cp_size=2, comm_type="p2p")
  # The exchange does not move tokens: batches of either layout match.
  a = CPLayout(cp_size=2)
  a.check_matches(a.replace(comm_type="ring"), "the batch")


def test_ring_keeps_a_short_halo_and_skips_nothing_at_cp1():
  assert choose_exchange(True, "cp", 4, T, 20, comm_type="ring").kind == \
      "halo"                              # 19 tokens <= one chunk (32)
  assert choose_exchange(False, "cp", 1, T, None,
                         comm_type="ring").kind == "none"
  ex = choose_exchange(False, "cp", 4, T, 16, comm_type="ring")
  assert (ex.kind, ex.ring_steps) == ("ring", 4)


def ranks_on_one_device(q, k, v, w, cu, cuP, *, cp, strategy, backend,
                        max_seqlen=None, deterministic=None,
                        comm_type="ring", **kw):
  """Output and gradients of ``sum(out * w)`` for one row ``[T, H, D]``
  with the ``cp`` ranks of the ring run as a ``jax.vmap`` over the chunks
  on one device (``ppermute`` and ``axis_index`` batch over the named
  axis): the whole ring, its hops and its calls, where one GPU is all
  there is (tests/gpu/test_ring_cudnn.py); ``deterministic``: the
  layout's (tests/gpu/test_deterministic_cudnn.py); ``comm_type``: another
  exchange whose collectives batch so (the all-to-all,
  tests/gpu/test_all_to_all_cudnn.py)."""
  layout = CPLayout(cp_size=cp, strategy=strategy, view="local",
                    comm_type=comm_type, backend=backend,
                    max_seqlen=max_seqlen,
                    deterministic=deterministic)
  order = CPLayout(cp_size=cp, strategy=strategy)
  t = q.shape[0]
  chunks = lambda x: reorder_for_cp(x, cuP, order, seq_dim=0).reshape(
      (cp, t // cp) + x.shape[1:])
  back = lambda x: restore_from_cp(x.reshape((t,) + x.shape[2:]), cuP, order,
                                   seq_dim=0)

  def rank(q, k, v, w):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout, **kw)
    return jnp.sum(out.astype(jnp.float32) * w), out

  def total(q, k, v, w):
    loss, out = jax.vmap(rank, axis_name="cp")(q, k, v, w)
    return jnp.sum(loss), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      total, argnums=(0, 1, 2), has_aux=True))(
          chunks(q), chunks(k), chunks(v), chunks(w))
  return back(out), tuple(back(g) for g in grads)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ranks_on_one_device_match_the_reference(strategy, record_error):
  """The harness of the one-GPU ring test, on CPU with the xla backend."""
  cp = 4
  q, k, v, w, cu, cuP = one_row(21, cp, strategy)
  out, grads = ranks_on_one_device(q, k, v, w, cu, cuP, cp=cp,
                                   strategy=strategy, backend="xla")
  f = lambda q, k, v: ref.attention(q, k, v, cu, cuP)
  want = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
  valid = ref.valid_token_mask(cu, cuP)
  check_close(out, f(q, k, v), valid, jnp.float32, "out", record_error)
  for name, a, b in zip(("dq", "dk", "dv"), grads, want):
    check_close(a, b, valid, jnp.float32, name, record_error)


#: The xla backend with a scratch bound (registered by the test using it).
BOUNDED_XLA = "xla_scratch_bounded"


def limit_gib_for(groups, b, tl, hq, hkv, d):
  """A scratch bound (GiB) under which the ring's float32 running buffers
  (dQ, and dK|dV twice: the accumulator and the one in flight) of
  ``[b, tl]`` rows fit in ``groups`` groups of heads and no fewer."""
  need = b * tl * 4 * (hq * d + 2 * hkv * 2 * d)
  return need / groups / 2**30 * 1.001


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp, groups", [(2, 4), (4, 2), (8, 4)])
def test_ring_in_head_groups(cp, groups, strategy, monkeypatch,
                             record_error):
  """Past the scratch bound the ring runs one group of heads at a time (a
  loop whose hops carry one group's K|V); outputs and gradients stay the
  all-gather's and the reference's."""
  batch, hq, hkv = 2, 8, 4
  cu, cuP, rng = make_rows(cp * 7 + groups, cp, strategy, batch)
  q, k, v = make_qkv(rng, batch, hq, hkv, jnp.float32)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  gather = run(q, k, v, w, cu, cuP, cp=cp, strategy=strategy,
               comm_type="all_gather")
  # The xla backend with a scratch bound (the bound is the backend's).
  limit = limit_gib_for(groups, batch, T // cp, hq, hkv, D) * 2**30
  register_backend(dataclasses.replace(xla.BACKEND, name=BOUNDED_XLA,
                                       scratch_limit=limit))
  tl = T // cp
  local = (jnp.zeros((batch, tl, hq, D)), jnp.zeros((batch, tl, hkv, D)),
           jnp.zeros((batch, tl, hkv, D)))
  assert ring_mod.head_groups(*local, limit) == groups
  ring = run(q, k, v, w, cu, cuP, cp=cp, strategy=strategy,
             comm_type="ring", backend=BOUNDED_XLA)
  check_equal_to_all_gather(ring, gather, 1e-5)
  want, want_grads = reference_out_and_grads(q, k, v, cu, cuP, w)
  valid = valid_of(cu, cuP)
  check_close(ring[0], want, valid, jnp.float32, "out", record_error)
  for name, g, gw in zip(("dq", "dk", "dv"), ring[1], want_grads):
    check_close(g, gw, valid, jnp.float32, name, record_error)

  # Every K|V hop carries one group's heads (2·Hkv/groups of K and V).
  layout = CPLayout(mesh=mesh_for(cp, 1), batch_axis="data",
                    strategy=strategy, backend=BOUNDED_XLA, comm_type="ring")
  meta = (jnp.asarray(cu), jnp.asarray(cuP))
  f = lambda q, k, v: jnp.sum(jax_cp.cp_attention(q, k, v, meta,
                                                  layout=layout) * w)
  hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).as_text()
  hops = [re.findall(r"tensor<([0-9x]+)xf32>", line)[-1]
          for line in hlo.splitlines() if "collective_permute" in line]
  heads = {int(h.split("x")[2]) for h in hops}
  assert hops and heads == {2 * hkv // groups}, heads


def test_ring_head_groups_follow_the_bound():
  """One group below the bound; the fewest groups that fit above it; one
  KV head per group where none fits."""
  x = lambda h: jnp.zeros((1, 1024, h, 64), jnp.bfloat16)
  q, k = x(32), x(8)
  need = 1024 * 4 * (32 * 64 + 2 * 8 * 128)
  for gib, groups in [(need / 2**30, 1), (need / 2 / 2**30, 2),
                      (need / 3 / 2**30, 4), (need / 8 / 2**30, 8),
                      (need / 100 / 2**30, 8)]:
    assert ring_mod.head_groups(q, k, k, gib * 1.0001 * 2**30) == groups, gib
  assert ring_mod.head_groups(q, k, k, float("inf")) == 1
  # The bound is the backend's: the xla backend has none, cudnn's is the
  # resolved one (JAX_CP_CUDNN_BWD_SCRATCH_GIB).
  assert scratch_bound(xla.BACKEND) == float("inf")
