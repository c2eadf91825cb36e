"""CPU tests of the cuDNN backend: lowering for CUDA and the Python wrapper.

Programs are lowered with ``lowering_platforms=("cuda",)`` on a CPU-only
machine; the StableHLO must hold the two custom calls with the operand
shapes and attributes the C++ handlers bind. Skipped when the extension
(``jax_cp._jax_cp_cuda``) is not built.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from jax_cp.attention.cudnn import backend as cudnn_backend
except ModuleNotFoundError:  # a present but broken extension fails
  pytest.skip("jax_cp's cuDNN extension is not built", allow_module_level=True)

import jax_cp
from jax_cp.attention import registry
from jax_cp.attention.backend import Segments
from tests._devices import devices
from tests._lowering import custom_calls, lower_for_cuda

# The names and codes the extension exports (tests/test_cuda_contract.py
# checks them against what it registers).
FWD = cudnn_backend.FWD_TARGET
BWD = cudnn_backend.BWD_TARGET
MASK_CODES = cudnn_backend.MASK_CODES

def t(shape, dtype):
  return f"tensor<{'x'.join(map(str, shape))}x{dtype}>"


def make_segments(q_lens, kv_lens, q_offs, kv_offs, max_q, max_kv):
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return Segments(i32(q_lens), i32(kv_lens), i32(q_offs), i32(kv_offs),
                  max_q, max_kv)


# Three segments with a gap, an empty one and kv_len > q_len.
SEG = make_segments([10, 0, 30], [20, 0, 40], [0, 10, 24], [0, 20, 40], 32, 40)
TQ, TKV, HQ, HKV, D = 64, 80, 8, 2, 64


def qkv(dtype=jnp.bfloat16, tq=TQ, tkv=TKV, hq=HQ, hkv=HKV, d=D):
  return (jnp.zeros((tq, hq, d), dtype), jnp.zeros((tkv, hkv, d), dtype),
          jnp.zeros((tkv, hkv, d), dtype))


def expected_operands(dtype, s=3, tq=TQ, tkv=TKV, hq=HQ, hkv=HKV, d=D):
  """q, k, v types and the packed metadata [4, W] (W = S+1 rounded up to 4)."""
  w = -(-(s + 1) // 4) * 4
  return ([t((tq, hq, d), dtype), t((tkv, hkv, d), dtype),
           t((tkv, hkv, d), dtype)], [t((4, w), "i32")])


@pytest.mark.parametrize("mask", sorted(MASK_CODES))
def test_forward_lowers_to_custom_call(mask):
  f = lambda q, k, v, seg: cudnn_backend.forward(q, k, v, seg, mask=mask,
                                                 scale=0.125)
  (attrs, ins, outs), = custom_calls(lower_for_cuda(f, *qkv(), SEG), FWD)
  # The graph's s dims: the bounds 32 and 40 rounded up to 128, at most
  # the rows (64, 80).
  assert attrs == {"mask": f"{MASK_CODES[mask]} : i64",
                   "max_seqlen_kv": "80 : i64", "max_seqlen_q": "64 : i64",
                   "scale": "1.250000e-01 : f32", "segments": "3 : i64",
                   "window_left": "-1 : i64", "tiled": "0 : i64",
                   "offset_bits": "32 : i64", "poison": "0 : i64"}
  tensors, meta = expected_operands("bf16")
  assert ins == tensors + meta
  assert outs == [t((TQ, HQ, D), "bf16"), t((TQ, HQ), "f32")]


def test_forward_f16_default_scale_and_capped_bounds():
  seg = make_segments([16], [16], [0], [0], 1000, 1000)  # bounds > T
  f = lambda q, k, v, seg: cudnn_backend.forward(
      q, k, v, seg, mask="causal_top_left", scale=None)
  q, k, v = qkv(jnp.float16, tq=16, tkv=24, hq=4, hkv=4, d=128)
  (attrs, ins, outs), = custom_calls(lower_for_cuda(f, q, k, v, seg), FWD)
  assert attrs["max_seqlen_q"] == "16 : i64"
  assert attrs["max_seqlen_kv"] == "24 : i64"
  assert np.float32(attrs["scale"].split(" : ")[0]) == np.float32(128**-0.5)
  assert ins[0] == t((16, 4, 128), "f16")
  assert outs[0] == t((16, 4, 128), "f16")


@pytest.mark.parametrize("bound,rows,exact,want", [
    (1023, 65536, False, 1024), (7879, 65536, False, 7936),
    (128, 4096, False, 128), (129, 4096, False, 256), (1, 4096, False, 128),
    (130, 200, False, 200), (1023, 65536, True, 1023)])
def test_graph_seqlen(bound, rows, exact, want):
  """Rounded up to GRAPH_SEQLEN_MULTIPLE, at most the rows; exact: the
  bound itself (a tiled call, or a backward with slot-sized buffers)."""
  assert cudnn_backend.graph_seqlen(bound, rows, exact) == want


def test_graph_bounds_rounded_lengths_clipped_at_the_segments_bound():
  """A bound of 130 on 300 rows: the graph's s is 256, and the lengths in
  the metadata are clipped at 130, the segments' bound."""
  seg = make_segments([200, 20], [200, 20], [0, 200], [0, 200], 130, 130)
  f = lambda q, k, v, seg: cudnn_backend.forward(
      q, k, v, seg, mask="causal_top_left", scale=None)
  q, k, v = qkv(tq=300, tkv=300)
  (attrs, _, _), = custom_calls(lower_for_cuda(f, q, k, v, seg), FWD)
  assert attrs["max_seqlen_q"] == "256 : i64"
  assert attrs["max_seqlen_kv"] == "256 : i64"
  meta = cudnn_backend._segment_meta(seg, q.shape, k.shape, 130, 130)
  np.testing.assert_array_equal(np.asarray(meta)[:2, :2], [[130, 20],
                                                          [130, 20]])


