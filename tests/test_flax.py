"""jax_cp.flax: the layout propagates from the outer module to cp_attention;
with CP (both strategies, global and local view) a 2-layer model gives the
loss and gradients of the same model without CP; bad input raises early."""

import dataclasses
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.cp import api as cp_api
from jax_cp.flax import (
  DotProductAttention,
  MultiHeadAttention,
  TransformerLayer,
)
from jax_cp.modules import inputs
from jax_cp.modules.inputs import default_position_ids
from jax_cp.modules.settings import strategy_from_code
from tests import reference as ref
from tests._devices import devices

CP, DP = 4, 2
B, T, E = 2, 64, 16
# Padded lengths are multiples of 2*CP (DUAL_CHUNK_SWAP); row 1 ends with an
# empty slot. Documents straddle the NO_LOAD_BALANCE chunk borders.
CU_P = np.array([[0, 16, 48, 64, 64], [0, 24, 32, 64, 64]], np.int32)
CU = np.array([[0, 13, 40, 50, 50], [0, 20, 25, 56, 56]], np.int32)
LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)


def _layout(**kwargs):
  return CPLayout(backend="xla", **kwargs)


NO_CP = _layout(cp_axis=None)


class Stack(nn.Module):
  """Two TransformerLayers; the layout given once, on this module."""

  layer_kwargs: dict

  @nn.compact
  def __call__(self, x, cu, cuP, pos):
    for i in range(2):
      x = TransformerLayer(**self.layer_kwargs, name=f"layer_{i}")(
          x, cu, cuP, pos)
    return x


def _valid_mask():
  t = np.arange(T)
  m = np.zeros((B, T), np.float32)
  for r in range(B):
    for b in range(CU.shape[1] - 1):
      s, n = CU_P[r, b], CU[r, b + 1] - CU[r, b]
      m[r, (t >= s) & (t < s + n)] = 1.0
  return m


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, T, E)).astype(np.float32)
  w = rng.standard_normal((B, T, E)).astype(np.float32)
  w *= _valid_mask()[..., None]        # padding tokens do not count
  return dict(x=x, w=w, pos=np.asarray(jax_cp.data.get_position_ids(CU_P)))


@pytest.fixture(scope="module")
def baseline(data):
  """Params, loss and gradients without CP (cp_axis=None), one device."""
  model = Stack(dict(LAYER, layout=NO_CP))
  # Random values for every parameter (norm scales included): no init to
  # compile, and a less symmetric test than the initializers' values.
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), data["x"],
                                             CU, CU_P, data["pos"]))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: (1.0 + 0.3 * rng.standard_normal(
      s.shape)).astype(s.dtype) if len(s.shape) == 1 else (
          rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(
              s.dtype), shapes)

  def loss(p):
    return jnp.sum(model.apply(p, data["x"], CU, CU_P, data["pos"])
                   * data["w"])

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return params, float(value), jax.device_get(grads)


def _assert_close(loss, grads, baseline, rtol=1e-4):
  _, ref_loss, ref_grads = baseline
  assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
  flat, _ = jax.tree_util.tree_flatten_with_path(ref_grads)
  got = jax.tree.leaves(jax.device_get(grads))
  for (path, want), g in zip(flat, got):
    err = np.abs(np.asarray(g) - want).max()
    assert err <= rtol * np.abs(want).max() + 1e-7, (
        jax.tree_util.keystr(path), err, np.abs(want).max())


def _mesh(axis_types):
  types = (AxisType.Auto,) * 2 if axis_types == "auto" else None
  return jax.make_mesh((DP, CP), ("data", "cp"), axis_types=types,
                       devices=devices(DP * CP))


def _reordered(a, strategy):
  return np.asarray(jax_cp.data.reorder_for_cp(
      a, CU_P, CPLayout(cp_size=CP, strategy=strategy), seq_dim=1))


# ------------------------------------------------------------ propagation


def _spy(module, name):
  return mock.patch.object(module, name, wraps=getattr(module, name))


