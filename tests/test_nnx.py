"""jax_cp.nnx: the NNX modules compute what the Linen ones compute on the
same parameters (forward and gradients, float32, to 1e-6); with CP (cp=4,
both strategies, both K/V exchanges, global view under nnx.jit and local
view in shard_map) they give the loss and gradients of the same model
without CP; the layout is static configuration; parameters convert to and
from Linen and survive an orbax checkpoint."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from tests._devices import devices

CP, DP = 4, 2
B, T, E = 2, 64, 16
CU_P = np.array([[0, 16, 48, 64, 64], [0, 24, 32, 64, 64]], np.int32)
CU = np.array([[0, 13, 40, 50, 50], [0, 20, 25, 56, 56]], np.int32)
LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
NO_CP = CPLayout(cp_axis=None, backend="xla")


class NnxStack(nnx.Module):
  """Two NNX TransformerLayers; the layout given once, here; ``windows``:
  each layer's sliding window (None: global)."""

  def __init__(self, layout, rngs, windows=(None, None), **kwargs):
    kwargs = dict(LAYER, **kwargs)
    self.layer_0 = cp_nnx.TransformerLayer(in_features=E, layout=layout,
                                           window_size=windows[0],
                                           rngs=rngs, **kwargs)
    self.layer_1 = cp_nnx.TransformerLayer(in_features=E, layout=layout,
                                           window_size=windows[1],
                                           rngs=rngs, **kwargs)

  def __call__(self, x, cu, cuP, pos=None):
    return self.layer_1(self.layer_0(x, cu, cuP, pos), cu, cuP, pos)


class LinenStack(nn.Module):
  layout: CPLayout
  kwargs: dict
  windows: tuple = (None, None)

  @nn.compact
  def __call__(self, x, cu, cuP, pos=None):
    for i in range(2):
      x = cp_linen.TransformerLayer(**LAYER, **self.kwargs,
                                    window_size=self.windows[i],
                                    layout=self.layout, name=f"layer_{i}")(
                                        x, cu, cuP, pos)
    return x


def _randomize(model, seed):
  """Random values for every parameter (norm scales and biases included),
  less symmetric than the initializers' values."""
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.Param)
  pure = jax.tree.map(lambda a: jnp.asarray((1.0 + 0.3 * rng.standard_normal(
      a.shape)) if a.ndim == 1 else rng.standard_normal(a.shape) / np.sqrt(
          a.shape[0]), a.dtype), nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(model, state)
  return model


def _valid_mask():
  m = np.zeros((B, T), np.float32)
  for r in range(B):
    for b in range(CU.shape[1] - 1):
      m[r, CU_P[r, b]:CU_P[r, b] + CU[r, b + 1] - CU[r, b]] = 1.0
  return m


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((B, T, E)).astype(np.float32)
  w = rng.standard_normal((B, T, E)).astype(np.float32) * _valid_mask()[
      ..., None]
  return dict(x=x, w=w, pos=np.asarray(jax_cp.data.get_position_ids(CU_P)))


def _loss(model, x, w, cu, cuP, pos):
  return jnp.sum(model(x, cu, cuP, pos) * w)


@pytest.fixture(scope="module")
def baseline(data):
  """The NNX stack without CP: its parameters, loss and gradients."""
  model = _randomize(NnxStack(NO_CP, nnx.Rngs(0)), 1)
  value, grads = nnx.jit(nnx.value_and_grad(_loss))(
      model, data["x"], data["w"], CU, CU_P, data["pos"])
  return model, float(value), nnx.to_pure_dict(grads)


def _assert_close(value, grads, baseline, rtol=1e-4):
  _, want_value, want_grads = baseline
  assert abs(value - want_value) <= rtol * abs(want_value), (value,
                                                             want_value)
  flat_want = jax.tree_util.tree_flatten_with_path(want_grads)[0]
  got = jax.tree.leaves(jax.device_get(grads))
  assert len(got) == len(flat_want)
  for (path, want), g in zip(flat_want, got):
    err = np.abs(np.asarray(g) - np.asarray(want)).max()
    assert err <= rtol * np.abs(want).max() + 1e-7, (
        jax.tree_util.keystr(path), err)


# ------------------------------------------------------------ NNX vs Linen


@pytest.mark.parametrize("kwargs, windows", [
    ({}, (None, None)),
    (dict(norm_type="layernorm", mlp_activation="swiglu", use_bias=True),
     ((5, 0), None)),
])
def test_nnx_matches_linen_forward_and_gradients(data, kwargs, windows):
  model = _randomize(NnxStack(NO_CP, nnx.Rngs(0), windows, **kwargs), 2)
  linen = LinenStack(NO_CP, kwargs, windows)
  variables = cp_nnx.linen_params(model)
  # The same parameter tree as Linen's own init.
  shapes = jax.eval_shape(lambda: linen.init(
      jax.random.key(0), data["x"], CU, CU_P))
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape,
                                                         variables)
  args = (data["x"], data["w"], CU, CU_P, data["pos"])
  value, grads = nnx.jit(nnx.value_and_grad(_loss))(model, *args)
  want_value, want_grads = jax.jit(jax.value_and_grad(
      lambda v, x, w, cu, cuP, pos: jnp.sum(linen.apply(v, x, cu, cuP, pos)
                                            * w)))(variables, *args)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  got = {"params": nnx.to_pure_dict(grads)}
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())
  # Forward outputs too, without position ids (derived from the metadata).
  np.testing.assert_allclose(
      model(data["x"], CU, CU_P), linen.apply(variables, data["x"], CU, CU_P),
      rtol=1e-6, atol=1e-6)


