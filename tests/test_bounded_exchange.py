"""NO_LOAD_BALANCE with a max_seqlen bound: the halo exchange gives the same
results as the all-gather, moves only what is needed, and says so in HLO."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.cp.exchange import choose_exchange
from jax_cp.data import get_batch_on_this_cp_rank, longest_padded_document
from tests import reference as ref
from tests._devices import cp_mesh
from tests.split_backend import SPLIT_XLA

T, D = 128, 16
NLB = S.NO_LOAD_BALANCE


def layout_with_longest(rng, w, batch, max_docs=64):
  """Rows of T tokens whose documents are at most w long (padded), with
  one document of exactly w per row so the bound is tight."""
  return ref.rows_with_longest(rng, T, w, batch, max_docs)


def nlb_layout(cp, max_seqlen, backend="xla"):
  return CPLayout(mesh=cp_mesh(cp), strategy=NLB, backend=backend,
                  max_seqlen=max_seqlen)


def run(q, k, v, w, cu, cuP, cp, max_seqlen, backend="xla"):
  attn = functools.partial(jax_cp.cp_attention,
                           layout=nlb_layout(cp, max_seqlen, backend))
  out = jax.jit(lambda q, k, v: attn(q, k, v, (cu, cuP)))(q, k, v)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      attn(q, k, v, (cu, cuP)) * w), argnums=(0, 1, 2)))(q, k, v)
  return out, grads


@pytest.mark.sweep(fast=3)
@pytest.mark.parametrize("cp, w", [
    (2, 20), (2, 100),                 # one hop; bound above Tl -> gather
    (4, 20), (4, 50), (4, 128),        # one hop, two hops, falls back
    (8, 10), (8, 30), (8, 64),         # one, two, four hops
])
def test_bounded_equals_all_gather_and_reference(cp, w, record_error):
  rng = np.random.default_rng(cp * 1000 + w)
  cu, cuP = layout_with_longest(rng, w, batch=2)
  q = jnp.asarray(rng.standard_normal((2, T, 4, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, T, 2, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, T, 2, D)), jnp.float32)
  wt = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  exch = choose_exchange(True, "cp", cp, T, w)
  tl = T // cp
  if w - 1 < (cp - 1) * tl:
    assert exch.kind == "halo" and exch.halo_tokens == w - 1
  else:
    assert exch.kind == "all_gather"
  out_b, g_b = run(q, k, v, wt, cu, cuP, cp, max_seqlen=w,
                   backend=SPLIT_XLA if cp == 4 else "xla")
  out_a, g_a = run(q, k, v, wt, cu, cuP, cp, max_seqlen=None)
  assert ref.rel_err(out_b, out_a) < 1e-5
  for x, y in zip(g_b, g_a):
    assert ref.rel_err(x, y) < 1e-5
  want = ref.batched_attention(q, k, v, cu, cuP)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(2)])
  err = ref.rel_err(np.asarray(out_b)[valid], np.asarray(want)[valid])
  record_error(jnp.float32, "out", err)
  assert err < 1e-4


def test_lowered_hlo_has_permutes_not_gathers():
  cp, w = 4, 20
  rng = np.random.default_rng(0)
  cu, cuP = layout_with_longest(rng, w, batch=1)
  q = jnp.asarray(rng.standard_normal((1, T, 4, D)), jnp.float32)
  k = v = jnp.asarray(rng.standard_normal((1, T, 2, D)), jnp.float32)

  def loss(q, k, v, bound):
    return jnp.sum(jax_cp.cp_attention(q, k, v, (cu, cuP),
                                       layout=nlb_layout(cp, bound)))

  for bound, permutes in ((w, True), (None, False)):
    text = jax.jit(jax.value_and_grad(functools.partial(loss, bound=bound),
                                      argnums=(0, 1, 2))).lower(
                                          q, k, v).as_text()
    assert ("collective_permute" in text) == permutes, bound
    assert ("all_gather" in text) == (not permutes), bound
    assert ("reduce_scatter" in text) == (not permutes), bound


def test_max_seqlen_guard_on_host_helpers():
  cuP = np.array([0, 40, 64], np.int32)
  with pytest.raises(ValueError, match="max_seqlen=30 is smaller than the "
                     "longest padded document \\(40 tokens\\)"):
    get_batch_on_this_cp_rank(
        cuP, np.arange(64), layout=CPLayout(cp_size=2, strategy=NLB,
                                            max_seqlen=30), cp_rank=0)
  assert longest_padded_document(cuP) == 40
  assert longest_padded_document(np.stack([cuP, [0, 10, 64]])) == 54


def test_cudnn_lowering_merges_straddle_parts_in_place():
  """With the cudnn backend (lowered for CUDA here), NO_LOAD_BALANCE runs
  two calls each way (it has no bottom-right block for the backend's
  split of the backward): the local call (which holds the straddling
  document's local rows) and an unmasked halo call on the first W-1 Q
  rows and the received halo alone (no buffer of halo and chunk is
  built). The halo call's rows are merged into the local call's by
  log-sum-exp, its dq and the halo's dK/dV with aliased
  ``jax_cp_merge_rows`` calls: no pad or dynamic-update-slice of a
  full-size buffer, which would cost a pass over (or a copy of) it."""
  try:
    import jax_cp.attention.cudnn.backend  # noqa: F401
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built")
  cp, tl, w = 2, 2048, 1600
  cu = jnp.asarray([0, 300, 1000, 2100, 2600, cp * tl], jnp.int32)
  # Only lowered: CPU devices on a GPU too.
  layout = CPLayout(mesh=cp_mesh(cp, "cpu"), strategy=NLB, backend="cudnn",
                    max_seqlen=w)

  def loss(q, k, v, dout):
    out = jax_cp.cp_attention(q, k, v, (cu, cu), layout=layout)
    return jnp.sum(out.astype(jnp.float32) * dout)

  sds = lambda h: jax.ShapeDtypeStruct((cp * tl, h, 64), jnp.bfloat16)
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
      sds(8), sds(2), sds(2), jax.ShapeDtypeStruct((cp * tl, 8, 64),
                                                   jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
  calls = lambda name: [l for l in text.splitlines() if f"@{name}(" in l]
  c = jax_cp.attention.cudnn
  fwd, bwd = calls(c.FWD_TARGET), calls(c.BWD_TARGET)
  assert len(fwd) == 2 and len(bwd) == 2
  assert not calls(c.FWD_INTO_TARGET) and not calls(c.BWD_INTO_TARGET)
  no_mask = f"mask = {c.MASK_CODES['no_mask']} : i64"
  for group in (fwd, bwd):
    (halo,) = [l for l in group if no_mask in l]
    args = halo.split("->")[0]
    # Q: the first W-1 local rows; K/V: the W-1 received rows.
    assert f"tensor<{w - 1}x8x64xbf16>" in args, halo
    assert f"tensor<{w - 1}x2x64xbf16>" in args, halo
  # Forward: out (add) and lse (max) of the halo call's rows; backward: its
  # dq, and the halo's dK and dV at the predecessor.
  merges = calls(c.MERGE_TARGET)
  assert len(merges) == 5, merges
  assert all("output_operand_aliases" in l for l in merges)
  for line in text.splitlines():
    if "stablehlo.pad" in line or "dynamic_update_slice" in line:
      assert f"{tl}x8x64" not in line and f"{tl}x2x64" not in line, line
    # K and V travel concatenated on the head axis; halo and chunk are
    # never concatenated on the token axis.
    assert f"x{w - 1 + tl}x" not in line, line


@pytest.mark.parametrize("w, keeps", [(20, True), (40, False)])
def test_backward_reuses_a_small_halo(w, keeps):
  """A halo of at most half a chunk is kept from the forward: the step
  then has two collective-permutes (the halo, and its gradients back);
  a larger one is exchanged again in the backward (three)."""
  cp = 2
  exch = choose_exchange(True, "cp", cp, T, w)
  assert exch.kind == "halo" and exch.keeps_halo == keeps
  rng = np.random.default_rng(5)
  cu, cuP = layout_with_longest(rng, w, batch=1)
  q = jnp.asarray(rng.standard_normal((1, T, 4, D)), jnp.float32)
  k = v = jnp.asarray(rng.standard_normal((1, T, 2, D)), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(jax_cp.cp_attention(q, k, v, (cu, cuP),
                                       layout=nlb_layout(cp, w)))

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
      q, k, v).as_text()
  assert text.count("stablehlo.collective_permute") == (2 if keeps else 3)
