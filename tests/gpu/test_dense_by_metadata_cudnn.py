"""GPU tests: calls that choose the dense (tiled) cuDNN graph on the device
from their traced metadata (``Segments.tile_rows``; docs/internals.md,
Tiled calls) against plain masked attention in float32 (marker gpu).

Where every row holds one document from its start (among empty document
slots, or with its offsets as jit arguments) filling nearly all of it, the
dense branch runs; shorter documents, empty rows and two documents in a
row take the ragged one. Both must match the reference and
the backend that never chooses the dense graph (the graphs of before),
with the rows past a document exactly 0 in out and every gradient, fwd
and fwd+bwd, D = 64 and 128, bfloat16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend = cudnn_backend_or_skip()

import jax_cp
from benchmarks.bench_fused import ragged_only_backend
from jax_cp.attention.backend import row_segments
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference
from tests._devices import devices

TOL = 2e-2
T, HQ, HKV = 384, 8, 2

#: Per case: per row, the valid lengths of its documents (one slot per
#: entry; zeros are empty slots) and whether the dense branch runs: every
#: row one document from its start, filling nearly all of the row's work
#: (cudnn.TILED_MIN_WORK_SHARE); padding rows past the shorter ones.
CASES = {
    "full_rows": ([[T, 0, 0], [T, 0, 0], [T, 0, 0]], True),
    "nearly_full_rows": ([[T, 0, 0], [380, 0, 0], [383, 0, 0]], True),
    "short_document": ([[T, 0, 0], [250, 0, 0], [1, 0, 0]], False),
    "empty_row": ([[T, 0, 0], [0, 0, 0], [77, 0, 0]], False),
    "two_docs": ([[200, 184, 0], [T, 0, 0], [90, 100, 0]], False),
    # 23 full rows and an empty one: the dense branch with an empty tile.
    "one_empty_of_24": ([[T, 0, 0]] * 23 + [[0, 0, 0]], True),
}


def _metadata(lens):
  """cu/cuP [B, N+1] of rows whose documents have these valid lengths,
  the last one padded to the row, and the slots' lengths and offsets."""
  lens = np.asarray(lens, np.int32)
  cu = np.concatenate([np.zeros((len(lens), 1), np.int32),
                       np.cumsum(lens, axis=1, dtype=np.int32)], axis=1)
  cuP = cu.copy()
  for row in cuP:   # the last document with tokens reaches the row's end
    last = max(int(np.flatnonzero(np.diff(row))[-1]) if np.diff(row).any()
               else 0, 0)
    row[last + 1:] = T
  return cu, cuP, lens, cuP[:, :-1]


def _holds(lens, offs, mask):
  """Whether the device picks the dense branch for these slots."""
  seg = row_segments(lens, lens, offs, offs, T, T, T, T, may_tile=True)
  return bool(cudnn_backend.tiled_choice(seg, mask, len(lens) * T,
                                         len(lens) * T)[0])


def _inputs(b, d, lens, seed):
  rng = np.random.default_rng(seed)
  mk = lambda h, dt=jnp.bfloat16: jnp.asarray(
      rng.standard_normal((b, T, h, d)), dt)
  q, k, v, w = mk(HQ), mk(HKV), mk(HKV), mk(HQ, jnp.float32)
  # Large cotangents on padding rows must not reach any gradient.
  valid = np.arange(T)[None, :] < np.asarray(lens).sum(axis=1)[:, None]
  w = jnp.where(jnp.asarray(~valid)[..., None, None], w * 1e4, w)
  return q, k, v, w, valid