def test_linen_params_convert_both_ways(data):
  linen = LinenStack(NO_CP, {})
  variables = jax.jit(lambda x: linen.init(jax.random.key(3), x, CU, CU_P))(
      data["x"])
  model = cp_nnx.load_linen_params(NnxStack(NO_CP, nnx.Rngs(0)), variables)
  back = cp_nnx.linen_params(model)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(variables)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(model(data["x"], CU, CU_P),
                                linen.apply(variables, data["x"], CU, CU_P))
  other = NnxStack(NO_CP, nnx.Rngs(0), mlp_activation="swiglu")
  with pytest.raises(ValueError, match="missing.*layer_0/mlp/gate/kernel"):
    cp_nnx.load_linen_params(other, variables)
  wide = NnxStack(NO_CP, nnx.Rngs(0), mlp_dim=48)
  with pytest.raises(ValueError, match=r"layer_0/mlp/down/kernel: Linen has "
                     r"\(32, 16\)"):
    cp_nnx.load_linen_params(wide, variables)


def test_layout_is_static_configuration():
  layout = CPLayout(strategy="no_load_balance", cp_size=CP)
  model = NnxStack(layout, nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  # Only parameters are state; the layout lives in the graph definition,
  # and reaches the innermost module unchanged.
  assert all(isinstance(v, nnx.Param) for v in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  assert model.layer_1.attention.attention.layout is layout
  assert hash(graphdef) == hash(nnx.split(NnxStack(
      CPLayout(strategy="no_load_balance", cp_size=CP), nnx.Rngs(1)))[0])
  with pytest.raises(ValueError, match="layout must be a jax_cp.CPLayout"):
    cp_nnx.TransformerLayer(2, E, layout="no_load_balance",
                            rngs=nnx.Rngs(0))


# ------------------------------------------------------------ CP vs no CP


def _global_view_loss_and_grads(model, layout, mesh, data):
  """Loss and gradients (a pure dict) of ``model`` on ``data`` laid out by
  ``layout`` (``make_global_batch``), under ``nnx.jit`` on ``mesh``."""
  batch = jax_cp.data.make_global_batch(
      dict(x=data["x"], w=data["w"], pos=data["pos"]), CU_P, layout,
      cu_seqlens=CU)
  t = batch.tensors
  with jax.set_mesh(mesh):
    value, grads = nnx.jit(nnx.value_and_grad(_loss))(
        model, t["x"], t["w"], batch, None, t["pos"])
  return float(value), nnx.to_pure_dict(grads)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("comm_type", ["all_gather", "ring"])
@pytest.mark.parametrize("strategy", list(S))
def test_global_view_matches_no_cp(data, baseline, strategy, comm_type):
  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP))
  layout = CPLayout(mesh=mesh, strategy=strategy, batch_axis="data",
                    backend="xla", comm_type=comm_type)
  model = NnxStack(layout, nnx.Rngs(0))
  nnx.update(model, nnx.state(baseline[0], nnx.Param))
  value, grads = _global_view_loss_and_grads(model, layout, mesh, data)
  _assert_close(value, grads, baseline)


