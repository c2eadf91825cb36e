"""The whole layer over chunks of a row: ``layer_chunk_size`` of
TransformerLayer (Linen and NNX). Each chunk attends to the halo of tokens
before it; the results and gradients equal the whole-row layer's (float32,
with and without a sliding window, batched and single rows, any chunk
count and a shorter last chunk), and a halo one token short is caught by
the same comparison. The gradient's compiled temp memory grows by a few
token-wide buffers per token, far less than the whole-row layer's. Bad
settings raise; a document past the bound turns traced results NaN."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from jax_cp.attention import registry
from jax_cp.attention.decompose import chunk_attention
from jax_cp.attention.registry import resolve_backend
from jax_cp.modules import layer_chunks
from tests import reference
from tests._devices import devices

E = 16
LAYER = dict(num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=40,
             mlp_activation="swiglu")
# Two rows of 96 tokens: padded documents of at most 30 tokens, some with
# padding after their valid tokens, some of 30 valid tokens (a query 29
# tokens after its document's first key: the whole halo), empty slots.
CU_P = np.array([[0, 6, 36, 66, 96, 96, 96],
                 [0, 30, 41, 60, 66, 96, 96]], np.int32)
CU = np.array([[0, 6, 36, 65, 95, 95, 95],
               [0, 30, 41, 59, 65, 94, 94]], np.int32)
T = int(CU_P[0, -1])
BOUND = CPLayout(cp_axis=None, backend="xla", max_seqlen=30)


def _x(seed=0, t=T, batch=2):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((batch, t, E)), jnp.float32)


def _close(got, want, rtol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(w)).max())
    err = float(np.abs(np.asarray(g) - np.asarray(w)).max())
    assert err <= rtol * scale, (err, scale)


def _linen(chunk, layout=BOUND, window=None, remat="full", single=False):
  """(loss(params, x) -> (value, grads), params, x) of a Linen layer; with
  ``single`` on the first row alone, ``[T, E]`` with ``[N+1]`` metadata."""
  m = cp_linen.TransformerLayer(**LAYER, layout=layout, remat=remat,
                                window_size=window, layer_chunk_size=chunk)
  x, w, cu, cuP = _x(), _x(1), CU, CU_P
  if single:
    x, w, cu, cuP = x[0], w[0], cu[0], cuP[0]
  params = jax.jit(lambda x: m.init(jax.random.key(0), x, cu, cuP))(x)
  loss = lambda p, x: jnp.sum(m.apply(p, x, cu, cuP) * w)
  return jax.value_and_grad(loss, argnums=(0, 1)), params, x


def _nnx(chunk, layout=BOUND, window=None, remat="full"):
  m = cp_nnx.TransformerLayer(**LAYER, in_features=E, layout=layout,
                              remat=remat, window_size=window,
                              layer_chunk_size=chunk, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  x = _x()
  w = _x(1)
  loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, CU, CU_P) * w)
  return jax.value_and_grad(loss, argnums=(0, 1)), state, x


@pytest.mark.sweep(fast=3)
@pytest.mark.parametrize("build", [_linen, _nnx], ids=["linen", "nnx"])
@pytest.mark.parametrize("window, chunk", [
    (None, 29),       # halo 29: 3 chunks of 29 and a last one of 9
    (None, 32),       # 3 full chunks
    (None, 35),       # token 35 reads key 6: the halo's first
    (None, 60),       # one full chunk and a last one of 36
    ((5, 0), 8),      # halo 5: 12 chunks
    ((5, 0), 13),     # 7 chunks of 13 and a last one of 5
    ((40, 0), 29),    # a window wider than the bound: halo 29
    ((7, 0), 9)])     # halo 7: a last chunk of 6, shorter than its halo
def test_chunked_layer_equals_the_whole_row(build, window, chunk):
  step, params, x = build(chunk, window=window)
  whole, _, _ = build(None, window=window)
  got, want = jax.jit(step)(params, x), jax.jit(whole)(params, x)
  _close(got, want)
  assert float(jnp.abs(got[1][1]).max()) > 0     # x's gradient is not 0


def _positions(cuP):
  """Each token's position in its padded document, by a loop."""
  pos = np.zeros((cuP.shape[0], int(cuP[0, -1])), np.int64)
  for b, row in enumerate(cuP):
    for s, e in zip(row[:-1], row[1:]):
      pos[b, s:e] = np.arange(e - s)
  return pos


