"""Mini-sequence position-wise work: ``mlp_chunk_size`` of TransformerLayer
and ``chunk_size`` of MlpBlock (Linen and NNX) run the MLP (with the
layer's pre-MLP norm and residual add) over chunks of each rank's tokens.
The results and gradients equal the whole-row layer's (float32, under the
remat presets, without CP, at cp=4 in the global view and in a shard_map);
a chunked gradient runs no collective the whole-row one does not, and none
per chunk; its compiled temp memory is the smaller one; bad sizes raise."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from jax_cp.modules import token_chunks
from jax_cp.nnx import convert
from tests._devices import devices

CP, T, E = 4, 64, 16
CU_P = np.array([[0, 16, 48, 64]], np.int32)
CU = np.array([[0, 13, 40, 50]], np.int32)
LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=40)
NO_CP = CPLayout(cp_axis=None, backend="xla")


def _x(seed=0, t=T, e=E):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((1, t, e)), jnp.float32)


def _close(got, want, rtol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(w)).max())
    err = float(np.abs(np.asarray(g) - np.asarray(w)).max())
    assert err <= rtol * scale, (err, scale)


def _linen(chunk, remat="full", layout=NO_CP, activation="swiglu"):
  """(loss(params, x) -> (value, grads), params) of a Linen layer."""
  m = cp_linen.TransformerLayer(**LAYER, mlp_activation=activation,
                                layout=layout, remat=remat,
                                mlp_chunk_size=chunk)
  params = jax.jit(lambda x: m.init(jax.random.key(0), x, CU, CU_P))(_x())
  w = _x(1)
  loss = lambda p, x: jnp.sum(m.apply(p, x, CU, CU_P) * w)
  return jax.value_and_grad(loss, argnums=(0, 1)), params


def _nnx(chunk, remat="full", layout=NO_CP, activation="swiglu"):
  m = cp_nnx.TransformerLayer(**LAYER, in_features=E,
                              mlp_activation=activation, layout=layout,
                              remat=remat, mlp_chunk_size=chunk,
                              rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  w = _x(1)
  loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, CU, CU_P) * w)
  return jax.value_and_grad(loss, argnums=(0, 1)), state


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("build", [_linen, _nnx], ids=["linen", "nnx"])
@pytest.mark.parametrize("remat, activation, chunk", [
    ("full", "swiglu", 24), ("save_context", "gelu", 7),
    ("minimal", "swiglu", 16), ("none", "gelu", 5)])
def test_chunked_layer_equals_the_whole_row(build, remat, activation, chunk):
  """Chunks of ``chunk`` tokens, the last shorter (64 = 2*24 + 16, ...)."""
  step, params = build(chunk, remat, activation=activation)
  whole, _ = build(None, remat, activation=activation)
  got, want = jax.jit(step)(params, _x()), jax.jit(whole)(params, _x())
  _close(got, want)
  assert float(jnp.abs(got[1][1]).max()) > 0     # x's gradient is not 0


def test_chunked_linen_and_nnx_share_parameters():
  m = cp_nnx.TransformerLayer(**LAYER, in_features=E, layout=NO_CP,
                              mlp_activation="swiglu", mlp_chunk_size=24,
                              rngs=nnx.Rngs(3))
  linen = cp_linen.TransformerLayer(**LAYER, layout=NO_CP,
                                    mlp_activation="swiglu",
                                    mlp_chunk_size=24)
  params = jax.jit(lambda x: linen.init(jax.random.key(0), x, CU, CU_P))(
      _x())
  assert jax.tree.map(jnp.shape, convert.linen_params(m)) == jax.tree.map(
      jnp.shape, params)
  _close(linen.apply(convert.linen_params(m), _x(), CU, CU_P),
         m(_x(), CU, CU_P))


@pytest.mark.parametrize("activation", ["gelu", "geglu"])
def test_chunked_mlp_block_equals_the_whole_block(activation):
  x = _x(2, t=50)
  block = cp_linen.MlpBlock(mlp_dim=40, activation=activation, chunk_size=16)
  params = jax.jit(block.init)(jax.random.key(0), x)
  whole = block.clone(chunk_size=None)
  loss = lambda m: jax.value_and_grad(
      lambda p, x: jnp.sum(jnp.sin(m.apply(p, x))), argnums=(0, 1))
  _close(loss(block)(params, x), loss(whole)(params, x))
  nb = cp_nnx.MlpBlock(E, 40, activation=activation, chunk_size=16,
                       rngs=nnx.Rngs(0))
  gd, st = nnx.split(nb)
  nloss = lambda s, x: jnp.sum(jnp.sin(nnx.merge(gd, s)(x)))
  got = jax.value_and_grad(nloss, argnums=(0, 1))(st, x)
  nb.chunk_size = None
  gd, _ = nnx.split(nb)
  _close(got, jax.value_and_grad(nloss, argnums=(0, 1))(st, x))


# ------------------------------------------------------------------ CP


def _mesh():
  return jax.make_mesh((CP,), ("cp",), devices=devices(CP, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))


_COLLECTIVE = re.compile(r"= \S+ (all-gather|all-reduce|collective-permute|"
                         r"all-to-all|reduce-scatter)(?:-start)?\(")


def _collectives(text):
  """(every collective, those inside while-loop bodies) of compiled HLO."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
  total, looped, comp = [], [], None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if head and line.rstrip().endswith("{"):
      comp = head.group(1)
    if m := _COLLECTIVE.search(line):
      total.append(m.group(1))
      if comp in bodies:
        looped.append(m.group(1))
  assert bodies or "while" not in text
  return sorted(total), (looped, len(bodies))