def _check(got_out, got_grads, cu, cuP, q, k, v, w, valid, other=None):
  ref_fn = lambda q, k, v: reference.batched_attention(q, k, v, cu, cuP)
  want, vjp = jax.vjp(ref_fn, q, k, v)
  assert reference.rel_err(got_out, want) < TOL
  assert np.all(np.asarray(got_out, np.float32)[~valid] == 0)
  for i, (name, got, exp) in enumerate(zip("qkv", got_grads, vjp(w))):
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), name
    assert reference.rel_err(got, exp) < TOL, name
    assert np.all(got[~valid] == 0), name
    if other is not None:
      assert reference.rel_err(got, other[i]) < TOL, name


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mask", ["causal_top_left", "causal_bottom_right"])
def test_fused_attention_with_traced_offsets(case, d, mask):
  """fused_attention with lengths and offsets as jit arguments, the rows
  as the bounds: out (the inference form) and the gradients (forward
  with lse, backward) against the reference and the ragged-only backend."""
  lens_rows, holds = CASES[case]
  cu, cuP, lens, offs = _metadata(lens_rows)
  assert _holds(lens, offs, mask) == holds
  q, k, v, w, valid = _inputs(len(lens), d, lens, seed=d + len(case))

  def run(backend):
    def attn(q, k, v, lens, offs):
      return jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                    attn_mask_type=mask, backend=backend)
    loss = lambda q, k, v, w, lens, offs: jnp.sum(
        attn(q, k, v, lens, offs).astype(jnp.float32) * w)
    args = (jnp.asarray(lens), jnp.asarray(offs))
    out = jax.jit(attn)(q, k, v, *args)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, w, *args)
    return out, grads

  text = jax.jit(jax.grad(lambda q, k, v, lens, offs: jnp.sum(
      jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                             attn_mask_type=mask, backend="cudnn").astype(
                                 jnp.float32)), argnums=(0, 1, 2))).lower(
      q, k, v, jnp.asarray(lens), jnp.asarray(offs)).as_text()
  assert text.count("tiled = 1") == 2 and "stablehlo.case" in text
  out, grads = run("cudnn")
  _, ragged_grads = run(ragged_only_backend("cudnn"))
  _check(out, grads, cu, cuP, q, k, v, w, valid, ragged_grads)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_cp_attention_document_slots_at_cp1(case, d):
  """cp_attention at cp=1 with a host-checked batch of document slots as
  jit arguments, the row as the bound, as a training step passes it."""
  lens_rows, holds = CASES[case]
  cu, cuP, lens, offs = _metadata(lens_rows)
  assert _holds(lens, offs, "causal_top_left") == holds
  q, k, v, w, valid = _inputs(len(lens), d, lens, seed=2 * d + len(case))
  layout = jax_cp.CPLayout(cp_axis=None, backend="cudnn", max_seqlen=T)
  batch = jax_cp.CPBatch(None, cuP, cu, layout=layout).check_on_host()

  def loss(q, k, v, w, batch):
    o = jax_cp.cp_attention(q, k, v, batch)
    return jnp.sum(o.astype(jnp.float32) * w)
  out = jax.jit(lambda q, k, v, b: jax_cp.cp_attention(q, k, v, b))(
      q, k, v, batch)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, w, batch)
  _check(out, grads, cu, cuP, q, k, v, w, valid)


def test_no_load_balance_cp2_one_document():
  """NO_LOAD_BALANCE at cp=2 on one document of the row, the row as the
  bound: each rank's local call runs the dense branch (its chunk lies
  inside the document), the halo call the ragged graph."""
  gpus = devices(2, "gpu")
  b, d = 1, 128
  cu = np.array([[0, T]], np.int32)
  cuP = cu.copy()
  q, k, v, w, valid = _inputs(b, d, [[T]], seed=5)
  mesh = jax.make_mesh((2,), ("cp",), devices=gpus,
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = jax_cp.CPLayout(mesh=mesh, backend="cudnn",
                           strategy="no_load_balance", max_seqlen=T)
  batch = jax_cp.CPBatch(None, cuP, cu, layout=layout).check_on_host()
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: np.asarray(restore_from_cp(
      jax.device_get(x), cuP, layout, seq_dim=1), np.float32)

  def loss(q, k, v, w, batch):
    o = jax_cp.cp_attention(q, k, v, batch)
    return jnp.sum(o.astype(jnp.float32) * w)
  out = jax.jit(lambda q, k, v, b: jax_cp.cp_attention(q, k, v, b))(
      re(q), re(k), re(v), batch)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(re(q), re(k), re(v),
                                                     re(w), batch)
  with jax.default_device(gpus[0]):
    _check(back(out), tuple(back(g) for g in grads), cu, cuP, q, k, v, w,
           valid)