def _rope(x, pos, theta=10000.0):
  """Half-split rotary embedding, angles in float64 on the host."""
  d = x.shape[-1]
  angles = pos[..., None] * theta ** (-np.arange(d // 2) * 2.0 / d)
  cos = jnp.asarray(np.cos(angles), jnp.float32)[..., None, :]
  sin = jnp.asarray(np.sin(angles), jnp.float32)[..., None, :]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _reference_layer(params, x, window=-1):
  """The layer written out in float32 on whole rows: RMS norms, GQA
  projections, rotary, plain masked attention (tests/reference.py), the
  gated MLP and both residual adds."""
  p = params["params"]
  dot = lambda spec, a, b: jnp.einsum(spec, a, b,
                                      precision=jax.lax.Precision.HIGHEST)
  norm = lambda v, w: v * jax.lax.rsqrt(
      jnp.mean(v * v, -1, keepdims=True) + 1e-6) * w["scale"]
  a, m = p["attention"], p["mlp"]
  n1 = norm(x, p["pre_attention_norm"])
  q, k, v = (dot("bte,ehd->bthd", n1, a[n]["kernel"])
             for n in ("query", "key", "value"))
  pos = _positions(CU_P)
  o = reference.batched_attention(_rope(q, pos), _rope(k, pos), v, CU, CU_P,
                                  window=window)
  h = x + dot("bthd,hde->bte", o, a["out"]["kernel"])
  n2 = norm(h, p["pre_mlp_norm"])
  hidden = (jax.nn.silu(dot("bte,ef->btf", n2, m["gate"]["kernel"]))
            * dot("bte,ef->btf", n2, m["up"]["kernel"]))
  return h + dot("btf,fe->bte", hidden, m["down"]["kernel"])


@pytest.mark.sweep(fast=1)
@pytest.mark.parametrize("window, chunk", [(None, 35), ((5, 0), 13)])
def test_chunked_layer_equals_an_independent_reference(window, chunk):
  """Value and every gradient against :func:`_reference_layer`."""
  step, params, x = _linen(chunk, window=window)
  w = _x(1)
  left = -1 if window is None else window[0]
  want = jax.value_and_grad(
      lambda p, x: jnp.sum(_reference_layer(p, x, left) * w),
      argnums=(0, 1))(params, x)
  _close(jax.jit(step)(params, x), want, rtol=1e-4)


@pytest.mark.sweep(fast=1)
@pytest.mark.parametrize("remat", ["none", "save_context"])
def test_chunks_under_other_remat_presets(remat):
  step, params, x = _linen(30, remat=remat)
  whole, _, _ = _linen(None, remat=remat)
  _close(jax.jit(step)(params, x), jax.jit(whole)(params, x))


@pytest.mark.slow    # a second layout of the chunked layer
def test_a_single_row_and_a_window_without_max_seqlen():
  """``[T, E]`` input with ``[N+1]`` metadata; with a window the layout
  needs no ``max_seqlen`` (documents of any length)."""
  layout = CPLayout(cp_axis=None, backend="xla")
  step, params, x = _linen(10, layout=layout, window=(6, 0), single=True)
  whole, _, _ = _linen(None, layout=layout, window=(6, 0), single=True)
  assert x.ndim == 2
  # 10 chunks: the parameters' cotangents are sums of 10 float32 parts,
  # and the loss (0.3) sums 1536 products near 1 of either sign, so its
  # rounding is relative to those.
  _close(jax.jit(step)(params, x), jax.jit(whole)(params, x), rtol=1e-4)


def test_linen_and_nnx_share_parameters():
  linen = cp_linen.TransformerLayer(**LAYER, layout=BOUND,
                                    layer_chunk_size=32)
  params = jax.jit(lambda x: linen.init(jax.random.key(0), x, CU, CU_P))(
      _x())
  whole = cp_linen.TransformerLayer(**LAYER, layout=BOUND)
  want = jax.jit(lambda x: whole.init(jax.random.key(0), x, CU, CU_P))(_x())
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert a.shape == b.shape


def test_a_short_halo_is_caught(monkeypatch):
  """The comparison above fails when each chunk reads one token less of
  its halo than its documents need (chunks of 35: token 35 of row 0
  reads its document's first key, token 6)."""
  real = layer_chunks.plan

  def short(*args):
    p = real(*args)
    return None if p is None else p._replace(halo=p.halo - 1)

  monkeypatch.setattr(layer_chunks, "plan", short)
  step, params, x = _linen(35)
  whole, _, _ = _linen(None)
  with pytest.raises(AssertionError):
    _close(jax.jit(step)(params, x), jax.jit(whole)(params, x))


# ------------------------------------------------------------ memory


def _grad_temp(chunk, t):
  """Compiled temp bytes of one layer's loss and gradient at ``t`` tokens
  (documents of 64, ``max_seqlen`` 64, E=32, a 256-wide gated MLP)."""
  cu = np.arange(0, t + 1, 64, dtype=np.int32)[None]
  m = cp_linen.TransformerLayer(
      num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=256,
      mlp_activation="swiglu", remat="full", mlp_chunk_size=None,
      layer_chunk_size=chunk,
      layout=CPLayout(cp_axis=None, backend="xla", max_seqlen=64))
  x = jax.ShapeDtypeStruct((1, t, 32), jnp.float32)
  params = jax.eval_shape(m.init, jax.random.key(0), x, cu, cu)
  loss = lambda p, x: jnp.sum(jnp.sin(m.apply(p, x, cu, cu)))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
      params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_keep_a_few_token_wide_buffers():
  """Per token, the chunked gradient's temp grows by at most 4 buffers as
  wide as the layer input (the output, its cotangent, the input's
  cotangent and one spare): the whole-row one's grows by more than 3 times
  that (projections, attention, MLP activations)."""
  width = 32 * 4
  slope = {c: (_grad_temp(c, 8192) - _grad_temp(c, 4096)) / 4096
           for c in (None, 512)}
  assert slope[512] <= 4 * width, slope
  assert slope[None] > 3 * slope[512], slope


# ------------------------------------------------------------ the checks


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "auto", "8"])
def test_bad_chunk_sizes_raise(bad):
  match = (rf"layer_chunk_size={re.escape(repr(bad))} must be None or a "
           "positive int")
  with pytest.raises(ValueError, match=match):
    cp_linen.TransformerLayer(**LAYER, layer_chunk_size=bad)
  with pytest.raises(ValueError, match=match):
    cp_nnx.TransformerLayer(**LAYER, in_features=E, layer_chunk_size=bad,
                            rngs=nnx.Rngs(0))


