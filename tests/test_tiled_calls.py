"""Tiled calls (one document per row, bounded by the row): which calls are
tiled, what the cuDNN wrapper sends for them, and the rules it enforces.

The numbers of a tiled cuDNN call are checked on the GPU
(tests/gpu/test_tiled_cudnn.py); here the plan, the lowering (CUDA
custom-call attributes, on CPU) and the stats layout.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention.backend import Segments
from jax_cp.attention.registry import resolve_backend
from jax_cp.cp import call_plan
from jax_cp.cp.config import CPConfig
from jax_cp.cp.exchange import choose_exchange
from jax_cp.cp.strategy import CPLoadBalancingStrategy as S
from tests._lowering import lower_for_cuda

T = 64


def cp1_config(w, causal=True):
  return CPConfig(strategy=S.DUAL_CHUNK_SWAP, cp_axis=None, cp_size=1,
                  causal=causal, scale=0.1, backend=resolve_backend("xla"),
                  total_tokens=T, max_seqlen=w,
                  exchange=choose_exchange(False, None, 1, T, w),
                  window_left=-1)


def one_doc_rows(lens):
  lens = np.asarray(lens, np.int32)
  cu = np.stack([np.zeros_like(lens), lens], axis=1)
  return cu, np.tile(np.array([0, T], np.int32), (len(lens), 1))


@pytest.mark.parametrize("causal", [True, False])
def test_cp1_one_document_per_row_is_tiled(causal):
  cu, cuP = one_doc_rows([64, 40, 3])
  (fwd,) = call_plan.forward_plan(cp1_config(T, causal), cu, cuP, 0)
  (bwd,) = call_plan.backward_plan(cp1_config(T, causal), cu, cuP, 0)
  seg = fwd.segments
  assert seg.tiled == causal and bwd.segments.tiled == causal
  if causal:
    # Row order kept: segment i is row i (no heaviest-first sort).
    np.testing.assert_array_equal(seg.q_lens, [64, 40, 3])
    np.testing.assert_array_equal(seg.q_offsets, [0, T, 2 * T])
    assert (seg.max_seqlen_q, seg.max_seqlen_kv) == (T, T)


def test_not_tiled_with_two_documents_or_a_tighter_bound():
  cu = np.array([[0, 10, 30]], np.int32)
  cuP = np.array([[0, 32, 64]], np.int32)
  (call,) = call_plan.forward_plan(cp1_config(T), cu, cuP, 0)
  assert not call.segments.tiled
  cu1, cuP1 = one_doc_rows([40])
  (call,) = call_plan.forward_plan(cp1_config(48), cu1, cuP1, 0)
  assert not call.segments.tiled


try:
  from jax_cp.attention import cudnn as cudnn_backend
except ModuleNotFoundError:
  cudnn_backend = None
needs_ext = pytest.mark.skipif(cudnn_backend is None,
                               reason="jax_cp's cuDNN extension is not built")


def tiled_attrs(text):
  return [line.split("tiled = ")[1].split(" ")[0] for line in text.splitlines()
          if "custom_call @jax_cp_cudnn_sdpa" in line]


def qkv(b=2, t=T, hq=4, hkv=2, d=64):
  rng = np.random.default_rng(0)
  mk = lambda h: jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
  return mk(hq), mk(hkv), mk(hkv)


@needs_ext
def test_fused_attention_one_document_rows_lower_tiled():
  import jax_cp
  q, k, v = qkv()
  lens = np.array([[64], [20]], np.int32)
  offs = np.zeros((2, 1), np.int32)

  def loss(q, k, v):
    o = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                               attn_mask_type="causal_bottom_right",
                               backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  assert tiled_attrs(text) == ["1", "1"]
  assert "mask = 1 : i64" in text  # causal with equal lengths: top-left


@needs_ext
@pytest.mark.parametrize("case", ["traced_offsets", "two_docs", "offset",
                                  "kv_shorter", "bound"])
def test_fused_attention_other_calls_are_not_tiled(case):
  import jax_cp
  q, k, v = qkv()
  lens = np.array([[64], [20]], np.int32)
  offs = np.zeros((2, 1), np.int32)
  kv_lens, bound = lens, None
  if case == "two_docs":
    lens = np.array([[30, 34], [20, 0]], np.int32)
    offs, kv_lens = np.array([[0, 30], [0, 20]], np.int32), lens
  elif case == "offset":
    offs = np.array([[1], [0]], np.int32)
    lens = kv_lens = np.array([[63], [20]], np.int32)
  elif case == "kv_shorter":
    kv_lens = np.array([[60], [20]], np.int32)
  elif case == "bound":
    lens = kv_lens = np.array([[32], [20]], np.int32)
    bound = 32

  def fwd(q, k, v, offs):
    return jax_cp.fused_attention(q, k, v, lens, kv_lens, offs, offs,
                                  attn_mask_type="causal_top_left",
                                  backend="cudnn", max_seqlen_q=bound,
                                  max_seqlen_kv=bound)
  if case == "traced_offsets":
    text = lower_for_cuda(fwd, q, k, v, jnp.asarray(offs))
  else:
    text = lower_for_cuda(lambda q, k, v: fwd(q, k, v, offs), q, k, v)
  assert tiled_attrs(text) == ["0"]


@needs_ext
def test_tiled_stats_are_head_major_with_a_huge_lse_past_the_length():
  s, w, hq = 2, 8, 3
  seg = Segments(jnp.array([8, 5], jnp.int32), jnp.array([8, 5], jnp.int32),
                 jnp.array([0, 8], jnp.int32), jnp.array([0, 8], jnp.int32),
                 w, w, rows_see_keys=True, tiled=True)
  lse = np.arange(s * w * hq, dtype=np.float32).reshape(s * w, hq)
  lse[8 + 5:] = -np.inf
  got = np.asarray(cudnn_backend._tiled_stats(seg, jnp.asarray(lse)))
  flat = got.reshape(-1)
  for i in range(s):
    for h in range(hq):
      for t in range(w):
        want = lse[i * w + t, h]
        want = cudnn_backend.TILED_PAST_LENGTH_LSE if np.isneginf(want) \
            else want
        assert flat[(i * hq + h) * w + t] == want


@needs_ext
def test_tiled_segments_need_top_left_and_whole_rows():
  q, k, v = (x[0] for x in qkv())
  seg = Segments(jnp.array([64], jnp.int32), jnp.array([64], jnp.int32),
                 jnp.array([0], jnp.int32), jnp.array([0], jnp.int32),
                 T, T, tiled=True)
  with pytest.raises(ValueError, match="tiled=True"):
    cudnn_backend.forward(q, k, v, seg, mask="causal_bottom_right",
                          scale=0.1)
  short = Segments(seg.q_lens, seg.kv_lens, seg.q_offsets, seg.kv_offsets,
                   32, 32, tiled=True)
  with pytest.raises(ValueError, match="S \\* max_seqlen"):
    cudnn_backend.forward(q, k, v, short, mask="causal_top_left", scale=0.1)


@needs_ext
def test_traced_lengths_with_offsets_none_lower_tiled():
  """One document per row, lengths as jit arguments, ``q_offsets=None``:
  the forward and backward run the dense (tiled) graph."""
  import jax_cp
  q, k, v = qkv()
  lens = jnp.asarray([[64], [20]], jnp.int32)

  def loss(q, k, v, lens):
    o = jax_cp.fused_attention(q, k, v, lens, lens,
                               attn_mask_type="causal_bottom_right",
                               backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, lens)
  assert tiled_attrs(text) == ["1", "1"]


@needs_ext
@pytest.mark.parametrize("mask", ["causal_bottom_right", "causal_top_left",
                                  "no_mask"])
def test_traced_metadata_add_no_pass_over_out_or_dq(mask):
  """Two documents per row, lengths and offsets as jit arguments: rows
  that see no key are the handler's to fill, so nothing around the custom
  calls selects over their results. The only selects of out's or dq's
  size clear the padding rows of q before the forward and of dout before
  the backward (docs/internals.md, Padding tokens)."""
  import jax_cp
  q, k, v = qkv()
  lens = jnp.asarray([[30, 34], [20, 0]], jnp.int32)
  kv_lens = jnp.asarray([[20, 34], [20, 0]], jnp.int32)
  offs = jnp.asarray([[0, 30], [0, 20]], jnp.int32)

  def loss(q, k, v, lens, kv_lens, offs):
    o = jax_cp.fused_attention(q, k, v, lens, kv_lens, offs, offs,
                               attn_mask_type=mask, backend="cudnn")
    return jnp.sum(o.astype(jnp.float32))
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, lens,
                        kv_lens, offs)
  assert tiled_attrs(text) == ["0", "0"]
  results = re.findall(r"(%\w+):\d+ = stablehlo\.custom_call", text)
  size = f"{2 * T}x4x64x"
  selects = [line for line in text.splitlines()
             if ("stablehlo.select" in line or "call @_where" in line)
             and size in line]
  assert selects and not any(f"{r}#" in line for line in selects
                             for r in results), selects
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
      q, k, v, lens, kv_lens, offs)
  assert count_selects(jaxpr.jaxpr, (2 * T, 4, 64)) == 2


def count_selects(jaxpr, shape) -> int:
  """The ``select_n`` equations with results of ``shape`` in ``jaxpr`` and
  the jaxprs it calls (each call site counted)."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "select_n" and \
        eqn.outvars[0].aval.shape == shape:
      n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          n += count_selects(sub, shape)
  return n