@pytest.mark.slow
def test_global_view_chunks_add_no_collective():
  """cp=2, DUAL_CHUNK_SWAP, the layer's value and gradients."""
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, strategy=S.DUAL_CHUNK_SWAP, backend="xla")
  with jax.set_mesh(mesh):
    x = jax.device_put(_x(), NamedSharding(mesh, P(None, "cp")))
    out = {}
    for chunk in (None, 12):     # 32 tokens per rank: 12 + 12 + 8
      step, params = _linen(chunk, "save_context", layout)
      compiled = jax.jit(step).lower(params, x).compile()
      out[chunk] = _collectives(compiled.as_text()), compiled(params, x)
  (whole, _), want = out[None]
  (chunked, (looped, loops)), got = out[12]
  assert loops >= 1                          # the chunks' scan
  assert "all-gather" in whole, whole       # the K/V exchange
  assert chunked == whole and looped == [], (chunked, whole, looped)
  _close(got, want)


def test_local_view_chunks_in_a_shard_map():
  mesh = _mesh()
  local = CPLayout(mesh=mesh, strategy=S.DUAL_CHUNK_SWAP, backend="xla",
                   view="local")
  x = _x()
  results = []
  for chunk in (None, 5):
    m = cp_nnx.TransformerLayer(**LAYER, in_features=E, layout=local,
                                remat="full", mlp_chunk_size=chunk,
                                rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def per_rank(s, xl, graphdef=graphdef):
      loss = lambda s, xl: jnp.sum(
          jnp.sin(nnx.merge(graphdef, s)(xl, CU, CU_P)))
      v, g = jax.value_and_grad(loss, argnums=(0, 1))(s, xl)
      return jax.lax.psum(v, "cp"), jax.lax.psum(g[0], "cp"), g[1]

    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(None, "cp")),
                       out_specs=(P(), P(), P(None, "cp")))
    results.append(jax.jit(fn)(state, x))
  _close(results[1], results[0])


# ------------------------------------------------------------ memory


def _grad_temp(module, x, *args):
  """Compiled temp bytes of the gradient of ``sum(module(x, *args))``."""
  params = jax.eval_shape(module.init, jax.random.key(0), x, *args)
  step = jax.grad(lambda p, x: jnp.sum(module.apply(p, x, *args)),
                  argnums=(0, 1))
  compiled = jax.jit(step).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_shrink_the_backward_working_set():
  """A gated MLP 2048 wide at E=32 (each whole-row hidden activation of
  1024 tokens is 8 MiB) under remat="full": the layer's gradient plans
  less than half the temp memory with chunks of 128 tokens; a lone
  MlpBlock's (4096 tokens, 512 wide), less than a quarter."""
  cu = np.array([[0, 500, 1024]], np.int32)
  x = _x(0, t=1024, e=32)
  temp = {c: _grad_temp(cp_linen.TransformerLayer(
      num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=2048,
      mlp_activation="swiglu", layout=NO_CP, remat="full",
      mlp_chunk_size=c), x, cu, cu) for c in (None, 128)}
  assert temp[128] < temp[None] / 2, temp
  x = _x(0, t=4096, e=32)
  temp = {c: _grad_temp(cp_linen.MlpBlock(
      mlp_dim=512, activation="swiglu", chunk_size=c), x) for c in (None, 512)}
  assert temp[512] < temp[None] / 4, temp


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("remat, extra_dots", [
    ("full", 0), ("save_context", 0), ("none", 1)])