def test_settings_the_chunks_cannot_run_with_raise():
  x = _x()
  no_bound = CPLayout(cp_axis=None, backend="xla")
  with pytest.raises(ValueError, match="layer_chunk_size=32 needs a bound"):
    cp_linen.TransformerLayer(**LAYER, layout=no_bound,
                              layer_chunk_size=32).init(
                                  jax.random.key(0), x, CU, CU_P)
  with pytest.raises(ValueError, match=r"layer_chunk_size=20 must be at "
                     r"least the halo of 29 tokens"):
    cp_linen.TransformerLayer(**LAYER, layout=BOUND,
                              layer_chunk_size=20).init(
                                  jax.random.key(0), x, CU, CU_P)
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cp2 = CPLayout(mesh=mesh, backend="xla", max_seqlen=30,
                 strategy=S.NO_LOAD_BALANCE)
  with pytest.raises(ValueError, match="layout has cp size 2"):
    with jax.set_mesh(mesh):
      cp_nnx.TransformerLayer(**LAYER, in_features=E, layout=cp2,
                              layer_chunk_size=32, rngs=nnx.Rngs(0))(
                                  x, CU, CU_P)


def test_a_longer_concrete_document_raises():
  layout = CPLayout(cp_axis=None, backend="xla", max_seqlen=25)
  with pytest.raises(ValueError, match="smaller than the longest padded "
                     "document"):
    cp_linen.TransformerLayer(**LAYER, layout=layout,
                              layer_chunk_size=32).init(
                                  jax.random.key(0), _x(), CU, CU_P)


def test_a_longer_traced_document_turns_nan():
  """Traced metadata with a 30-token document against ``max_seqlen=25``:
  NaN outputs and gradients (never a silently wrong answer)."""
  layout = CPLayout(cp_axis=None, backend="xla", max_seqlen=25)
  m = cp_linen.TransformerLayer(**LAYER, layout=layout, layer_chunk_size=32)
  ok = CPLayout(cp_axis=None, backend="xla", max_seqlen=30)
  params = jax.jit(lambda x: cp_linen.TransformerLayer(
      **LAYER, layout=ok).init(jax.random.key(0), x, CU, CU_P))(_x())
  loss = lambda p, x, cu, cuP: jnp.sum(m.apply(p, x, cu, cuP))
  v, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
      params, _x(), CU, CU_P)
  assert np.isnan(float(v)) and bool(jnp.isnan(g[1]).all())
  # Within the bound the same traced step is finite.
  fine = m.clone(layout=ok)
  v = jax.jit(lambda p, x, cu, cuP: jnp.sum(fine.apply(p, x, cu, cuP)))(
      params, _x(), CU, CU_P)
  assert np.isfinite(float(v))


