"""GPU tests (marker gpu): padding tokens reach no valid output on the
cudnn backend.

NaN and infinities at padding tokens of q, k and v, or of the output's
cotangent, leave every output and gradient finite: 0 on padding tokens
and, on valid ones, those of the xla backend in float32 on the same
(clean, bfloat16-rounded) inputs, which matches plain masked attention on
the unpartitioned rows (tests/reference.py). Covered: ``fused_attention``
on ragged segments, on tiled rows (one document from each row's start,
padding at its end: cuDNN's dense graph, which reads every row), its
inference form; ``cp_attention`` at cp = 1 (ragged and tiled) and, with
the ranks of the local view run as a ``vmap`` on one GPU
(``tests.test_padding_nonfinite.ranks_on_one_device``), at cp = 2 and 4
under both strategies with the all-gather and ring exchanges and a
window; the halo exchange over a mesh of 4 GPUs where there are.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import CPLayout  # noqa: E402
from jax_cp import CPLoadBalancingStrategy as S  # noqa: E402
from jax_cp.data import reorder_for_cp, restore_from_cp  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests._devices import devices  # noqa: E402
from tests.test_padding_nonfinite import (  # noqa: E402
  dirty,
  ranks_on_one_device,
)

T, HQ, HKV, D = 1024, 8, 2, 64
UNIT = 8              # every padded slot a multiple of 2 * cp for cp <= 4
TOL = 2e-2            # bfloat16 against float32
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP


def padded_rows(rng, batch, max_slot=256):
  """``(cu, cuP)`` ``[batch, N+1]``: slots of multiples of ``UNIT`` up to
  ``max_slot`` tokens, most with padding at their end, a last slot of
  padding alone (no valid token), then empty slots."""
  cus, cuPs = [], []
  for _ in range(batch):
    tail = UNIT * int(rng.integers(1, 9))
    plens, left = [], T - tail
    while left > 0:
      p = min(left, UNIT * int(rng.integers(1, max_slot // UNIT + 1)))
      plens.append(p)
      left -= p
    lens = [int(rng.integers(max(1, p - 3 * UNIT), p + 1)) for p in plens]
    cus.append(np.cumsum([0] + lens + [0]))
    cuPs.append(np.cumsum([0] + plens + [tail]))
  n = max(len(c) for c in cus) + 2
  fill = lambda rows: np.stack([np.pad(r, (0, n - len(r)), mode="edge")
                                for r in rows]).astype(np.int32)
  return fill(cus), fill(cuPs)


def one_document_rows(lens):
  """``(cu, cuP)`` of one document per row from its start, padding after
  it."""
  lens = np.asarray(lens, np.int32)
  cu = np.stack([np.zeros_like(lens), lens], axis=1)
  return cu, np.tile(np.array([0, T], np.int32), (len(lens), 1))


def inputs(rng, batch):
  """bfloat16 q, k, v and a float32 cotangent ``w``, ``[batch, T, H, D]``."""
  mk = lambda h: rng.standard_normal((batch, T, h, D)).astype(np.float32)
  q, k, v = (np.asarray(jnp.asarray(mk(h), jnp.bfloat16), np.float32)
             for h in (HQ, HKV, HKV))
  return q, k, v, mk(HQ)


def check(f, want_f, q, k, v, w, cu, cuP, rng):
  """``f`` (cudnn, bfloat16) on the clean inputs, with non-finite values at
  padding tokens of q, k and v, and of the cotangent: finite everywhere,
  0 on padding tokens, and on valid ones the xla float32 run ``want_f``
  on the clean inputs."""
  valid = np.stack([ref.valid_token_mask(c, p) for c, p in zip(cu, cuP)])
  pad = ~valid
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  want = [np.asarray(x, np.float32) for x in want_f(q, k, v, w)]
  runs = {
      "clean": (q, k, v, w),
      "q/k/v": (dirty(rng, q, pad), dirty(rng, k, pad), dirty(rng, v, pad),
                w),
      "dout": (q, k, v, dirty(rng, w, pad)),
  }
  for what, (q_, k_, v_, w_) in runs.items():
    got = f(bf(q_), bf(k_), bf(v_), jnp.asarray(w_))
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, want):
      g = np.asarray(g, np.float32)
      assert np.isfinite(g).all(), (
          f"{name}: {int(np.sum(~np.isfinite(g)))} non-finite values, "
          f"non-finite padding in {what}")
      err = ref.rel_err(g[valid], e[valid])
      assert err < TOL, (name, what, err)
      np.testing.assert_array_equal(g[pad], 0.0,
                                    err_msg=f"{name}, padding in {what}")


def vjp_of(attn):
  """``(q, k, v, w) -> (out, dq, dk, dv)`` of ``attn(q, k, v)``, jitted."""
  @jax.jit
  def f(q, k, v, w):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out,) + vjp(w.astype(out.dtype))
  return f


def reference_of(cu, cuP, window=-1):
  """The xla float32 run's ground: plain masked attention (float32)."""
  f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP, window=window)
  return vjp_of(f)


@pytest.mark.parametrize("form", ["ragged", "tiled", "tiled_concrete",
                                  "inference"])
