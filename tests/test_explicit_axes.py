"""Token-sized work on meshes of Explicit axes (``jax.make_mesh``'s default)
and of Auto axes, where a buffer's sharding is part of its type or the
partitioner's to choose.

* ``jax_cp.chunked_cross_entropy`` in chunks of 4 tokens (data=2 x cp=4,
  both strategies): the per-token loss against float64 numpy, its
  gradients against float64 numpy's and the unchunked loss's.
* MLP chunks (``TransformerLayer.mlp_chunk_size``, ``MlpBlock.chunk_size``;
  Linen and NNX; cp=4, both strategies) and layer chunks
  (``layer_chunk_size``: a cp axis of size 1, the rows over the data axis):
  values and gradients of the whole rows without CP.
* ``CPLayout.shard_tokens`` pins the token axis (and the batch), never the
  heads, on an Auto mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout, data
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from tests._devices import devices

DP, CP = 2, 4
B, T, E = 2, 64, 16
# Padded lengths are multiples of 2*CP (DUAL_CHUNK_SWAP), at most 32.
CU_P = np.array([[0, 16, 48, 64], [0, 32, 56, 64]], np.int32)
CU = np.array([[0, 13, 40, 50], [0, 30, 50, 58]], np.int32)
LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=24,
             mlp_activation="swiglu")
NO_CP = CPLayout(cp_axis=None, backend="xla")
AXIS_TYPES = pytest.mark.parametrize(
    "axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
STRATEGIES = pytest.mark.parametrize("strategy", list(S),
                                     ids=lambda s: s.value)


def _mesh(axis_type, dp=DP, cp=CP):
  return jax.make_mesh((dp, cp), ("data", "cp"), axis_types=(axis_type,) * 2,
                       devices=devices(dp * cp))


def _put(mesh, a, *spec):
  return jax.device_put(a, NamedSharding(mesh, P(*spec)))


def _token_order(strategy):
  """(to the layout's token order, back to physical order) of [B, T, ...]."""
  layout = CPLayout(cp_size=CP, strategy=strategy)
  return (lambda a: data.reorder_for_cp(np.asarray(a), CU_P, layout,
                                        seq_dim=1),
          lambda a: data.restore_from_cp(np.asarray(a), CU_P, layout,
                                         seq_dim=1))


def _random(seed, *shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(
      np.float32)


def _close(got, want, rtol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    scale = float(np.abs(np.asarray(w)).max())
    err = float(np.abs(np.asarray(g, np.float64) - np.asarray(w)).max())
    assert err <= rtol * scale, (err, scale)


# ------------------------------------------------------------ chunked loss


V = 37


def _reference_loss(x, w, labels):
  """float64 numpy: the cross entropy ``[B, T]`` and the gradients of
  ``sum(ce ** 2)`` in ``x`` and ``w``."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  logits = x @ w
  m = logits.max(-1, keepdims=True)
  p = np.exp(logits - m)
  lse = np.log(p.sum(-1)) + m[..., 0]
  p /= p.sum(-1, keepdims=True)
  onehot = np.eye(V)[labels]
  ce = lse - (logits * onehot).sum(-1)
  dlogits = 2 * ce[..., None] * (p - onehot)
  return ce, (dlogits @ w.T, np.einsum("bte,btv->ev", x, dlogits))


@AXIS_TYPES
@STRATEGIES
def test_chunked_cross_entropy(axis_type, strategy):
  mesh = _mesh(axis_type)
  layout = CPLayout(batch_axis="data", strategy=strategy, backend="xla")
  to_layout, to_physical = _token_order(strategy)
  x, w = _random(0, B, T, E), _random(1, E, V) / np.sqrt(E)
  labels = np.random.default_rng(2).integers(0, V, (B, T)).astype(np.int32)

  def step(chunk):
    def loss(x, w, labels):
      ce = jax_cp.chunked_cross_entropy(
          lambda h: jnp.dot(h, w, precision="highest"), x, labels,
          vocab=V, chunk_size=chunk, layout=layout)
      return jnp.sum(ce ** 2), ce
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  with jax.set_mesh(mesh):
    args = (_put(mesh, to_layout(x), "data", "cp", None), _put(mesh, w),
            _put(mesh, to_layout(labels), "data", "cp"))
    (_, ce), grads = step(4)(*args)
    (_, whole_ce), whole_grads = step(None)(*args)
  want_ce, want_grads = _reference_loss(x, w, labels)
  np.testing.assert_allclose(to_physical(ce), want_ce, rtol=2e-6, atol=2e-5)
  np.testing.assert_allclose(ce, whole_ce, rtol=2e-6, atol=2e-5)
  _close((to_physical(grads[0]), grads[1]), want_grads, rtol=1e-5)
  _close(grads, whole_grads, rtol=1e-5)


# ------------------------------------------------------------ MLP chunks


def _linen_layer(layout, chunk):
  """(apply(params, x), params) of a Linen layer; the parameters random
  (norm scales included) and the same for every layout."""
  m = cp_linen.TransformerLayer(**LAYER, layout=layout, remat="full",
                                mlp_chunk_size=chunk)
  shapes = jax.eval_shape(lambda: cp_linen.TransformerLayer(
      **LAYER, layout=NO_CP).init(jax.random.key(0), _random(0, B, T, E),
                                  CU, CU_P))
  rng = np.random.default_rng(3)
  params = jax.tree.map(lambda s: (
      1.0 + 0.3 * rng.standard_normal(s.shape) if len(s.shape) == 1 else
      rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(s.dtype),
                        shapes)
  return (lambda p, x: m.apply(p, x, CU, CU_P)), params


def _nnx_layer(layout, chunk):
  m = cp_nnx.TransformerLayer(**LAYER, in_features=E, layout=layout,
                              remat="full", mlp_chunk_size=chunk,
                              rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  return (lambda s, x: nnx.merge(graphdef, s)(x, CU, CU_P)), state


@pytest.mark.sweep(fast=3)
@pytest.mark.parametrize("build", [_linen_layer, _nnx_layer],
                         ids=["linen", "nnx"])
@AXIS_TYPES
@STRATEGIES
def test_mlp_chunks_of_a_layer(build, axis_type, strategy):
  """Chunks of 5 of each rank's 16 tokens (5 + 5 + 5 + 1) against the
  whole rows without CP (physical order, no mesh)."""
  mesh = _mesh(axis_type)
  to_layout, to_physical = _token_order(strategy)
  x, w = _random(4, B, T, E), _random(5, B, T, E)
  apply, params = build(CPLayout(batch_axis="data", strategy=strategy,
                                 backend="xla"), 5)
  whole, _ = build(NO_CP, None)
  grad = lambda apply: jax.jit(jax.value_and_grad(
      lambda p, x, w: jnp.sum(apply(p, x) * w), argnums=(0, 1)))
  with jax.set_mesh(mesh):
    value, (dp, dx) = grad(apply)(
        params, _put(mesh, to_layout(x), "data", "cp", None),
        _put(mesh, to_layout(w), "data", "cp", None))
  want = grad(whole)(params, x, w)
  _close((value, dp, to_physical(dx)), want, rtol=1e-4)


@pytest.mark.sweep(fast=3)
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@AXIS_TYPES
@STRATEGIES
def test_mlp_block_chunks(framework, axis_type, strategy):
  """An MlpBlock in chunks of 3 of each rank's tokens against the block on
  the whole rows, without a layout."""
  mesh = _mesh(axis_type)
  to_layout, to_physical = _token_order(strategy)
  x = _random(6, B, T, E)
  layout = CPLayout(batch_axis="data", strategy=strategy, backend="xla")
  if framework == "linen":
    block = cp_linen.MlpBlock(mlp_dim=24, activation="geglu", layout=layout,
                              chunk_size=3)
    params = jax.jit(block.clone(layout=None, chunk_size=None).init)(
        jax.random.key(0), x)
    apply, whole = block.apply, block.clone(layout=None,
                                            chunk_size=None).apply
  else:
    graphdef, params = nnx.split(cp_nnx.MlpBlock(
        E, 24, activation="geglu", layout=layout, chunk_size=3,
        rngs=nnx.Rngs(0)))
    plain, _ = nnx.split(cp_nnx.MlpBlock(E, 24, activation="geglu",
                                         rngs=nnx.Rngs(0)))
    apply = lambda s, x: nnx.merge(graphdef, s)(x)
    whole = lambda s, x: nnx.merge(plain, s)(x)
  grad = lambda apply: jax.jit(jax.value_and_grad(
      lambda p, x: jnp.sum(jnp.sin(apply(p, x))), argnums=(0, 1)))
  with jax.set_mesh(mesh):
    value, (dp, dx) = grad(apply)(
        params, _put(mesh, to_layout(x), "data", "cp", None))
  _close((value, dp, to_physical(dx)), grad(whole)(params, x), rtol=2e-5)


# ------------------------------------------------------------ layer chunks


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("framework", ["linen", "nnx"])
@AXIS_TYPES
def test_layer_chunks_over_the_data_axis(framework, axis_type):
  """Chunks of 32 tokens (halo 31) with the rows over data=2 and a cp axis
  of size 1, against the whole rows without CP (no mesh)."""
  mesh = _mesh(axis_type, cp=1)
  layout = CPLayout(batch_axis="data", max_seqlen=32, backend="xla")
  bound = NO_CP.replace(max_seqlen=32)
  x, w = _random(7, B, T, E), _random(8, B, T, E)
  if framework == "linen":
    apply, params = _linen_layer(bound, None)
    chunked = cp_linen.TransformerLayer(**LAYER, layout=layout,
                                        remat="full", layer_chunk_size=32)
    chunked_apply = lambda p, x: chunked.apply(p, x, CU, CU_P)
  else:
    apply, params = _nnx_layer(bound, None)
    graphdef, _ = nnx.split(cp_nnx.TransformerLayer(
        **LAYER, in_features=E, layout=layout, remat="full",
        layer_chunk_size=32, rngs=nnx.Rngs(0)))
    chunked_apply = lambda s, x: nnx.merge(graphdef, s)(x, CU, CU_P)
  grad = lambda apply: jax.jit(jax.value_and_grad(
      lambda p, x, w: jnp.sum(apply(p, x) * w), argnums=(0, 1)))
  with jax.set_mesh(mesh):
    got = grad(chunked_apply)(params, _put(mesh, x, "data", "cp", None),
                              _put(mesh, w, "data", "cp", None))
  _close(got, grad(apply)(params, x, w), rtol=2e-5)


# ------------------------------------------------------------ shard_tokens


def _spec(x):
  """The output's PartitionSpec, one entry per axis, names unwrapped."""
  spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  return tuple(s[0] if isinstance(s, tuple) and len(s) == 1 else s
               for s in spec)


@pytest.mark.parametrize("mesh_in_layout", [True, False],
                         ids=["layout_mesh", "context_mesh"])
def test_shard_tokens_pins_the_token_axis(mesh_in_layout):
  """On an Auto mesh (data=2 x cp=4), under jit, replicated inputs: the
  token axis goes to cp ([T, E]: axis 0; batched: axis 1, the batch on
  data), the heads stay off cp; ``seq_dim=0`` pins a [T, H, D] array's
  tokens. On an Explicit mesh the array is returned as it is."""
  mesh = _mesh(AxisType.Auto)
  layout = CPLayout(batch_axis="data", mesh=mesh if mesh_in_layout else None)
  cases = [((8, 4), {}, ("cp",)),
           ((2, 8, 4), {}, ("data", "cp")),
           ((2, 8, 4, 2), {}, ("data", "cp")),
           ((8, 4, 2), dict(seq_dim=0), ("cp",))]
  with jax.set_mesh(mesh):
    for shape, kwargs, want in cases:
      x = _put(mesh, jnp.zeros(shape))
      got = _spec(jax.jit(lambda x, kw=kwargs: layout.shard_tokens(
          x, **kw))(x))
      assert got[:len(want)] == want, (shape, got)
      assert "cp" not in got[len(want):], (shape, got)
  explicit = _mesh(AxisType.Explicit)
  same = []
  with jax.set_mesh(explicit):
    x = _put(explicit, jnp.zeros((2, 8, 4, 2)), "data", "cp")
    jax.jit(lambda x: same.append(
        CPLayout(batch_axis="data").shard_tokens(x) is x) or x)(x)
  assert same == [True]
