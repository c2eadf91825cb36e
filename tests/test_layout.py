"""jax_cp.CPLayout and CPBatch: built and validated once, frozen and
hashable; every layout function takes it; one layout object partitions and
attends consistently, in the global and the local view (checked against
the reference); a mismatch attempt through the public API raises."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPBatch, CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import (
  get_batch_on_this_cp_rank,
  get_partition_indices,
  get_position_ids,
  make_global_batch,
  make_global_metadata,
  reorder_for_cp,
  restore_from_cp,
)
from jax_cp.planning import estimate_cp_imbalance
from tests import reference as ref
from tests._devices import devices

CP, DP = 4, 2
B, T, H, D = 2, 64, 2, 8
CU_P = np.array([[0, 16, 48, 64, 64], [0, 24, 32, 64, 64]], np.int32)
CU = np.array([[0, 13, 40, 50, 50], [0, 20, 25, 56, 56]], np.int32)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP))


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  return tuple(rng.standard_normal((B, T, H, D)).astype(np.float32)
               for _ in range(3))


# ------------------------------------------------------------ the object


def test_layout_is_normalised_frozen_and_hashable(mesh):
  a = CPLayout(strategy="NO_LOAD_BALANCE", batch_axis=["data"], mesh=mesh)
  b = CPLayout(strategy=S.NO_LOAD_BALANCE, batch_axis="data", mesh=mesh)
  assert a == b and hash(a) == hash(b)
  assert a.strategy is S.NO_LOAD_BALANCE and a.batch_axis == "data"
  assert a.cp_size == CP                       # read from the mesh
  with pytest.raises(AttributeError):
    a.strategy = S.DUAL_CHUNK_SWAP             # frozen
  assert a.replace(strategy="dual_chunk_swap").strategy is S.DUAL_CHUNK_SWAP
  assert CPLayout(cp_axis=None).cp_size == 1

  traces = []

  @functools.partial(jax.jit, static_argnums=1)
  def f(x, layout):
    traces.append(layout)
    return x + layout.cp_size
  f(1.0, a)
  f(2.0, b)                                    # equal layout: one trace
  assert len(traces) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="ring"), "strategy='ring'"),
    (dict(view="sideways"), "view='sideways'"),
    (dict(max_seqlen=0), "max_seqlen"),
    (dict(cp_size=0), "cp_size"),
    (dict(cp_axis=None, cp_size=2), "cp_size=2 needs a cp_axis"),
    (dict(cp_axis=3), "cp_axis must be a mesh axis name"),
    (dict(batch_axis=("data", 1)), "batch_axis"),
])
def test_bad_settings_raise_when_built(kwargs, match):
  with pytest.raises(ValueError, match=match):
    CPLayout(**kwargs)


def test_settings_checked_against_the_mesh(mesh):
  with pytest.raises(ValueError, match="cp_axis='seq' is not an axis"):
    CPLayout(cp_axis="seq", mesh=mesh)
  with pytest.raises(ValueError, match="batch_axis='dp' is not an axis"):
    CPLayout(batch_axis="dp", mesh=mesh)
  with pytest.raises(ValueError, match="cp_size=2 disagrees with the mesh"):
    CPLayout(cp_size=2, mesh=mesh)


# ------------------------------------------------------------ data functions


@pytest.mark.parametrize("strategy", list(S))
def test_data_functions_take_the_layout(strategy):
  """A rank's tokens are those of its partition indices; the ranks' chunks
  side by side are the reordered row, which restores to the row."""
  layout = CPLayout(cp_size=CP, strategy=strategy)
  x = np.arange(B * T).reshape(B, T)
  chunks = []
  for r in range(CP):
    (chunk,) = get_batch_on_this_cp_rank(CU_P, x, cp_rank=r, layout=layout,
                                         seq_dim=1)
    idx = get_partition_indices(CU_P, layout, r)
    np.testing.assert_array_equal(chunk, np.take_along_axis(x, idx, axis=1))
    chunks.append(chunk)
  xr = reorder_for_cp(x, CU_P, layout, seq_dim=1)
  np.testing.assert_array_equal(xr, np.concatenate(chunks, axis=1))
  np.testing.assert_array_equal(restore_from_cp(xr, CU_P, layout, seq_dim=1),
                                x)

  # Positions in the layout: the physical ones, reordered (global view) or
  # sliced for a rank (local view).
  pos = get_position_ids(CU_P)
  np.testing.assert_array_equal(
      get_position_ids(CU_P, layout=layout),
      reorder_for_cp(pos, CU_P, layout, seq_dim=1))
  local = layout.replace(view="local")
  np.testing.assert_array_equal(
      get_position_ids(CU_P, layout=local, cp_rank=1),
      get_batch_on_this_cp_rank(CU_P, pos, cp_rank=1, layout=layout,
                                seq_dim=1)[0])


def test_cost_model_and_metadata_take_the_layout(mesh):
  """The cost model reads the cp size of a layout from its mesh (the same
  estimate as with ``cp_size``); the metadata are placed on its batch
  axis."""
  layout = CPLayout(mesh=mesh, strategy="no_load_balance", batch_axis="data",
                    max_seqlen=40)
  on_mesh = estimate_cp_imbalance(CU, CU_P, layout)
  by_size = estimate_cp_imbalance(CU, CU_P, CPLayout(
      cp_size=CP, strategy="no_load_balance", max_seqlen=40))
  assert on_mesh == by_size
  cu = make_global_metadata(CU, layout)
  np.testing.assert_array_equal(cu, CU)
  assert cu.sharding.spec == P("data")


# ------------------------------------------------------------ one layout


@pytest.mark.parametrize("strategy", list(S))
def test_one_layout_partitions_and_attends(mesh, qkv, strategy):
  """Global view: make_global_batch and cp_attention with the same layout
  object give the reference attention."""
  layout = CPLayout(mesh=mesh, strategy=strategy, batch_axis="data",
                    backend="xla")
  q, k, v = qkv
  batch = make_global_batch(dict(q=q, k=k, v=v), CU_P, layout, cu_seqlens=CU)
  assert batch.layout is layout
  with jax.set_mesh(mesh):
    out = jax.jit(lambda b: jax_cp.cp_attention(
        b.tensors["q"], b.tensors["k"], b.tensors["v"], b))(batch)
  got = restore_from_cp(np.asarray(out), CU_P, layout, seq_dim=1)
  want = ref.batched_attention(q, k, v, CU, CU_P)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("strategy", list(S))
def test_one_layout_local_view(mesh, qkv, strategy):
  """Local view: get_batch_on_this_cp_rank and cp_attention with the same
  layout of view "local" (the rank read from the shard_map) give the
  reference."""
  layout = CPLayout(strategy=strategy, view="local", backend="xla")
  q, k, v = qkv

  def body(q, k, v, cu, cuP):
    ql, kl, vl = get_batch_on_this_cp_rank(cuP, q, k, v, layout=layout,
                                           seq_dim=1)
    return jax_cp.cp_attention(ql, kl, vl, (cu, cuP), layout=layout)

  spec = P("data")
  args = [jax.device_put(a, NamedSharding(mesh, spec))
          for a in (q, k, v, CU, CU_P)]
  out = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(spec,) * 5, out_specs=P("data", "cp"),
      check_vma=False))(*args)
  # The ranks' chunks side by side: the rows in the layout's order.
  got = restore_from_cp(np.asarray(out), CU_P, layout.replace(cp_size=CP),
                        seq_dim=1)
  want = ref.batched_attention(q, k, v, CU, CU_P)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------ mismatches


def test_attention_rejects_a_batch_of_another_layout(mesh, qkv):
  """The issue's mismatch, data in DUAL_CHUNK_SWAP attended with
  NO_LOAD_BALANCE, through every public entry point that sees the batch."""
  made = CPLayout(mesh=mesh, batch_axis="data", backend="xla")
  q, k, v = qkv
  batch = make_global_batch(dict(q=q, k=k, v=v), CU_P, made, cu_seqlens=CU)
  other = made.replace(strategy="no_load_balance")
  t = batch.tensors
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match="strategy: no_load_balance here, dual_chunk_swap "
      "in the data"):
    jax_cp.cp_attention(t["q"], t["k"], t["v"], batch, layout=other)

  local = CPLayout(strategy="no_load_balance", view="local", backend="xla")

  def body(q, k, v, b):
    return jax_cp.cp_attention(q, k, v, b, layout=local)

  spec = P("data", "cp")
  with pytest.raises(ValueError, match="another CPLayout"):
    jax.eval_shape(jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, spec, P("data")),
        out_specs=spec, check_vma=False), t["q"], t["k"], t["v"],
        CPBatch(None, batch.cu_seqlens_padded, batch.cu_seqlens,
                layout=made))

  # Same strategy, another cp size: also a different layout of the tokens.
  with pytest.raises(ValueError, match="cp_size: 2 here, 4 in the data"):
    made.replace(mesh=None, cp_size=2).check_matches(made, "the batch")
  # The layout's backend or bound may differ: the tokens sit alike.
  made.replace(backend="auto", max_seqlen=64).check_matches(made, "the batch")


def test_batch_is_a_pytree(mesh):
  layout = CPLayout(mesh=mesh, batch_axis="data")
  batch = make_global_batch(np.zeros((B, T), np.int32), CU_P, layout)
  assert batch.tensors.shape == (B, T)
  assert batch.cu_seqlens_padded.shape == CU_P.shape
  assert batch.cu_seqlens is None
  leaves, treedef = jax.tree.flatten(batch)
  assert len(leaves) == 2
  assert jax.tree.unflatten(treedef, leaves).layout is layout
  doubled = jax.tree.map(lambda a: a * 2, batch)
  assert doubled.layout is layout
  np.testing.assert_array_equal(doubled.cu_seqlens_padded, 2 * CU_P)
  with pytest.raises(ValueError, match="has no cu_seqlens"):
    jax_cp.cp_attention(jnp.zeros((B, T, H, D)), jnp.zeros((B, T, H, D)),
                        jnp.zeros((B, T, H, D)), batch)


def test_shard_tokens_pins_the_token_axis(mesh):
  """Global view: the token axis stays on cp and the batch axis on data
  (features left to XLA), with the layout's mesh or the context mesh; no
  CP, or the local view: ``x`` unchanged."""
  x = jnp.arange(2 * 16 * 6, dtype=jnp.float32).reshape(2, 16, 6)
  explicit = CPLayout(mesh=mesh, cp_axis="cp", batch_axis="data")
  assert explicit.shard_tokens(x) is x   # sharding is in the types there
  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  layout = CPLayout(mesh=mesh, cp_axis="cp", batch_axis="data")
  f = jax.jit(lambda x: layout.shard_tokens(x) * 2)
  y = f(x)
  np.testing.assert_array_equal(y, 2 * x)
  assert y.sharding.spec[:2] == ("data", "cp")
  text = f.lower(x).as_text()
  assert "sharding_constraint" in text or "mhlo.sharding" in text
  row = jax.jit(lambda x: layout.shard_tokens(x))(x[0])
  assert row.sharding.spec[:1] == ("cp",)
  ctx = CPLayout(cp_axis="cp", batch_axis="data")
  with jax.set_mesh(mesh):
    z = jax.jit(lambda x: ctx.shard_tokens(x) + 1)(x)
  assert z.sharding.spec[:2] == ("data", "cp")
  for plain in (CPLayout(cp_axis=None), CPLayout(cp_axis="cp", view="local",
                                                 mesh=mesh)):
    assert plain.shard_tokens(x) is x
  with pytest.raises(ValueError, match="needs a mesh"):
    ctx.shard_tokens(x)


def test_shard_tokens_token_axis_of_heads_arrays():
  """``[B, T, H, D]``: the token axis is axis 1 (the heads are left to
  XLA); an unbatched ``[T, H, D]`` takes ``seq_dim=0``; an axis that is
  not one raises."""
  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  layout = CPLayout(mesh=mesh, cp_axis="cp", batch_axis="data")
  x = jnp.zeros((2, 16, 4, 8), jnp.float32)
  y = jax.jit(layout.shard_tokens)(x)
  assert y.sharding.spec[:2] == ("data", "cp")
  row = jax.jit(lambda x: layout.shard_tokens(x, seq_dim=0))(x[0])
  assert row.sharding.spec[:1] == ("cp",)
  with pytest.raises(ValueError, match="seq_dim=3 is not an axis"):
    layout.shard_tokens(x[0], seq_dim=3)


def test_cp_axis_of_two_mesh_axes():
  """``cp_axis=(outer, inner)``: the cp size is the product of the two
  axes' sizes; a repeated name, or a name not on the mesh, raises."""
  mesh = jax.sharding.Mesh(np.array(devices(8)).reshape(2, 4),
                           ("outer", "inner"))
  layout = CPLayout(mesh=mesh, cp_axis=("outer", "inner"))
  assert layout.cp_axes == ("outer", "inner") and layout.cp_size == 8
  assert layout.resolve_axis_sizes() == (2, 4)
  assert CPLayout(mesh=mesh, cp_axis=["inner"]).cp_axis == "inner"
  with pytest.raises(ValueError, match="distinct"):
    CPLayout(cp_axis=("outer", "outer"))
  with pytest.raises(ValueError, match="cp_axis"):
    CPLayout(mesh=mesh, cp_axis=("outer", "tp"))