def test_slot_sized_backward_keeps_the_exact_bound():
  """D=24 (off a multiple of 16): the frontend sizes the backward's
  buffers by S * s, so its graph keeps the bound 40; the forward rounds
  it up to 128."""
  seg = make_segments([40, 30], [40, 30], [0, 100], [0, 100], 40, 40)
  q, k, v = qkv(tq=300, tkv=300, d=24)
  fwd_out = lambda q, k, v: cudnn_backend.forward(
      q, k, v, seg, mask="causal_top_left", scale=None)
  (f_attrs, _, _), = custom_calls(lower_for_cuda(fwd_out, q, k, v), FWD)
  assert f_attrs["max_seqlen_q"] == "128 : i64"
  out = jnp.zeros_like(q)
  lse = jnp.zeros((300, HQ), jnp.float32)
  bwd = lambda q, k, v, out, lse: cudnn_backend.backward(
      q, k, v, out, lse, out, seg, mask="causal_top_left", scale=0.5)
  (b_attrs, _, _), = custom_calls(lower_for_cuda(bwd, q, k, v, out, lse), BWD)
  assert b_attrs["max_seqlen_q"] == "40 : i64"
  assert b_attrs["max_seqlen_kv"] == "40 : i64"


def test_backward_lowers_to_custom_call():
  q, k, v = qkv()
  out = jnp.zeros_like(q)
  lse = jnp.zeros((TQ, HQ), jnp.float32)

  def f(q, k, v, out, lse, dout, seg):
    return cudnn_backend.backward(q, k, v, out, lse, dout, seg,
                                  mask="causal_bottom_right", scale=0.5)

  text = lower_for_cuda(f, q, k, v, out, lse, out, SEG)
  (attrs, ins, outs), = custom_calls(text, BWD)
  assert attrs == {"mask": "2 : i64", "max_seqlen_kv": "80 : i64",
                   "max_seqlen_q": "64 : i64", "scale": "5.000000e-01 : f32",
                   "segments": "3 : i64", "window_left": "-1 : i64",
                   "tiled": "0 : i64", "offset_bits": "32 : i64",
                   "poison": "0 : i64", "deterministic": "0 : i64"}
  tensors, meta = expected_operands("bf16")
  assert ins == tensors + [t((TQ, HQ, D), "bf16")] * 2 + [
      t((TQ, HQ), "f32")] + meta
  assert outs == tensors
  assert not custom_calls(text, FWD)