def _spy_attention():
  """The modules' call of jax_cp.cp_attention."""
  return _spy(inputs, "cp_attention")


def _trace(model, mesh, *args):
  """Traces init (no compilation) under the mesh."""
  with jax.set_mesh(mesh):
    jax.eval_shape(lambda: model.init(jax.random.key(0), *args))


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy", [S.NO_LOAD_BALANCE, "no_load_balance",
                                      "DUAL_CHUNK_SWAP", None])
def test_outer_layout_reaches_cp_attention(data, strategy):
  mesh = _mesh("explicit")
  kwargs = dict(batch_axis="data", max_seqlen=32)
  if strategy is not None:
    kwargs["strategy"] = strategy
  layout = _layout(**kwargs)
  with _spy_attention() as spy:
    _trace(Stack(dict(LAYER, layout=layout)), mesh, data["x"], CU, CU_P,
           data["pos"])
  assert spy.call_count == 2                    # one per layer
  for call in spy.call_args_list:
    # The outer module's layout object itself, with every setting in it.
    assert call.kwargs["layout"] is layout
  want = S.DUAL_CHUNK_SWAP if strategy is None else S(strategy)
  assert layout.strategy is want


def test_no_cp_attends_whole_rows_without_a_mesh(data):
  """Without CP the layer's attention runs the per-rank attention on the
  whole rows directly: no mesh, no shard_map."""
  layer = TransformerLayer(**LAYER, layout=NO_CP)
  with _spy(cp_api, "run_local") as local, _spy_attention() as spy:
    jax.eval_shape(lambda: layer.init(jax.random.key(0), data["x"], CU,
                                      CU_P, data["pos"]))
  assert spy.call_args.kwargs["layout"] is NO_CP
  assert local.call_count == 1
  assert local.call_args.args[0].cp_size == 1


def test_children_receive_the_layout():
  mesh = _mesh("auto")
  layout = _layout(strategy="no_load_balance", max_seqlen=32, mesh=mesh,
                   batch_axis="data")
  mha = MultiHeadAttention(num_heads=2, layout=layout)
  x = jnp.zeros((B, T, E))
  with _spy_attention() as spy:
    jax.eval_shape(lambda: mha.init(jax.random.key(0), x, CU, CU_P))
  assert spy.call_args.kwargs["layout"] is layout
  assert layout.mesh is mesh and layout.cp_size == CP


def test_gqa_head_shapes():
  x = jnp.zeros((B, T, E))
  mha = MultiHeadAttention(num_heads=2, num_kv_heads=1, head_dim=8,
                           layout=NO_CP)
  shapes = jax.eval_shape(
      lambda: mha.init(jax.random.key(0), x, CU, CU_P))["params"]
  assert shapes["query"]["kernel"].shape == (E, 2, 8)
  assert shapes["key"]["kernel"].shape == (E, 1, 8)
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    MultiHeadAttention(num_heads=2, num_kv_heads=3)


def test_no_cp_attention_matches_reference():
  rng = np.random.default_rng(1)
  q = rng.standard_normal((B, T, 4, 8)).astype(np.float32)
  k = rng.standard_normal((B, T, 2, 8)).astype(np.float32)
  v = rng.standard_normal((B, T, 2, 8)).astype(np.float32)
  dpa = DotProductAttention(layout=NO_CP)
  out = jax.jit(lambda q, k, v: dpa.apply({}, q, k, v, CU, CU_P))(q, k, v)
  want = ref.batched_attention(q, k, v, CU, CU_P)
  np.testing.assert_allclose(out, want, atol=1e-5)


# ------------------------------------------------------------ equivalence


@pytest.mark.parametrize("strategy, axis_types", [
    (S.DUAL_CHUNK_SWAP, "explicit"), (S.NO_LOAD_BALANCE, "auto")])