def test_local_view_in_shard_map_matches_no_cp(data, baseline):
  strategy = S.DUAL_CHUNK_SWAP
  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP))
  layout = CPLayout(strategy=strategy, view="local", backend="xla")
  graphdef, _ = nnx.split(NnxStack(layout, nnx.Rngs(0)))
  state = nnx.state(baseline[0])
  feat, meta = P("data", "cp", None), P("data", None)

  def body(state, x, w, cu, cuP):
    def local_loss(state):
      model = nnx.merge(graphdef, state)
      # Position ids derived in the local layout, from the metadata.
      return jnp.sum(model(x, cu, cuP) * w)
    value, grads = jax.value_and_grad(local_loss)(state)
    return (jax.lax.psum(value, ("data", "cp")),
            jax.lax.psum(grads, ("data", "cp")))

  step = jax.jit(jax.shard_map(body, mesh=mesh,
                               in_specs=(P(), feat, feat, meta, meta),
                               out_specs=(P(), P()), check_vma=False))
  reorder = lambda a: jax_cp.data.reorder_for_cp(
      a, CU_P, CPLayout(cp_size=CP, strategy=strategy), seq_dim=1)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  with jax.set_mesh(mesh):
    value, grads = step(state, put(reorder(data["x"]), feat),
                        put(reorder(data["w"]), feat), put(CU, meta),
                        put(CU_P, meta))
  _assert_close(float(value), nnx.to_pure_dict(grads), baseline)


# ------------------------------------------------------------ checkpoints


def test_orbax_checkpoint_round_trip(data, tmp_path):
  layout = CPLayout(strategy="no_load_balance", cp_axis=None, backend="xla")
  model = _randomize(NnxStack(layout, nnx.Rngs(0)), 4)
  want = model(data["x"], CU, CU_P)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", nnx.state(model))
  checkpointer.wait_until_finished()

  abstract = nnx.eval_shape(lambda: NnxStack(layout, nnx.Rngs(9)))
  graphdef, abstract_state = nnx.split(abstract)
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state",
                                                      abstract_state))
  assert restored.layer_0.layout is layout
  for a, b in zip(jax.tree.leaves(nnx.state(restored)),
                  jax.tree.leaves(nnx.state(model))):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(restored(data["x"], CU, CU_P), want)


def test_windowed_layers_with_cp_match_no_cp(data):
  """A windowed layer then a global one: NO_LOAD_BALANCE cp=4 (global view)
  gives the loss and gradients of the same NNX model without CP."""
  windows = ((5, 0), None)
  plain = _randomize(NnxStack(NO_CP, nnx.Rngs(0), windows), 5)
  args = (data["w"], CU, CU_P, data["pos"])
  value, grads = nnx.jit(nnx.value_and_grad(_loss))(plain, data["x"], *args)
  want = (plain, float(value), nnx.to_pure_dict(grads))

  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP))
  layout = CPLayout(mesh=mesh, strategy="no_load_balance", batch_axis="data",
                    backend="xla")
  model = NnxStack(layout, nnx.Rngs(0), windows)
  nnx.update(model, nnx.state(plain, nnx.Param))
  value, grads = _global_view_loss_and_grads(model, layout, mesh, data)
  _assert_close(value, grads, want)
