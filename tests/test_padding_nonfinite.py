"""Padding tokens reach no valid output (xla backend, CPU).

NaN and infinities at padding tokens of q, k and v, or of the output's
cotangent, leave every valid output and gradient exactly those of the
clean run, which matches plain masked attention on the unpartitioned rows
(tests/reference.py; float64 numpy for fused_attention's forward); the
padding tokens' own outputs and gradients are 0. Covered:
``fused_attention`` (ragged segments, a tiled one-document row, a
window, the inference form) and ``cp_attention`` at cp = 1, 2, 4 under
both strategies with the all-gather, ring and halo exchanges and sliding
windows. The rows hold padding at the end of document slots and a
trailing slot with no valid token (a MaxText row's padding), and empty
slots after it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention.decompose import chunk_attention
from jax_cp.attention.registry import resolve_backend
from jax_cp.cp.config import make_config
from jax_cp.data import reorder_for_cp, restore_from_cp
from jax_cp.modules import layer_chunks
from tests import reference as ref
from tests.test_cp_attention import mesh_for
from tests.test_fused_attention import np_reference

T, HQ, HKV, D = 64, 4, 2, 16
UNIT = 8           # every padded slot a multiple of 2 * cp for cp <= 4
TOL = 1e-4         # relative error against the reference (float32)
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP


def padded_rows(rng, batch, total=T, max_slot=3 * UNIT):
  """``(cu, cuP)`` ``[batch, N+1]``: slots of multiples of ``UNIT`` tokens
  up to ``max_slot``, each with padding at its end (at least one token
  in one slot per row), a last slot with no valid token, and two empty
  slots after it."""
  cus, cuPs = [], []
  for _ in range(batch):
    tail = UNIT * int(rng.integers(1, 3))
    plens, left = [], total - tail
    while left > 0:
      p = min(left, UNIT * int(rng.integers(1, max_slot // UNIT + 1)))
      plens.append(p)
      left -= p
    lens = [int(rng.integers(1, p + 1)) for p in plens]
    i = int(rng.integers(len(lens)))
    lens[i] = int(rng.integers(1, plens[i]))
    cus.append(np.cumsum([0] + lens + [0]))
    cuPs.append(np.cumsum([0] + plens + [tail]))
  n = max(len(c) for c in cus) + 2      # empty slots after the last one
  fill = lambda rows: np.stack([np.pad(r, (0, n - len(r)), mode="edge")
                                for r in rows]).astype(np.int32)
  return fill(cus), fill(cuPs)


def valid_mask(cu, cuP):
  return np.stack([ref.valid_token_mask(c, p) for c, p in zip(cu, cuP)])


def dirty(rng, x, padding):
  """``x`` with NaN, +inf or -inf in every element of about half of the
  ``padding`` tokens (bool ``[B, T]``; at least one per row)."""
  x = np.array(x)
  pick = padding & (rng.random(padding.shape) < 0.5)
  for r in range(padding.shape[0]):
    pick[r, np.flatnonzero(padding[r])[-1]] = True    # the trailing slot
  bad = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32),
                   size=x.shape)
  x[pick] = bad[pick]
  return x


def inputs(rng, batch=2):
  q = rng.standard_normal((batch, T, HQ, D)).astype(np.float32)
  k = rng.standard_normal((batch, T, HKV, D)).astype(np.float32)
  v = rng.standard_normal((batch, T, HKV, D)).astype(np.float32)
  w = rng.standard_normal((batch, T, HQ, D)).astype(np.float32)
  return q, k, v, w


def run_three(f, q, k, v, w, padding, rng):
  """``f(q, k, v, w) -> (out, dq, dk, dv)`` on the clean inputs, with
  non-finite padding tokens in q, k and v, and with them in the
  cotangent ``w``."""
  clean = f(q, k, v, w)
  bad_qkv = f(dirty(rng, q, padding), dirty(rng, k, padding),
              dirty(rng, v, padding), w)
  bad_dout = f(q, k, v, dirty(rng, w, padding))
  return clean, bad_qkv, bad_dout


def check(clean, bad_qkv, bad_dout, want, valid):
  """Both poisoned runs equal the clean one on valid tokens, are 0 on the
  padding ones; the clean run matches the reference ``want``. ``valid``:
  the valid tokens of all four results, or a mask per result."""
  names = ("out", "dq", "dk", "dv")
  masks = valid if isinstance(valid, tuple) else (valid,) * 4
  for got, w, name, valid in zip(clean, want, names, masks):
    got, w = np.asarray(got), np.asarray(w)
    err = ref.rel_err(got[valid], w[valid])
    assert err < TOL, f"{name}: relative error {err:.2e} to the reference"
  for run, what in ((bad_qkv, "q/k/v"), (bad_dout, "dout")):
    for got, c, name, valid in zip(run, clean, names, masks):
      got, c = np.asarray(got), np.asarray(c)
      leaked = int(np.sum(~np.isfinite(got[valid])))
      assert leaked == 0, (f"{name}: {leaked} non-finite valid values with "
                           f"non-finite padding in {what}")
      np.testing.assert_array_equal(got[valid], c[valid],
                                    err_msg=f"{name}, padding in {what}")
      np.testing.assert_array_equal(got[~valid], 0.0,
                                    err_msg=f"{name}, padding in {what}")


def reference_grads(q, k, v, w, cu, cuP, window=-1):
  f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP, window=window)
  out, vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v)))
  return (out,) + vjp(jnp.asarray(w))


def np_reference_out(q, k, v, cu, cuP, window=-1):
  """float64 forward per row and document, independent of jax."""
  out = []
  for r in range(q.shape[0]):
    lens, offs = np.diff(cu[r]), cuP[r][:-1]
    o, _ = np_reference(q[r], k[r], v[r], lens, lens, offs, offs,
                        "causal_bottom_right", 1 / np.sqrt(D))
    out.append(o)
  assert window < 0
  return np.stack(out)


@pytest.mark.parametrize("form", ["ragged", "tiled", "window", "inference"])
def test_fused_attention_ignores_padding(form):
  rng = np.random.default_rng(11)
  cu, cuP = padded_rows(rng, 2)
  window = 5 if form == "window" else -1
  if form == "tiled":
    # One document from each row's start, padding at its end; the offset
    # stated by None (the dense graph on cuDNN).
    lens = np.array([[T - 13], [T - 1]], np.int32)
    cu = np.concatenate([np.zeros((2, 1), np.int32), lens], axis=1)
    cuP = np.array([[0, T], [0, T]], np.int32)
  q, k, v, w = inputs(rng)
  valid = valid_mask(cu, cuP)

  def attn(q, k, v, lens, offs):
    kw = dict(backend="xla", window_size=None if window < 0 else (window, 0))
    if form == "tiled":
      return jax_cp.fused_attention(q, k, v, lens, lens, **kw)
    if form == "inference":
      return jax_cp.fused_attention(q, k, v, lens, lens, offs, offs, **kw)
    return jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                  return_lse=True, **kw)[0]

  @jax.jit
  def f(q, k, v, w, lens, offs):
    out, vjp = jax.vjp(lambda *a: attn(*a, lens, offs), q, k, v)
    return (out,) + vjp(w)

  lens, offs = np.diff(cu, axis=1), cuP[:, :-1]
  g = lambda q, k, v, w: f(q, k, v, w, lens, offs)
  runs = run_three(g, q, k, v, w, ~valid, rng)
  want = reference_grads(q, k, v, w, cu, cuP, window)
  check(*runs, want, valid)
  if window < 0:
    np.testing.assert_allclose(np.asarray(runs[0][0]),
                               np_reference_out(q, k, v, cu, cuP),
                               atol=2e-5, rtol=2e-5)
  if form == "inference":     # the forward alone: backend.forward_out
    out = jax.jit(lambda *a: attn(*a, lens, offs))(
        dirty(rng, q, ~valid), dirty(rng, k, ~valid), dirty(rng, v, ~valid))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(runs[0][0]))


CP_CASES = [
    # cp, strategy, comm_type, max_seqlen, window
    (1, DCS, "all_gather", None, None),
    (2, DCS, "all_gather", None, None),
    (4, DCS, "all_gather", None, None),
    (2, DCS, "ring", None, None),
    (4, DCS, "ring", None, None),
    (4, DCS, "all_gather", None, 5),           # compact near/far calls
    (2, NLB, "all_gather", None, None),
    (4, NLB, "all_gather", None, None),
    (4, NLB, "ring", None, None),
    (4, NLB, "all_gather", 3 * UNIT, None),    # the halo exchange
    (4, NLB, "all_gather", None, 5),           # a window's halo
]


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize(
    "cp,strategy,comm_type,max_seqlen,window", CP_CASES,
    ids=[f"cp{c}-{s.value}-{x}-w{m}-win{n}" for c, s, x, m, n in CP_CASES])
def test_cp_attention_ignores_padding(cp, strategy, comm_type, max_seqlen,
                                      window):
  rng = np.random.default_rng(cp * 31 + len(comm_type) + (window or 0))
  cu, cuP = padded_rows(rng, 2)
  q, k, v, w = inputs(rng)
  valid = valid_mask(cu, cuP)
  layout = CPLayout(mesh=mesh_for(cp, 1), batch_axis="data",
                    strategy=strategy, backend="xla", max_seqlen=max_seqlen,
                    comm_type=comm_type)
  if max_seqlen is not None:
    assert make_config(layout, q, k, v, cu, cuP, cp_size=cp, total_tokens=T,
                       attn_mask_type="causal", softmax_scale=None,
                       window_size=None, trusted=False
                       ).exchange.kind == "halo"
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)
  window_size = None if window is None else (window, 0)

  @jax.jit
  def f(q, k, v, w, cu, cuP):    # metadata traced
    attn = lambda q, k, v: jax_cp.cp_attention(
        q, k, v, (cu, cuP), layout=layout, window_size=window_size)
    out, vjp = jax.vjp(attn, q, k, v)
    return (out,) + vjp(w)

  g = lambda *a: tuple(back(x) for x in f(*(re(x) for x in a), cu, cuP))
  runs = run_three(g, q, k, v, w, ~valid, rng)
  want = reference_grads(q, k, v, w, cu, cuP,
                         -1 if window is None else window)
  check(*runs, want, valid)


def ranks_on_one_device(cu, cuP, *, cp, strategy, backend, comm_type,
                        max_seqlen=None, window=None):
  """``f(q, k, v, w) -> (out, dq, dk, dv)`` over rows ``[B, T, H, D]`` in
  physical order, the ``cp`` ranks of the local view run as a
  ``jax.vmap`` over their chunks on one device (the collectives batch over
  the named axis): every exchange and call of the plans where one GPU is
  all there is (tests/gpu/test_padding_nonfinite_cudnn.py)."""
  layout = CPLayout(cp_size=cp, strategy=strategy, view="local",
                    backend=backend, comm_type=comm_type,
                    max_seqlen=max_seqlen)
  order = CPLayout(cp_size=cp, strategy=strategy)
  window_size = None if window is None else (window, 0)

  def chunks(x):
    x = reorder_for_cp(x, cuP, order, seq_dim=1)
    x = x.reshape((x.shape[0], cp, x.shape[1] // cp) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  def back(x):
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape((x.shape[0], -1) + x.shape[3:])
    return restore_from_cp(x, cuP, order, seq_dim=1)

  def rank(q, k, v, w):
    attn = lambda q, k, v: jax_cp.cp_attention(
        q, k, v, (cu, cuP), layout=layout, window_size=window_size)
    out, vjp = jax.vjp(attn, q, k, v)
    return (out,) + vjp(w.astype(out.dtype))

  step = jax.jit(jax.vmap(rank, axis_name="cp"))
  return lambda *a: tuple(back(x) for x in step(*(chunks(x) for x in a)))


LOCAL_CASES = [
    # cp, strategy, comm_type, max_seqlen, window
    (4, DCS, "all_gather", None, None),
    (2, DCS, "ring", None, None),
    (4, NLB, "ring", 3 * UNIT, None),          # fewer ring steps
]


@pytest.mark.parametrize(
    "cp,strategy,comm_type,max_seqlen,window", LOCAL_CASES,
    ids=[f"cp{c}-{s.value}-{x}-w{m}-win{n}" for c, s, x, m, n in LOCAL_CASES])
def test_local_view_ignores_padding(cp, strategy, comm_type, max_seqlen,
                                    window):
  """The local view, its ranks as a ``vmap`` on one device (the harness of
  the GPU test; the halo exchange's partial permutes do not batch so)."""
  rng = np.random.default_rng(cp + len(comm_type))
  cu, cuP = padded_rows(rng, 2)
  q, k, v, w = inputs(rng)
  valid = valid_mask(cu, cuP)
  f = ranks_on_one_device(cu, cuP, cp=cp, strategy=strategy, backend="xla",
                          comm_type=comm_type, max_seqlen=max_seqlen,
                          window=window)
  runs = run_three(f, q, k, v, w, ~valid, rng)
  check(*runs, reference_grads(q, k, v, w, cu, cuP), valid)


@pytest.mark.parametrize("q_start, queries, halo, whole_halo, left", [
    (32, 16, 3 * UNIT - 1, True, -1),     # the bound's halo: a rectangle
    (40, 16, 5, False, 5)])               # a window's halo: reversed
def test_layer_chunk_attention_ignores_padding(q_start, queries, halo,
                                               whole_halo, left):
  """A layer chunk's attention (``layer_chunk_size``): its queries and its
  window's keys and values, against the whole rows' reference."""
  rng = np.random.default_rng(q_start)
  cu, cuP = padded_rows(rng, 2)
  q, k, v, _ = inputs(rng)
  w = rng.standard_normal((2, queries, HQ, D)).astype(np.float32)
  a, b, lo = q_start, q_start + queries, q_start - halo
  seg = [jnp.stack(x) for x in zip(*(
      layer_chunks.chunk_segments(cu[r], cuP[r], a, lo, queries)
      for r in range(2)))]
  spec = chunk_attention.Spec(
      backend=resolve_backend("xla"), scale=D ** -0.5, window_left=left,
      halo=halo, max_q=min(3 * UNIT, queries), whole_halo=whole_halo)

  @jax.jit
  def f(qc, kw, vw, w):
    out, vjp = jax.vjp(
        lambda *a: chunk_attention.chunk_attention(*a, seg, spec),
        qc, kw, vw)
    return (out,) + vjp(w)

  def plain(qc, kw, vw):
    put = lambda x, lo, y: jnp.asarray(x).at[:, lo:b].set(y)
    full = ref.batched_attention(put(q, a, qc), put(k, lo, kw),
                                 put(v, lo, vw), cu, cuP, window=left)
    return full[:, a:b]

  args = (q[:, a:b], k[:, lo:b], v[:, lo:b])
  out, vjp = jax.vjp(plain, *(jnp.asarray(x) for x in args))
  want = (out,) + vjp(jnp.asarray(w))
  valid = valid_mask(cu, cuP)
  vq, vkv = valid[:, a:b], valid[:, lo:b]
  assert (~vq).any() and (~vkv[:, :halo]).any()   # padding in both parts
  clean = f(*args, w)
  bad_qkv = f(dirty(rng, args[0], ~vq), dirty(rng, args[1], ~vkv),
              dirty(rng, args[2], ~vkv), w)
  bad_dout = f(*args, dirty(rng, w, ~vq))
  check(clean, bad_qkv, bad_dout, want, (vq, vq, vkv, vkv))


def test_concrete_metadata_without_padding_clear_nothing():
  """Concrete metadata with no padding token: no pass over q, k, v; with
  padding, or traced: cleared (``CPConfig.zero_padding``)."""
  rng = np.random.default_rng(3)
  cu, cuP = padded_rows(rng, 1)
  q, k, v, _ = inputs(rng, 1)
  layout = CPLayout(cp_axis=None, backend="xla")
  config = lambda cu, cuP: make_config(
      layout, q, k, v, cu, cuP, cp_size=1, total_tokens=T,
      attn_mask_type="causal", softmax_scale=None, window_size=None,
      trusted=False)
  assert config(cu, cuP).zero_padding
  assert not config(cuP, cuP).zero_padding
  traced = []
  jax.jit(lambda cu: traced.append(config(cu, cuP).zero_padding) or cu)(cuP)
  assert traced == [True]