def test_global_view_matches_no_cp(data, baseline, strategy, axis_types):
  mesh = _mesh(axis_types)
  model = Stack(dict(LAYER, layout=_layout(strategy=strategy.value,
                                            batch_axis="data", mesh=mesh)))
  tok = NamedSharding(mesh, P("data", "cp"))
  feat = NamedSharding(mesh, P("data", "cp", None))
  meta = NamedSharding(mesh, P("data", None))

  def loss(p, x, w, cu, cuP, pos):
    y, state = model.apply(p, x, cu, cuP, pos, mutable=["intermediates"])
    return jnp.sum(y * w), state["intermediates"]

  with jax.set_mesh(mesh):
    args = [jax.device_put(_reordered(data["x"], strategy), feat),
            jax.device_put(_reordered(data["w"], strategy), feat),
            jax.device_put(CU, meta), jax.device_put(CU_P, meta),
            jax.device_put(_reordered(data["pos"], strategy), tok)]
    (value, inter), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        baseline[0], *args)
  _assert_close(float(value), grads, baseline)
  codes = jax.tree.leaves(inter)
  assert len(codes) == 2
  assert all(strategy_from_code(c) is strategy for c in codes)


def test_local_view_in_shard_map_matches_no_cp(data, baseline):
  strategy = S.DUAL_CHUNK_SWAP
  mesh = _mesh("explicit")
  model = Stack(dict(LAYER, layout=_layout(view="local")))
  tok, feat = P("data", "cp"), P("data", "cp", None)
  meta = P("data", None)

  def body(p, x, w, cu, cuP, pos):
    def local_loss(p):
      return jnp.sum(model.apply(p, x, cu, cuP, pos) * w)
    # This rank's loss; its gradient already holds what the other ranks'
    # losses send back through K/V (the reduce-scatter of the backward).
    value, grads = jax.value_and_grad(local_loss)(p)
    axes = ("data", "cp")
    return jax.lax.psum(value, axes), jax.lax.psum(grads, axes)

  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), feat, feat, meta, meta, tok),
      out_specs=(P(), P()), check_vma=False))
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in (
        (_reordered(data["x"], strategy), feat),
        (_reordered(data["w"], strategy), feat),
        (CU, meta), (CU_P, meta), (_reordered(data["pos"], strategy), tok))]
    value, grads = step(baseline[0], *args)
  _assert_close(float(value), grads, baseline)


@pytest.mark.parametrize("strategy", list(S))
def test_default_position_ids(data, strategy):
  """Without position_ids, the modules derive them from the metadata in
  their own layout: reordered (global view) or sliced (local view)."""
  glob = _layout(strategy=strategy)
  got = default_position_ids(glob, CU_P, T, CP)
  np.testing.assert_array_equal(got, _reordered(data["pos"], strategy))

  local = _layout(strategy=strategy, view="local")
  mesh = jax.make_mesh((CP,), ("cp",), axis_types=(AxisType.Auto,),
                       devices=devices(CP))
  per_rank = jax.jit(jax.shard_map(
      lambda cuP: default_position_ids(local, cuP, T // CP, CP), mesh=mesh,
      in_specs=P(), out_specs=P(None, "cp"), check_vma=False))(CU_P)
  np.testing.assert_array_equal(per_rank, _reordered(data["pos"], strategy))


# ------------------------------------------------------------ bad input


def test_token_count_must_match_cu_seqlens_padded(data):
  mesh = _mesh("explicit")
  x = data["x"][:, :56]                       # 56 tokens, cuP[-1] == 64
  layer = TransformerLayer(**LAYER, layout=_layout(mesh=mesh))
  with pytest.raises(ValueError, match="cu_seqlens_padded"):
    layer.init(jax.random.key(0), x, CU, CU_P, data["pos"][:, :56])
  with pytest.raises(ValueError, match="cu_seqlens_padded"):
    TransformerLayer(**LAYER, layout=NO_CP).init(jax.random.key(0), x, CU,
                                                 CU_P)

  # Local view: T_local * cp must equal cuP[-1] (checked when the metadata
  # is concrete, here closed over as numpy).
  local = TransformerLayer(**LAYER, layout=_layout(view="local"))

  def body(x):
    return local.init(jax.random.key(0), x, CU, CU_P)

  x_local = jax.device_put(jnp.zeros((B, 4 * 12, E)),
                           NamedSharding(mesh, P("data", "cp", None)))
  with jax.set_mesh(mesh), pytest.raises(ValueError,
                                         match="cu_seqlens_padded"):
    jax.eval_shape(jax.shard_map(body, mesh=mesh,
                                 in_specs=P("data", "cp", None),
                                 out_specs=P(), check_vma=False), x_local)


def test_cp_axis_missing_from_mesh(data):
  mesh = _mesh("explicit")
  with pytest.raises(ValueError, match="cp_axis='context'"):
    _layout(cp_axis="context", mesh=mesh)
  # Context mesh (no mesh in the layout) too, and the local view outside a
  # shard_map.
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="cp_axis"):
    jax.eval_shape(lambda: TransformerLayer(
        **LAYER, layout=_layout(cp_axis="context")).init(
            jax.random.key(0), data["x"], CU, CU_P))
  with pytest.raises(ValueError, match="cp_axis"):
    TransformerLayer(**LAYER, layout=_layout(view="local")).init(
        jax.random.key(0), data["x"], CU, CU_P)
  with pytest.raises(ValueError, match="batch_axis"):
    _layout(batch_axis="dp", mesh=mesh)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="batch_axis"):
    jax.eval_shape(lambda: TransformerLayer(
        **LAYER, layout=_layout(batch_axis="dp")).init(
            jax.random.key(0), data["x"], CU, CU_P))