def test_chunks_add_no_matmul_under_remat(remat, extra_dots):
  """Compiled matmul FLOPs of two stacked layers' loss and gradient
  (benchmarks.hlo_flops): under "full" and "save_context" the chunked
  step runs exactly the whole row's (the chunk loop's backward re-runs a
  chunk's forward where the layer's recompute would have run it, and XLA
  drops that recompute); under "none" it adds the forward of the MLP's
  input projection per layer (why "auto" keeps whole rows there)."""
  from benchmarks import hlo_flops
  t, e, mlp = 1024, 32, 256
  cu = np.array([[0, 500, t]], np.int32)
  x = _x(0, t=t, e=e)
  flops = {}
  for c in (None, 128):
    m = cp_linen.TransformerLayer(
        num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=mlp,
        mlp_activation="gelu", layout=NO_CP, remat=remat, mlp_chunk_size=c)
    params = jax.jit(lambda x, m=m: m.init(jax.random.key(0), x, cu, cu))(x)

    def loss(p, x, m=m):
      return jnp.sum(jnp.tanh(m.apply(p, m.apply(p, x, cu, cu), cu, cu)))
    count = hlo_flops.dot_flops(jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1))).lower(params, x).compile().as_text())
    assert count.loops_without_trip_count == 0
    flops[c] = count.flops
  assert flops[128] - flops[None] == extra_dots * 2 * (2 * t * e * mlp), \
      flops


# ------------------------------------------------------------ the fields


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "big", "8"])
def test_bad_chunk_sizes_raise(bad):
  match = rf"mlp_chunk_size={re.escape(repr(bad))} must be None, 'auto' or"
  with pytest.raises(ValueError, match=match):
    cp_linen.TransformerLayer(**LAYER, mlp_chunk_size=bad)
  with pytest.raises(ValueError, match=match):
    cp_nnx.TransformerLayer(**LAYER, in_features=E, mlp_chunk_size=bad,
                            rngs=nnx.Rngs(0))
  match = rf"chunk_size={re.escape(repr(bad))} must be None or a positive"
  with pytest.raises(ValueError, match=match):
    cp_linen.MlpBlock(mlp_dim=8, chunk_size=bad)
  with pytest.raises(ValueError, match=match):
    cp_nnx.MlpBlock(E, 8, chunk_size=bad, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="chunk_size='auto' must be None or"):
    cp_linen.MlpBlock(mlp_dim=8, chunk_size="auto")


def test_auto_chunk_size():
  auto = lambda remat, t, d=2048, hidden=2 * 8192: (
      token_chunks.mlp_chunk_tokens("auto", remat, t, d, hidden))
  assert auto("none", 1 << 20) is None            # the backward keeps all
  assert auto("full", 8192) is None               # short rows: whole
  # 4 hidden-wide buffers in a chunk's backward: 4 * hidden / d chunks.
  assert auto("full", 1 << 20) == (1 << 20) // 32
  assert auto("full", 1 << 20, hidden=8192) == (1 << 20) // 16
  assert auto("full", 1 << 20, d=4096, hidden=4096) == (1 << 20) // 4
  assert auto("save_context", 65536) == 8192      # at least 8192 tokens
  assert auto(jax.checkpoint_policies.nothing_saveable, 1 << 19) == 1 << 14
  assert token_chunks.mlp_chunk_tokens(64, "none", 64, 16, 64) is None
  assert token_chunks.mlp_chunk_tokens(None, "full", 1 << 20, 16, 64) is None
  assert token_chunks.mlp_chunk_tokens(100, "none", 1000, 16, 64) == 100