@pytest.mark.parametrize("mask", ["causal_bottom_right", "causal_top_left",
                                  "no_mask"])
def test_grad_through_fused_attention(mask):
  b, tq, n = 2, 32, 3
  q = jnp.zeros((b, tq, 4, 64), jnp.bfloat16)
  k = jnp.zeros((b, tq, 2, 64), jnp.bfloat16)
  lens = jnp.array([[10, 6, 0], [16, 16, 0]], jnp.int32)
  offs = jnp.array([[0, 16, 32], [0, 16, 32]], jnp.int32)

  def loss(q, k, v):
    out = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                 attn_mask_type=mask, backend="cudnn",
                                 softmax_scale=0.25, max_seqlen_q=16,
                                 max_seqlen_kv=16)
    return jnp.sum(out.astype(jnp.float32))

  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
  fwd, = custom_calls(text, FWD)
  bwd, = custom_calls(text, BWD)
  code = MASK_CODES[mask]
  s = b * n  # the batch is flattened into one segment list
  # The bound 16 rounded up to 128, at most the rows: 64.
  common = {"mask": f"{code} : i64", "max_seqlen_kv": "64 : i64",
            "max_seqlen_q": "64 : i64", "scale": "2.500000e-01 : f32",
            "segments": f"{s} : i64", "window_left": "-1 : i64",
            "tiled": "0 : i64", "offset_bits": "32 : i64", "poison": "0 : i64"}
  assert fwd[0] == common
  assert bwd[0] == dict(common, deterministic="0 : i64")
  tensors, meta = expected_operands("bf16", s=s, tq=b * tq, tkv=b * tq, hq=4,
                                    hkv=2)
  assert fwd[1] == tensors + meta
  assert bwd[1][:3] == tensors and bwd[1][-1:] == meta
  assert bwd[2] == tensors


@pytest.mark.parametrize("mask", ["causal_top_left", "causal_bottom_right"])
def test_sliding_window_lowers_to_window_left(mask):
  """fused_attention(window_size=(left, 0)) passes window_left = left to
  both custom calls; bottom-right segments reach the kernel without the
  KV rows before their band."""
  q, k, v = qkv(tq=64, tkv=64)
  lens = jnp.array([40, 24], jnp.int32)
  q_lens = jnp.array([8, 24], jnp.int32)
  offs = jnp.array([0, 40], jnp.int32)

  def loss(q, k, v):
    ql = q_lens if mask == "causal_bottom_right" else lens
    out = jax_cp.fused_attention(q, k, v, ql, lens, offs, offs,
                                 attn_mask_type=mask, backend="cudnn",
                                 window_size=(5, 0))
    return jnp.sum(out.astype(jnp.float32))

  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  (fwd, _, _), = custom_calls(text, FWD)
  (bwd, _, _), = custom_calls(text, BWD)
  assert fwd["window_left"] == bwd["window_left"] == "5 : i64"
  seg = make_segments([8, 24], [40, 24], [0, 40], [0, 40], 64, 64)
  cut = cudnn_backend._cut_to_band(seg, "causal_bottom_right", 5)
  # 40 keys for 8 queries: the first query's band starts at key 40-8-5 = 27.
  np.testing.assert_array_equal(cut.kv_lens, [13, 24])
  np.testing.assert_array_equal(cut.kv_offsets, [27, 40])
  assert cudnn_backend._cut_to_band(seg, "causal_top_left", 5) is seg


def test_rejects_bad_window():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="window_left"):
    cudnn_backend.forward(q, k, v, SEG, mask="no_mask", scale=1.0,
                          window_left=3)
  with pytest.raises(ValueError, match="window_left"):
    cudnn_backend.forward(q, k, v, SEG, mask="causal_top_left", scale=1.0,
                          window_left=-2)


def test_backend_is_registered():
  assert "cudnn" in registry.registered_backends()
  backend = registry.resolve_backend("cudnn")
  assert backend.forward is cudnn_backend.forward
  assert backend.backward is cudnn_backend.backward
  assert backend.is_available("cuda") and backend.is_available("gpu")
  assert not backend.is_available("cpu")
  stats = cudnn_backend.graph_cache_stats()
  assert isinstance(stats["builds"], int) and isinstance(stats["hits"], int)
  assert cudnn_backend.build_info()["cudnn_frontend"] >= 10000