@pytest.mark.parametrize("cls", [DotProductAttention, MultiHeadAttention,
                                 TransformerLayer])
def test_layout_field_is_checked(cls):
  kwargs = {} if cls is DotProductAttention else dict(num_heads=2)
  with pytest.raises(ValueError, match="strategy='round_robin'"):
    cls(**kwargs, layout=_layout(strategy="round_robin"))
  with pytest.raises(ValueError, match="layout must be a jax_cp.CPLayout"):
    cls(**kwargs, layout="dual_chunk_swap")


def test_module_rejects_a_batch_of_another_layout(data):
  """A CPBatch laid out with one strategy, given to a module with the
  other, raises before any kernel."""
  mesh = _mesh("explicit")
  made = _layout(mesh=mesh, batch_axis="data")
  batch = jax_cp.data.make_global_batch(dict(x=data["x"]), CU_P, made,
                                        cu_seqlens=CU)
  other = TransformerLayer(**LAYER, layout=made.replace(
      strategy="no_load_balance"))
  with jax.set_mesh(mesh), pytest.raises(ValueError,
                                         match="another CPLayout"):
    jax.eval_shape(lambda: other.init(jax.random.key(0),
                                      batch.tensors["x"], batch))
  same = TransformerLayer(**LAYER, layout=made)
  with jax.set_mesh(mesh):
    out = jax.eval_shape(lambda: same.init_with_output(
        jax.random.key(0), batch.tensors["x"], batch)[0])
  assert out.shape == (B, T, E)


def test_context_mesh_global_view(data):
  """A layout without a mesh takes the mesh of `jax.set_mesh`."""
  mesh = _mesh("explicit")
  layout = _layout(batch_axis="data")
  layer = TransformerLayer(**LAYER, layout=layout)
  x = jax.device_put(_reordered(data["x"], S.DUAL_CHUNK_SWAP),
                     NamedSharding(mesh, P("data", "cp", None)))
  with _spy_attention() as spy, jax.set_mesh(mesh):
    out = jax.eval_shape(lambda x: layer.init_with_output(
        jax.random.key(0), x, CU, CU_P)[0], x)
  assert out.shape == (B, T, E)
  assert spy.call_args.kwargs["layout"].mesh is None


def test_every_module_has_one_layout_field():
  cp_names = {"cp_axis", "cp_strategy", "cp_comm_type", "attn_backend",
              "max_seqlen", "mesh", "batch_axis", "local_view"}
  for cls in (DotProductAttention, MultiHeadAttention, TransformerLayer):
    names = {f.name for f in dataclasses.fields(cls)}
    assert "layout" in names and not names & cp_names, cls.__name__
