"""The all-to-all exchanges (``comm_type="all_to_all"``, Ulysses, and
``"all_to_all+ring"``, hierarchical over ``cp_axis=(outer, inner)``):
outputs and q/k/v gradients against plain masked attention in float64 on
the unpartitioned rows (tests/reference.py, gradients written out by
hand) and against the all-gather, at cp = 2, 4, 8 and 2 x 2, 2 x 4,
4 x 2, both strategies, on rows of one long document followed by
MaxText's trailing padding (an empty slot), of many short documents and
of documents straddling chunks; GQA 4:1 and MQA (fewer K/V heads than
ranks), windows, the ``max_seqlen`` bound with traced metadata, the local
view; the lowered step moves q, k, v by all-to-all and gathers no K/V;
the combinations it does not take raise before any kernel."""

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
  longest_padded_document,
  reorder_for_cp,
  restore_from_cp,
)
from tests import reference as ref
from tests._devices import devices
from tests.test_ring import ranks_on_one_device

T, D = 128, 16
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP
MAX_DOCS = 48
TOL_OUT, TOL_GRAD = 1e-5, 1e-4


def mesh_of(shape):
  names = ("cp",) if len(shape) == 1 else ("outer", "inner")
  n = int(np.prod(shape))
  return jax.sharding.Mesh(np.array(devices(n)).reshape(shape), names)


def layout_of(shape, strategy, comm_type, **kw):
  mesh = mesh_of(shape)
  axis = mesh.axis_names[0] if len(shape) == 1 else mesh.axis_names
  return CPLayout(mesh=mesh, cp_axis=axis, strategy=strategy,
                  comm_type=comm_type, **kw)


def rows(cp, strategy, seed):
  """``(cu, cuP)`` ``[3, MAX_DOCS+1]``: one long document then trailing
  padding as an empty slot (what ``rows_from_segment_ids`` makes of
  MaxText's padding), many short documents, documents straddling
  chunks."""
  rng = np.random.default_rng(seed)
  dual = strategy is DCS
  unit = 2 * cp if dual else 1
  n = 77
  pn = -(-n // unit) * unit
  cu0 = np.full(MAX_DOCS + 1, n, np.int32)
  cuP0 = np.full(MAX_DOCS + 1, T, np.int32)
  cu0[0] = cuP0[0] = 0
  cuP0[1] = pn
  cus, cuPs = [cu0], [cuP0]
  for kind in ("many_short", "mixed"):
    cu, cuP = ref.random_layout(rng, T, cp, kind, dual_chunk=dual,
                                max_docs=MAX_DOCS)
    cus.append(cu)
    cuPs.append(cuP)
  return np.stack(cus), np.stack(cuPs), rng


def run(layout, q, k, v, w, cu, cuP, *, traced=False, **kw):
  """Output and gradients of ``sum(out * w)`` in sequence order (global
  view, one program); ``traced``: metadata as jit arguments."""
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)

  def loss(q, k, v, w, cu_, cuP_):
    meta = (cu_, cuP_) if traced else (cu, cuP)
    out = jax_cp.cp_attention(q, k, v, meta, layout=layout, **kw)
    return jnp.sum(out * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(
          re(q), re(k), re(v), re(w), jnp.asarray(cu), jnp.asarray(cuP))
  return (back(out),) + tuple(back(g) for g in grads)


def inputs(rng, hq, hkv):
  shape = lambda h: (3, T, h, D)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in (shape(hq), shape(hkv), shape(hkv), shape(hq)))


def check_reference(got, q, k, v, w, cu, cuP, window=-1):
  """Every row against the float64 reference: relative errors on valid
  tokens, exact zeros on padding tokens."""
  for i in range(cu.shape[0]):
    want = ref.attention_f64(q[i], k[i], v[i], cu[i], cuP[i], w[i],
                             window=window)
    valid = ref.valid_token_mask(cu[i], cuP[i])
    for name, a, b, tol in zip(("out", "dq", "dk", "dv"), got, want,
                               (TOL_OUT,) + (TOL_GRAD,) * 3):
      a = np.asarray(a[i], np.float64)
      assert np.all(np.isfinite(a)), f"row {i} {name}: non-finite"
      err = ref.rel_err(a[valid], b[valid])
      assert err < tol, f"row {i} {name}: relative error {err:.2e}"
      np.testing.assert_array_equal(a[~valid], 0.0,
                                    err_msg=f"row {i} {name} on padding")