def test_map_token_chunks_runs_whole_when_a_chunk_holds_every_token():
  """A chunk of at least a rank's tokens: one call of ``fn`` on the whole
  row (no loop), the same value and gradient as the chunked loop's."""
  w = jnp.asarray(np.random.default_rng(3).standard_normal((E, E)),
                  jnp.float32)
  calls = []

  def fn(xc, pin):
    calls.append(xc.shape)
    return xc + jnp.tanh(pin(xc) @ w)

  def run(chunk):
    f = lambda x: jnp.sum(jnp.sin(token_chunks.map_token_chunks(
        fn, x, chunk, NO_CP, 1)))
    return jax.value_and_grad(f)(_x())

  whole = run(T)
  assert calls == [(1, T, E)]
  _close(run(2 * T), whole)
  _close(run(5), whole)


def test_map_token_chunks_with_aux_and_a_new_feature_size():
  """``aux`` (per-token inputs without a gradient) reaches ``fn`` chunk by
  chunk, and an output of another feature size (the loop is not in place:
  its backward writes the cotangent over ``x``) gives the whole row's
  value and gradients, a shorter last chunk included; an ``aux`` of
  another token shape raises."""
  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.standard_normal((E, 3)), jnp.float32)
  aux = jnp.asarray(rng.integers(0, 3, (1, T)), jnp.int32)

  def fn(xc, ac, pin):
    y = jnp.tanh(pin(xc) @ w)                                # [.., c, 3]
    return y * jax.nn.one_hot(ac, 3, dtype=y.dtype) + ac[..., None]

  def run(chunk):
    f = lambda x, w_: jnp.sum(jnp.sin(token_chunks.map_token_chunks(
        lambda xc, ac, pin: fn(xc, ac, pin) * w_, x, chunk, NO_CP, 1,
        aux=aux)))
    return jax.value_and_grad(f, argnums=(0, 1))(_x(), jnp.float32(1.5))

  whole = run(None)
  for chunk in (5, T // 2, 7):
    _close(run(chunk), whole)
  with pytest.raises(ValueError, match="aux must have the shape of x"):
    token_chunks.map_token_chunks(fn, _x(), 5, NO_CP, 1, aux=aux[:, 1:])


@pytest.mark.parametrize("build", ["linen", "nnx"])
def test_default_is_auto_and_chunks_long_rows_only_under_remat(build):
  """``mlp_chunk_size`` defaults to ``"auto"``: a row longer than
  ``AUTO_MIN_CHUNK`` tokens under ``remat="full"`` lowers the chunk loop
  (one ``while`` more than the whole-row layer's gradient), a short row or
  ``remat="none"`` lowers exactly the whole-row program."""
  t = 2 * token_chunks.AUTO_MIN_CHUNK + 40

  def lowered(remat, tokens, **chunk):
    xs = jax.ShapeDtypeStruct((1, tokens, E), jnp.float32)
    c = np.array([[0, tokens // 2, tokens]], np.int32)
    if build == "linen":
      m = cp_linen.TransformerLayer(**LAYER, layout=NO_CP, remat=remat,
                                    **chunk)
      params = jax.eval_shape(m.init, jax.random.key(0), xs, c, c)
      f = lambda p, x: jnp.sum(m.apply(p, x, c, c))
    else:
      m = nnx.eval_shape(lambda: cp_nnx.TransformerLayer(
          **LAYER, in_features=E, layout=NO_CP, remat=remat,
          rngs=nnx.Rngs(0), **chunk))
      graphdef, params = nnx.split(m)
      f = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, c, c))
    return jax.jit(jax.grad(f, argnums=(0, 1))).lower(params, xs).as_text()

  default = (cp_linen.TransformerLayer(**LAYER).mlp_chunk_size
             if build == "linen" else inspect.signature(
                 cp_nnx.TransformerLayer.__init__).parameters[
                     "mlp_chunk_size"].default)
  assert default == "auto"
  loops = lambda text: text.count("stablehlo.while")
  assert loops(lowered("full", t)) == loops(
      lowered("full", t, mlp_chunk_size=None)) + 1
  for remat, tokens in (("none", t), ("full", token_chunks.AUTO_MIN_CHUNK)):
    assert lowered(remat, tokens) == lowered(remat, tokens,
                                             mlp_chunk_size=None)