def test_auto_takes_cudnn_for_bf16_and_xla_for_float32(monkeypatch, caplog):
  """The platform named as CUDA (the extension is built, so cuDNN would be
  picked): bfloat16 and float16 q/k/v get cudnn, float32 gets xla with one
  logged line; backend="cudnn" is taken as asked for float32 too (its
  dtype error comes at the call: test_rejects_float32)."""
  monkeypatch.setattr(registry, "_WARNED", set())
  caplog.set_level("WARNING", logger=registry.__name__)
  lines = lambda: [r.getMessage() for r in caplog.records
                   if r.name == registry.__name__]
  for dtype in (jnp.bfloat16, jnp.float16):
    assert registry.resolve_backend("auto", "cuda", dtype) is \
        cudnn_backend.BACKEND
  assert lines() == []
  for _ in range(2):
    assert registry.resolve_backend("auto", "cuda", jnp.float32).name == "xla"
  assert len(lines()) == 1 and "float32" in lines()[0]
  assert registry.resolve_backend("cudnn", "cuda",
                                  jnp.float32) is cudnn_backend.BACKEND


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _forward_shapes(q, k, v, seg=SEG, mask="causal_bottom_right"):
  f = lambda q, k, v: cudnn_backend.forward(q, k, v, seg, mask=mask,
                                            scale=0.1)
  return jax.eval_shape(f, q, k, v)