# ------------------------------------------------- the chunk's attention


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("q_start, queries, halo, whole_halo, left", [
    (32, 32, 29, True, -1),     # row 1's document [30, 41) straddles
    (35, 30, 29, True, -1),     # its first query reads the halo's first key
    (35, 30, 29, True, 40),     # a window wider than the bound
    (36, 20, 6, False, 6),      # a window bounds the halo
    (90, 6, 7, False, 7)])      # a chunk shorter than its halo
def test_chunk_attention_equals_plain_attention(q_start, queries, halo,
                                                 whole_halo, left):
  """One chunk's attention (a top-left chunk call and a halo call, merged)
  against plain masked attention over the whole rows in float32: the
  chunk's rows of the output, and the gradients of every query of the
  chunk and every key and value of its window."""
  rng = np.random.default_rng(3)
  hq, hkv, d = 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal((2, T, h, d)), jnp.float32)
             for h in (hq, hkv, hkv))
  w = jnp.asarray(rng.standard_normal((2, queries, hq, d)), jnp.float32)
  a, b, lo = q_start, q_start + queries, q_start - halo
  seg = [jnp.stack(x) for x in zip(*(
      layer_chunks.chunk_segments(CU[r], CU_P[r], a, lo, queries)
      for r in range(2)))]
  bound = 30 if whole_halo else queries
  spec = chunk_attention.Spec(
      backend=resolve_backend("xla"), scale=d ** -0.5, window_left=left,
      halo=halo, max_q=min(bound, queries), whole_halo=whole_halo)

  def ours(qc, kw, vw):
    return jnp.sum(chunk_attention.chunk_attention(qc, kw, vw, seg, spec)
                   * w)

  def plain(qc, kw, vw):
    full = reference.batched_attention(
        q.at[:, a:b].set(qc), k.at[:, lo:b].set(kw), v.at[:, lo:b].set(vw),
        CU, CU_P, window=left)
    return jnp.sum(full[:, a:b] * w)

  args = (q[:, a:b], k[:, lo:b], v[:, lo:b])
  got = jax.value_and_grad(ours, argnums=(0, 1, 2))(*args)
  with jax.default_matmul_precision("highest"):
    want = jax.value_and_grad(plain, argnums=(0, 1, 2))(*args)
  _close(got[1], want[1], rtol=1e-5)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
  assert float(jnp.abs(got[1][1][:, :halo]).max()) > 0   # the halo's dK


@pytest.mark.slow    # every plan of the chunked layer traced
def test_layer_chunks_run_no_bottom_right_call(monkeypatch):
  """Every attention call of a chunked layer, forward and backward, is
  top-left causal or unmasked (a bottom-right backward is the slow one
  on cuDNN), with and without a sliding window."""
  xla = resolve_backend("xla")
  masks = []

  def spy(real):
    def call(*args, **kwargs):
      masks.append(kwargs["mask"])
      return real(*args, **kwargs)
    return call

  monkeypatch.setitem(registry._BACKENDS, "xla", dataclasses.replace(
      xla, forward=spy(xla.forward), backward=spy(xla.backward)))
  for window in (None, (5, 0)):
    step, params, x = _linen(29, window=window)
    jax.jit(step)(params, x)
  assert masks and set(masks) <= {"causal_top_left", "no_mask"}, masks
  assert "no_mask" in masks and "causal_top_left" in masks


def test_chunk_segments():
  """Queries [32, 64) with keys from 3: each document's valid queries in
  the chunk, its keys from its first token (or 3) to its last query."""
  got = [np.asarray(a) for a in layer_chunks.chunk_segments(
      CU[1], CU_P[1], 32, 3, 32)]
  # Valid tokens: [0,30) [30,41) [41,59) [60,66) [66,94) and an empty slot.
  want = ([0, 9, 18, 4, 0, 0],          # q_seqlens
          [0, 11, 18, 4, 0, 0],         # kv_seqlens
          [0, 0, 9, 28, 0, 0],          # q_offsets (from 32)
          [0, 27, 38, 57, 0, 0])        # kv_offsets (from 3)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