CASES = [
    ("all_to_all", (2,), (8, 2)),
    ("all_to_all", (4,), (8, 2)),      # Hkv = 2 < 4 ranks: heads repeated
    ("all_to_all", (8,), (8, 1)),      # MQA
    ("all_to_all", (2, 2), (8, 2)),    # over both axes of a tuple
    ("all_to_all+ring", (2, 2), (8, 2)),
    ("all_to_all+ring", (2, 4), (8, 1)),
    ("all_to_all+ring", (4, 2), (8, 2)),
]


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("comm_type,shape,heads", CASES,
                         ids=lambda x: "x".join(map(str, x))
                         if isinstance(x, tuple) else x)
def test_matches_float64_reference(comm_type, shape, heads, strategy):
  cp = int(np.prod(shape))
  cu, cuP, rng = rows(cp, strategy, seed=cp + len(shape))
  q, k, v, w = inputs(rng, *heads)
  layout = layout_of(shape, strategy, comm_type)
  check_reference(run(layout, q, k, v, w, cu, cuP), q, k, v, w, cu, cuP)


@pytest.mark.parametrize("comm_type,shape,strategy", [
    ("all_to_all", (4,), NLB), ("all_to_all+ring", (2, 4), DCS)])
def test_equals_all_gather(comm_type, shape, strategy):
  """The same outputs and gradients as the all-gather, to float32
  rounding."""
  cp = int(np.prod(shape))
  cu, cuP, rng = rows(cp, strategy, seed=11)
  q, k, v, w = inputs(rng, 8, 2)
  got = run(layout_of(shape, strategy, comm_type), q, k, v, w, cu, cuP)
  want = run(layout_of(shape, strategy, "all_gather"), q, k, v, w, cu, cuP)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    err = ref.rel_err(a, b)
    assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("comm_type,shape,strategy", [
    ("all_to_all", (4,), DCS), ("all_to_all", (4,), NLB),
    ("all_to_all+ring", (2, 4), NLB)])
def test_sliding_window(comm_type, shape, strategy):
  window = 9
  cp = int(np.prod(shape))
  cu, cuP, rng = rows(cp, strategy, seed=5)
  q, k, v, w = inputs(rng, 8, 2)
  got = run(layout_of(shape, strategy, comm_type), q, k, v, w, cu, cuP,
            window_size=(window, 0))
  check_reference(got, q, k, v, w, cu, cuP, window=window)


@pytest.mark.parametrize("comm_type,shape,strategy", [
    ("all_to_all", (8,), DCS), ("all_to_all", (4,), NLB),
    ("all_to_all+ring", (2, 2), NLB)])