def test_fused_attention_cudnn_ignores_padding(form):
  rng = np.random.default_rng(len(form))
  if form.startswith("tiled"):
    cu, cuP = one_document_rows([T - 1, 700, 1])
  else:
    cu, cuP = padded_rows(rng, 2)
  q, k, v, w = inputs(rng, cu.shape[0])
  lens, offs = np.diff(cu, axis=1), cuP[:, :-1]

  def attn(backend, lens, offs):
    def call(q, k, v):
      kw = dict(backend=backend)
      if form == "tiled":
        return jax_cp.fused_attention(q, k, v, lens, lens, **kw)
      if form == "inference":
        return jax_cp.fused_attention(q, k, v, lens, lens, offs, offs, **kw)
      return jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                    return_lse=True, **kw)[0]
    return call

  if form == "tiled_concrete":      # concrete zero offsets: tiled too
    text = jax.jit(attn("cudnn", lens, offs)).lower(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))).as_text()
    assert "tiled = 1" in text
    f = vjp_of(attn("cudnn", lens, offs))
  else:                             # traced metadata
    traced = jax.jit(lambda q, k, v, w, lens, offs: vjp_of(
        attn("cudnn", lens, offs))(q, k, v, w))
    f = lambda *a: traced(*a, lens, offs)
  want = vjp_of(attn("xla", lens, offs))
  check(f, want, q, k, v, w, cu, cuP, rng)
  np.testing.assert_allclose(
      np.asarray(want(q, k, v, w)[0]),
      np.asarray(reference_of(cu, cuP)(q, k, v, w)[0]), atol=1e-4,
      rtol=1e-4)
  if form == "inference":           # the forward alone: forward_out
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    pad = np.stack([~ref.valid_token_mask(c, p) for c, p in zip(cu, cuP)])
    out = jax.jit(attn("cudnn", lens, offs))(
        bf(dirty(rng, q, pad)), bf(dirty(rng, k, pad)),
        bf(dirty(rng, v, pad)))
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[pad], 0.0)


@pytest.mark.parametrize("rows", ["ragged", "tiled"])
def test_cp1_cudnn_ignores_padding(rows):
  """cp = 1: rows of one slot each run the tiled (dense) graph."""
  rng = np.random.default_rng(7)
  cu, cuP = (one_document_rows([T - 5, 300]) if rows == "tiled"
             else padded_rows(rng, 2))
  q, k, v, w = inputs(rng, cu.shape[0])
  attn = lambda backend: lambda q, k, v: jax_cp.cp_attention(
      q, k, v, (cu, cuP), layout=CPLayout(cp_axis=None, backend=backend))
  check(vjp_of(attn("cudnn")), vjp_of(attn("xla")), q, k, v, w, cu, cuP,
        rng)


# The all-gather's unwindowed plans write rows in place (aliased custom
# calls: `into`, `dq_into`, `merge_rows`), which a `vmap` over ranks on one
# device cannot run; they run on a mesh of GPUs below.
EMULATED = [
    # cp, strategy, comm_type, max_seqlen, window
    (4, DCS, "all_gather", None, 37),       # compact near/far calls
    (2, DCS, "ring", None, None),
    (4, DCS, "ring", None, None),
    (4, NLB, "ring", None, None),
    (4, NLB, "ring", 512, None),            # fewer ring steps
]


@pytest.mark.parametrize(
    "cp,strategy,comm_type,max_seqlen,window", EMULATED,
    ids=[f"cp{c}-{s.value}-{x}-w{m}-win{n}" for c, s, x, m, n in EMULATED])
def test_cp_cudnn_ignores_padding_ranks_on_one_gpu(cp, strategy, comm_type,
                                                   max_seqlen, window):
  rng = np.random.default_rng(cp * 13 + len(comm_type) + (window or 0))
  cu, cuP = padded_rows(rng, 2)
  q, k, v, w = inputs(rng, 2)
  run = functools.partial(ranks_on_one_device, cu, cuP, cp=cp,
                          strategy=strategy, comm_type=comm_type,
                          max_seqlen=max_seqlen, window=window)
  check(run(backend="cudnn"), run(backend="xla"), q, k, v, w, cu, cuP, rng)


MESH = [
    # cp, strategy, max_seqlen, window
    (4, NLB, 256, None),          # the halo exchange, a bound
    (4, NLB, None, 37),           # the halo exchange, a window
    (2, NLB, None, None),         # the all-gather, rows merged in place
    (4, NLB, None, None),
    (2, DCS, None, None),         # the all-gather, calls into earlier rows
    (4, DCS, None, None),
]


@pytest.mark.parametrize(
    "cp,strategy,max_seqlen,window", MESH,
    ids=[f"cp{c}-{s.value}-w{m}-win{n}" for c, s, m, n in MESH])
def test_cp_cudnn_ignores_padding_on_gpus(cp, strategy, max_seqlen, window):
  """The exchanges that write rows in place, over a mesh of ``cp`` GPUs:
  NO_LOAD_BALANCE's halo (a bound, or a window) and the all-gather of
  both strategies."""
  gpus = devices(cp, "gpu")
  rng = np.random.default_rng(41 + cp + (window or 0) + (max_seqlen or 0))
  cu, cuP = padded_rows(rng, 2)
  q, k, v, w = inputs(rng, 2)
  mesh = jax.make_mesh((cp,), ("cp",), devices=gpus,
                       axis_types=(jax.sharding.AxisType.Auto,))

  def run(backend):
    layout = CPLayout(mesh=mesh, strategy=strategy, backend=backend,
                      max_seqlen=max_seqlen)
    ws = None if window is None else (window, 0)
    attn = lambda q, k, v: jax_cp.cp_attention(
        q, k, v, (cu, cuP), layout=layout, window_size=ws)
    f = vjp_of(attn)
    re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
    back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)
    return lambda *a: tuple(back(x) for x in f(*(re(x) for x in a)))

  check(run("cudnn"), run("xla"), q, k, v, w, cu, cuP, rng)