def sds(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def test_rejects_float32():
  q = sds((TQ, HQ, D), jnp.float32)
  kv = sds((TKV, HKV, D), jnp.float32)
  with pytest.raises(ValueError, match="bfloat16 or float16.*float32"):
    _forward_shapes(q, kv, kv)


def test_rejects_mixed_dtypes():
  with pytest.raises(ValueError, match="one dtype"):
    _forward_shapes(sds((TQ, HQ, D)), sds((TKV, HKV, D), jnp.float16),
                    sds((TKV, HKV, D), jnp.float16))


@pytest.mark.parametrize("d", [12, 264, 0])
def test_rejects_head_dim(d):
  with pytest.raises(ValueError, match=f"D={d}"):
    _forward_shapes(sds((TQ, HQ, d)), sds((TKV, HKV, d)), sds((TKV, HKV, d)))


def test_rejects_head_ratio():
  with pytest.raises(ValueError, match="Hq=6, Hkv=4"):
    _forward_shapes(sds((TQ, 6, D)), sds((TKV, 4, D)), sds((TKV, 4, D)))


def test_rejects_rank():
  with pytest.raises(ValueError, match="rank-3"):
    _forward_shapes(sds((1, TQ, HQ, D)), sds((1, TKV, HKV, D)),
                    sds((1, TKV, HKV, D)))


def test_offset_bits_follow_the_element_counts():
  """Calls whose tensors (Q, K/V at the query heads, the dQ accumulator)
  reach the int32 limit of exact addressing get 64-bit offsets; smaller
  ones keep 32-bit. Past 2**31 elements the call is accepted (no error)."""
  limit = cudnn_backend.INT32_OFFSET_ELEMENT_LIMIT
  bits = cudnn_backend.ragged_offset_bits
  assert bits((limit // 1024 - 1, 16, 64), (16, 4, 64), 1, 16) == 32
  assert bits((limit // 1024, 16, 64), (16, 4, 64), 1, 16) == 64
  # K/V counted at the query heads (GQA): 4x the K/V elements.
  assert bits((16, 16, 64), (limit // 1024, 4, 64), 1, 16) == 64
  assert bits((16, 16, 64), (limit // 1024 - 1, 16, 64), 1, 16) == 32
  # D % 16 != 0: the accumulator is sized by the segment slots.
  assert bits((1024, 16, 8), (1024, 16, 8), 2**17, 2**15) == 64
  assert bits((1024, 16, 16), (1024, 16, 16), 2**17, 2**15) == 32
  big = sds((2**21, 16, 64))  # exactly 2**31 elements
  (attrs, _, _), = custom_calls(lower_for_cuda(
      lambda q, k, v, seg: cudnn_backend.forward(
          q, k, v, seg, mask="causal_top_left", scale=0.125),
      big, sds((2**21, 16, 64)), sds((2**21, 16, 64)),
      make_segments([8, 8], [8, 8], [0, 8], [0, 8], 8, 8)), FWD)
  assert attrs["offset_bits"] == "64 : i64"


def test_rejects_token_counts_past_int32():
  with pytest.raises(ValueError, match=r"\(2147483648, 1, 8\).*2\*\*31"):
    cudnn_backend.check_token_counts((2**31, 1, 8), (16, 1, 8))
  with pytest.raises(ValueError, match="k/v"):
    cudnn_backend.check_token_counts((16, 1, 8), (2**31, 1, 8))
  cudnn_backend.check_token_counts((2**31 - 1, 1, 8), (2**31 - 1, 1, 8))


def test_rejects_bad_mask_and_segments():
  q, k, v = sds((TQ, HQ, D)), sds((TKV, HKV, D)), sds((TKV, HKV, D))
  with pytest.raises(ValueError, match="mask"):
    _forward_shapes(q, k, v, mask="causal")
  bad = make_segments([1, 2], [1, 2], [0, 1], [0], 4, 4)
  with pytest.raises(ValueError, match="one length"):
    _forward_shapes(q, k, v, seg=bad)


def test_backward_rejects_bad_lse():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="lse"):
    cudnn_backend.backward(q, k, v, q, jnp.zeros((TQ, HQ + 1)), q, SEG,
                           mask="no_mask", scale=1.0)


# ---------------------------------------------------------------------------
# The wrapper's metadata (pure JAX, runs on CPU)
# ---------------------------------------------------------------------------


def test_token_starts():
  starts = cudnn_backend._token_starts(SEG.q_offsets, TQ)
  np.testing.assert_array_equal(starts, [0, 10, 24, TQ])
  assert starts.dtype == jnp.int32


def test_segment_meta_rows():
  """The packed operand holds the clipped lengths and the two token offset
  vectors, zero-padded to a multiple of 4 (16-byte rows); the handler
  builds cuDNN's element offsets from them."""
  meta = np.asarray(cudnn_backend._segment_meta(SEG, (TQ, HQ, D),
                                                (TKV, HKV, D), 32, 40))
  assert meta.shape == (4, 4) and meta.dtype == np.int32
  np.testing.assert_array_equal(meta[0], [10, 0, 30, 0])
  np.testing.assert_array_equal(meta[1], [20, 0, 40, 0])
  np.testing.assert_array_equal(meta[2], [0, 10, 24, TQ])
  np.testing.assert_array_equal(meta[3], [0, 20, 40, TKV])
  big = make_segments([1] * 6, [1] * 6, range(6), range(6), 1, 1)
  assert cudnn_backend._segment_meta(big, (TQ, HQ, D), (TKV, HKV, D), 1,
                                     1).shape == (4, 8)



def test_segment_meta_carries_the_poison_flag():
  """Segments with a poison: entry S of row 0 holds the flag (the slot the
  zero padding leaves, also when S + 1 is a multiple of 4), and the call's
  ``poison`` attribute is 1; without one the attribute is 0."""
  for flag in (0, 1):
    seg = dataclasses.replace(SEG, poison=jnp.int32(flag))
    meta = np.asarray(cudnn_backend._segment_meta(seg, (TQ, HQ, D),
                                                  (TKV, HKV, D), 32, 40))
    np.testing.assert_array_equal(meta[0], [10, 0, 30, flag])
    np.testing.assert_array_equal(meta[1:], np.asarray(
        cudnn_backend._segment_meta(SEG, (TQ, HQ, D), (TKV, HKV, D), 32,
                                    40))[1:])
  four = make_segments([1] * 4, [1] * 4, range(4), range(4), 1, 1)
  meta = cudnn_backend._segment_meta(
      dataclasses.replace(four, poison=jnp.int32(1)), (TQ, HQ, D),
      (TKV, HKV, D), 1, 1)
  assert meta.shape == (4, 8) and int(meta[0, 4]) == 1
  f = lambda q, k, v, seg: cudnn_backend.forward(q, k, v, seg,
                                                 mask="no_mask", scale=0.5)
  poisoned = dataclasses.replace(SEG, poison=jnp.int32(0))
  (attrs, _, _), = custom_calls(lower_for_cuda(f, *qkv(), poisoned), FWD)
  assert attrs["poison"] == "1 : i64"


@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
def test_trusted_bound_reaches_every_call_as_the_poison_flag(strategy):
  """A host-checked batch with a bound below the row, as jit arguments:
  every cuDNN call of the gradient program carries the poison flag
  (attribute 1), and no multiply touches a K/V-shaped tensor (the flag
  replaces the NaN-or-1 products over K and V). The same program with the
  metadata as constants, checked by value, carries none."""
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cu = np.array([0, 20, 34, 58], np.int32)
  cu_p = np.array([0, 24, 40, 64], np.int32)
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy=strategy, max_seqlen=32)
  batch = jax_cp.CPBatch(None, cu_p, cu, layout=layout).check_on_host()
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp"))
  args = [jax.ShapeDtypeStruct((64, h, D), jnp.bfloat16, sharding=sh)
          for h in (HQ, HKV, HKV)]

  def grad(metadata):
    def loss(q, k, v, b):
      out = jax_cp.cp_attention(q, k, v, metadata(b), layout=layout)
      return jnp.sum(out.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))

  targets = cudnn_backend.FFI_TARGETS
  for metadata, flag in ((lambda b: b, "1 : i64"),
                         (lambda b: (cu, cu_p), "0 : i64")):
    text = lower_for_cuda(grad(metadata), *args, batch)
    calls = [c for name in set(targets.values()) if name.startswith(
        "jax_cp_cudnn_sdpa") for c in custom_calls(text, name)]
    assert len(calls) >= 2
    assert {attrs["poison"] for attrs, _, _ in calls} == {flag}
    kv_type = f"x32x{HKV}x{D}xbf16>"  # [1, Tl, Hkv, D], local K or V
    assert not [line for line in text.splitlines()
                if "stablehlo.multiply" in line and kv_type in line]

def _cp_grad_calls(strategy, window=None, max_seqlen=None):
  """Custom-call names -> count in the gradient program of cp_attention at
  cp=2, lowered for CUDA on CPU devices (virtual ones, on a GPU machine
  too: the program is only lowered); the backward calls' masks and the
  forward calls' masks."""
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cu = np.array([0, 20, 34, 58], np.int32)
  cu_p = np.array([0, 24, 40, 64], np.int32)

  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy=strategy, max_seqlen=max_seqlen)

  def loss(q, k, v):
    out = jax_cp.cp_attention(
        q, k, v, (cu, cu_p), layout=layout,
        window_size=None if window is None else (window, 0))
    return jnp.sum(out.astype(jnp.float32))

  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp"))
  args = [jax.ShapeDtypeStruct((64, h, D), jnp.bfloat16, sharding=sh)
          for h in (HQ, HKV, HKV)]
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args)
  names = re.findall(r"stablehlo\.custom_call @(\w+)", text)
  counts = {n: names.count(n) for n in set(names)}
  into = cudnn_backend.FFI_TARGETS
  masks = [attrs["mask"] for name in (BWD, into["sdpa_bwd_into"])
           for attrs, _, _ in custom_calls(text, name)]
  fwd_masks = [attrs["mask"] for name in (FWD, into["sdpa_fwd_into"])
               for attrs, _, _ in custom_calls(text, name)]
  return counts, masks, fwd_masks


def test_dual_chunk_swap_layer_runs_one_forward_and_three_backward_calls():
  """Both steps in one forward call; the backward's rectangles apart (they
  read the same KV rows) and both triangles in one call."""
  counts, masks, _ = _cp_grad_calls("dual_chunk_swap")
  into = cudnn_backend.FFI_TARGETS
  assert counts.get(FWD) == 1 and into["sdpa_fwd_into"] not in counts
  assert counts.get(BWD, 0) + counts.get(into["sdpa_bwd_into"], 0) == 3
  assert sorted(masks) == sorted(
      [f"{MASK_CODES['no_mask']} : i64"] * 2
      + [f"{MASK_CODES['causal_top_left']} : i64"])


def test_windowed_no_load_balance_runs_two_top_left_calls_each_way():
  """Forward and backward: the local call (which holds the straddling
  document's local rows) and the reversed halo call, both top-left; no
  bottom-right call, and no forward call writes into another's outputs
  (the halo call's rows are merged by log-sum-exp)."""
  counts, masks, fwd_masks = _cp_grad_calls("no_load_balance", window=5,
                                            max_seqlen=24)
  into = cudnn_backend.FFI_TARGETS
  top_left = f"{MASK_CODES['causal_top_left']} : i64"
  assert counts.get(BWD, 0) + counts.get(into["sdpa_bwd_into"], 0) == 2
  assert masks == [top_left] * 2
  assert counts.get(FWD) == 2 and into["sdpa_fwd_into"] not in counts
  assert fwd_masks == [top_left] * 2


def test_no_load_balance_runs_no_bottom_right_call():
  """Without a window too: the local call (top-left, with the straddling
  document's local rows) and the unmasked halo call, each way."""
  counts, masks, fwd_masks = _cp_grad_calls("no_load_balance", max_seqlen=24)
  into = cudnn_backend.FFI_TARGETS
  top_left = f"{MASK_CODES['causal_top_left']} : i64"
  no_mask = f"{MASK_CODES['no_mask']} : i64"
  assert counts.get(BWD) == 2 and into["sdpa_bwd_into"] not in counts
  assert counts.get(FWD) == 2 and into["sdpa_fwd_into"] not in counts
  assert sorted(masks) == sorted(fwd_masks) == sorted([top_left, no_mask])


def test_backward_refuses_a_slot_sized_accumulator():
  """D % 16 != 0: cuDNN sizes the dQ accumulator by S * max_seqlen_q; at
  100k segment slots of 4096 the backward raises before any kernel, naming
  the sizes; the same call with D = 32 (packed totals) lowers."""
  s, t, bound = 100_000, 2**20, 4096
  zeros = jnp.zeros((s,), jnp.int32)
  seg = Segments(zeros, zeros, zeros, zeros, bound, bound)

  def bwd(d):
    q = sds((t, 8, d))
    k = sds((t, 2, d))
    lse = sds((t, 8), jnp.float32)
    return lower_for_cuda(lambda q, k, lse, seg: cudnn_backend.backward(
        q, k, k, q, lse, q, seg, mask="causal_top_left", scale=0.1),
        q, k, lse, seg)

  with pytest.raises(ValueError, match=r"D=24.*100000 \* 4096"):
    bwd(24)
  assert custom_calls(bwd(32), BWD)
  # The rule: a few times the packed size is fine.
  cudnn_backend.check_backward_workspace((t, 8, 24), 4, t, tiled=False)
  cudnn_backend.check_backward_workspace((t, 8, 24), s, bound, tiled=True)


@pytest.mark.parametrize("limit_gib,groups", [("inf", 1), (None, 1),
                                              ("3e-4", 2)])
def test_backward_splits_over_head_groups_past_the_scratch_limit(
    monkeypatch, limit_gib, groups):
  """A backward whose cuDNN workspace exceeds the limit
  (JAX_CP_CUDNN_BWD_SCRATCH_GIB) lowers to one custom call over Hq / n
  query and Hkv / n KV heads inside a loop of n trips; under the limit (the
  default 4 GiB here) to one call over all heads. The gradient of
  fused_attention takes the same path."""
  from jax_cp.attention.cudnn import workspace as cudnn_workspace
  if limit_gib is None:
    monkeypatch.delenv(cudnn_workspace.SCRATCH_LIMIT_ENV, raising=False)
  else:
    monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, limit_gib)
  q, k, v = qkv()
  seg = SEG
  backend = registry.resolve_backend("cudnn")   # reads the limit

  def f(q, k, v, out, lse, dout, seg):
    return backend.backward(q, k, v, out, lse, dout, seg,
                            mask="causal_bottom_right", scale=0.5)

  text = lower_for_cuda(f, q, k, v, jnp.zeros_like(q),
                        jnp.zeros((TQ, HQ), jnp.float32), q, seg)
  (_, ins, outs), = custom_calls(text, BWD)
  want, meta = expected_operands("bf16", hq=HQ // groups, hkv=HKV // groups)
  assert ins == want + [t((TQ, HQ // groups, D), "bf16")] * 2 + [
      t((TQ, HQ // groups), "f32")] + meta
  assert outs == want
  assert ("stablehlo.while" in text) == (groups > 1)

  def loss(q, k, v):
    return jax_cp.fused_attention(
        q, k, v, np.array([10, 30]), np.array([10, 30]),
        np.array([0, 10]), np.array([0, 10]), backend="cudnn").astype(
            jnp.float32).sum()

  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
  (_, ins, _), = custom_calls(text, BWD)
  assert ins[0] == t((TQ, HQ // groups, D), "bf16")
  assert ins[1] == t((TKV, HKV // groups, D), "bf16")



def test_backward_splits_over_kv_slices_past_one_heads_bound(monkeypatch):
  """Where even one KV head's sub-call exceeds the bound, each head group
  runs over K/V slices: per slice a bottom-right call over its causal
  parts and an unmasked call over the rest, each reading that slice's K/V
  rows only (no call reads all TKV rows)."""
  from jax_cp.attention.cudnn import kv_slices
  from jax_cp.attention.cudnn import workspace as cudnn_workspace
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-9")
  groups, slices = cudnn_workspace.backward_split(
      TQ, TKV, HQ, HKV, D, segments=3, max_seqlen_q=32)
  assert groups == HKV and slices > 1
  q, k, v = qkv()
  backend = registry.resolve_backend("cudnn")   # reads the limit

  def f(q, k, v, out, lse, dout, seg):
    return backend.backward(q, k, v, out, lse, dout, seg,
                            mask="causal_bottom_right", scale=0.5)

  text = lower_for_cuda(f, q, k, v, jnp.zeros_like(q),
                        jnp.zeros((TQ, HQ), jnp.float32), q, SEG)
  calls = custom_calls(text, BWD)
  rows = [b - a for a, b in kv_slices.slice_bounds(TKV, slices)]
  assert len(calls) == 2 * len(rows)
  assert sorted(attrs["mask"] for attrs, _, _ in calls) == sorted(
      ["0 : i64", "2 : i64"] * len(rows))
  got_rows = sorted(int(ins[1].split("<")[1].split("x")[0])
                    for _, ins, _ in calls)
  assert got_rows == sorted(rows * 2)
  for _, ins, outs in calls:
    assert ins[0] == t((TQ, HQ // groups, D), "bf16")
    assert outs[0] == t((TQ, HQ // groups, D), "bf16")
  assert "stablehlo.while" in text

def test_head_groups_in_a_cp_layer_and_a_checked_shard_map(monkeypatch):
  """With the split forced (a small workspace bound), the DUAL_CHUNK_SWAP
  layer's three backward calls each become one call over half the heads
  in a loop; and fused_attention's gradient inside a user's shard_map
  with vma checking on lowers too, split over head groups and K/V slices
  (a tiny bound)."""
  from jax_cp.attention.cudnn import workspace as cudnn_workspace
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "2e-4")
  counts, masks, _ = _cp_grad_calls("dual_chunk_swap")
  into = cudnn_backend.FFI_TARGETS
  assert counts.get(BWD, 0) + counts.get(into["sdpa_bwd_into"], 0) == 3
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-9")
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  lens = jnp.array([10, 22])
  offs = jnp.array([0, 10])

  def local_loss(q, k, v):
    out = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                 backend="cudnn")
    return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), "cp")

  grad = jax.shard_map(jax.grad(local_loss, argnums=(0, 1, 2)), mesh=mesh,
                       in_specs=jax.P("cp"), out_specs=jax.P("cp"),
                       check_vma=True)
  sh = jax.sharding.NamedSharding(mesh, jax.P("cp"))
  args = [jax.ShapeDtypeStruct((64, h, D), jnp.bfloat16, sharding=sh)
          for h in (HQ, HKV, HKV)]
  text = lower_for_cuda(grad, *args)
  calls = custom_calls(text, BWD)     # head groups, each over K/V slices
  assert len(calls) >= 2
  assert all(ins[0] == t((32, HQ // 2, D), "bf16") for _, ins, _ in calls)
  assert "stablehlo.while" in text