def test_max_seqlen_bound_with_traced_metadata(comm_type, shape, strategy):
  """A tight ``max_seqlen`` (the rows' longest document) with the
  metadata as jit arguments: the bound's in-graph check passes and the
  bounded program is exact."""
  cp = int(np.prod(shape))
  cu, cuP, rng = rows(cp, strategy, seed=7)
  q, k, v, w = inputs(rng, 8, 2)
  bound = int(longest_padded_document(cuP, cu_seqlens=cu))
  assert bound < T
  layout = layout_of(shape, strategy, comm_type, max_seqlen=bound)
  check_reference(run(layout, q, k, v, w, cu, cuP, traced=True),
                  q, k, v, w, cu, cuP)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_local_view(strategy):
  """Inside a user's ``shard_map`` over per-rank chunks
  (``get_batch_on_this_cp_rank``), hierarchical over two axes."""
  shape = (2, 2)
  mesh = mesh_of(shape)
  layout = CPLayout(cp_axis=("outer", "inner"), strategy=strategy,
                    comm_type="all_to_all+ring", view="local", cp_size=4)
  cu, cuP, rng = rows(4, strategy, seed=3)
  q, k, v, w = inputs(rng, 4, 2)

  def per_rank(q, k, v):
    rank = jax.lax.axis_index(("outer", "inner"))
    local = get_batch_on_this_cp_rank(cuP, q, k, v, layout=layout,
                                      cp_rank=rank, seq_dim=1)
    out = jax_cp.cp_attention(*local, (cu, cuP), layout=layout)
    return out[None]

  out = jax.jit(jax.shard_map(
      per_rank, mesh=mesh, in_specs=P(), out_specs=P(("outer", "inner")),
      check_vma=False))(q, k, v)
  glob = layout.replace(view="global", mesh=mesh)
  # Rank r's chunk is chunk r of the global view's reordered rows.
  out = jnp.concatenate(list(out), axis=1)
  out = restore_from_cp(out, cuP, glob, seq_dim=1)
  for i in range(3):
    want = ref.attention_f64(q[i], k[i], v[i], cu[i], cuP[i], w[i])[0]
    valid = ref.valid_token_mask(cu[i], cuP[i])
    err = ref.rel_err(np.asarray(out[i])[valid], want[valid])
    assert err < TOL_OUT, f"row {i}: relative error {err:.2e}"


@pytest.mark.parametrize("comm_type,shape", [("all_to_all", (4,)),
                                             ("all_to_all+ring", (2, 2))])
def test_lowered_step_moves_heads_not_rows(comm_type, shape):
  """Forward and backward exchange q, k, v and the output by all-to-all;
  no K/V all-gather (the ring's permutes only between outer ranks)."""
  layout = layout_of(shape, DCS, comm_type)
  cu, cuP, rng = rows(int(np.prod(shape)), DCS, seed=1)
  q, k, v, w = inputs(rng, 8, 2)

  def loss(q, k, v):
    return jnp.sum(jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
                   * w)

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
      q, k, v).as_text()
  assert text.count("all_to_all") >= 4, "expected the all-to-alls both ways"
  assert "all_gather" not in text
  assert ("collective_permute" in text) == (comm_type == "all_to_all+ring")


def test_bad_combinations_raise():
  with pytest.raises(ValueError, match="cp_axis=\\(outer, inner\\)"):
    CPLayout(mesh=mesh_of((4,)), cp_axis="cp", comm_type="all_to_all+ring")
  cu, cuP, rng = rows(4, DCS, seed=2)
  meta = (cu, cuP)
  layout = layout_of((4,), DCS, "all_to_all")
  x = lambda h: jnp.ones((3, T, h, D), jnp.float32)
  with pytest.raises(ValueError, match="q has 6 heads"):
    jax_cp.cp_attention(x(6), x(2), x(2), meta, layout=layout)
  with pytest.raises(ValueError, match="K/V heads \\(3"):
    jax_cp.cp_attention(x(12), x(3), x(3), meta, layout=layout)
  # The ring after the all-to-all takes no window under DUAL_CHUNK_SWAP.
  hier = layout_of((2, 2), DCS, "all_to_all+ring")
  with pytest.raises(ValueError, match="window_size"):
    jax_cp.cp_attention(x(8), x(2), x(2), meta, layout=hier,
                        window_size=(8, 0))


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ranks_on_one_device_match_the_reference(strategy):
  """The harness of the one-GPU all-to-all test
  (tests/gpu/test_all_to_all_cudnn.py): the ranks as a ``jax.vmap``, on
  CPU with the xla backend."""
  cu, cuP, rng = rows(8, strategy, seed=13)
  q, k, v, w = (x[2] for x in inputs(rng, 8, 2))
  got = ranks_on_one_device(q, k, v, w, cu[2], cuP[2], cp=8,
                            strategy=strategy, backend="xla",
                            comm_type="all_to_all")
  check_reference(tuple(x[None] for x in (got[0],) + got[1]), q[None],
                  k[None], v[None], w[None], cu[2:], cuP[2:])
