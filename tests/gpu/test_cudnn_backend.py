"""GPU tests: the ``"cudnn"`` backend against the ``"xla"`` reference.

Both backends get the same bf16/f16 inputs; the reference runs on them
upcast to float32. Errors are norm-wise, ``|a - b| / |b|``. Run with
``pytest -m gpu`` on a CUDA machine (``tests/gpu/run_gpu_suite.sh``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend = cudnn_backend_or_skip()

import jax_cp
from jax_cp.attention.backend import Segments
from jax_cp.attention.registry import resolve_backend

CUDNN = resolve_backend("cudnn")
XLA = resolve_backend("xla")
MASKS = ("no_mask", "causal_top_left", "causal_bottom_right")
TOL = 2e-2


@dataclasses.dataclass
class Layout:
  """Host-side segment metadata of one test layout."""
  q_lens: np.ndarray
  kv_lens: np.ndarray
  q_offs: np.ndarray
  kv_offs: np.ndarray
  tq: int
  tkv: int

  def segments(self, loose: bool = False) -> Segments:
    max_q = self.tq if loose else max(int(self.q_lens.max()), 1)
    max_kv = self.tkv if loose else max(int(self.kv_lens.max()), 1)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return Segments(i32(self.q_lens), i32(self.kv_lens), i32(self.q_offs),
                    i32(self.kv_offs), max_q, max_kv)

  def subset(self, sel) -> Segments:
    """The segments where ``sel`` holds (the others get length 0), bounds
    Tq/Tkv, with ``rows_see_keys`` (for calls writing in place)."""
    z = lambda a: jnp.asarray(np.where(sel, a, 0), jnp.int32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return Segments(z(self.q_lens), z(self.kv_lens), i32(self.q_offs),
                    i32(self.kv_offs), self.tq, self.tkv, rows_see_keys=True)

  def covered_q_rows(self) -> np.ndarray:
    rows = np.zeros(self.tq, bool)
    for off, n in zip(self.q_offs, self.q_lens):
      rows[off:off + n] = True
    return rows

  def read_kv_rows(self) -> np.ndarray:
    rows = np.zeros(self.tkv, bool)
    for off, n in zip(self.kv_offs, self.kv_lens):
      rows[off:off + n] = True
    return rows


def _pack(lengths, gaps, total):
  """Offsets of back-to-back segments separated by `gaps` in a `total` row."""
  offs, pos = [], 0
  for n, g in zip(lengths, gaps):
    pos += g
    offs.append(pos)
    pos += n
  assert pos <= total, (pos, total)
  return np.array(offs, np.int32)


def _with_empty_slots(layout_args, empty):
  """Appends `empty` zero-length segments at the end (offsets repeated)."""
  q_lens, kv_lens, q_offs, kv_offs = layout_args
  q_end = q_offs[-1] + q_lens[-1]
  kv_end = kv_offs[-1] + kv_lens[-1]
  z = np.zeros(empty, np.int32)
  return (np.concatenate([q_lens, z]), np.concatenate([kv_lens, z]),
          np.concatenate([q_offs, z + q_end]),
          np.concatenate([kv_offs, z + kv_end]))


def make_layout(kind: str, seed: int = 0) -> Layout:
  rng = np.random.default_rng(seed)
  if kind == "one_long":  # one document, padding at the end, 2 empty slots
    t = 2048
    args = (np.array([2000]), np.array([2000]), np.array([0]), np.array([0]))
    args = _with_empty_slots(args, 2)
    return Layout(*map(lambda a: np.asarray(a, np.int32), args), t, t)
  if kind == "many_short":  # self-attention, gaps between documents
    t = 1024
    lens = rng.integers(1, 48, size=30)
    lens[:3] = 1
    gaps = rng.integers(0, 4, size=30)
    offs = _pack(lens, gaps, t)
    args = _with_empty_slots((lens, lens, offs, offs), 5)
    return Layout(*map(lambda a: np.asarray(a, np.int32), args), t, t)
  if kind == "tiny_docs":  # documents of length 1 and 2
    t = 256
    lens = rng.integers(1, 3, size=100)
    offs = _pack(lens, np.zeros(100, int), t)
    return Layout(*[np.asarray(a, np.int32) for a in (lens, lens, offs, offs)],
                  t, t)
  if kind == "kv_longer":  # CP-like: each Q chunk sees a longer KV prefix
    tq, tkv = 512, 1024
    q_lens = rng.integers(1, 80, size=8)
    kv_lens = q_lens + rng.integers(0, 60, size=8)
    q_offs = _pack(q_lens, rng.integers(0, 5, size=8), tq)
    kv_offs = _pack(kv_lens, rng.integers(0, 5, size=8), tkv)
    args = _with_empty_slots((q_lens, kv_lens, q_offs, kv_offs), 2)
    return Layout(*map(lambda a: np.asarray(a, np.int32), args), tq, tkv)
  if kind == "kv_shorter":  # rows without keys under bottom-right; kv_len 0
    t = 512
    q_lens = rng.integers(1, 50, size=9)
    kv_lens = (q_lens * rng.uniform(0, 1, size=9)).astype(np.int32)
    kv_lens[0] = 0
    q_offs = _pack(q_lens, rng.integers(0, 5, size=9), t)
    kv_offs = _pack(kv_lens, rng.integers(0, 5, size=9), t)
    return Layout(*[np.asarray(a, np.int32)
                    for a in (q_lens, kv_lens, q_offs, kv_offs)], t, t)
  raise ValueError(kind)


LAYOUTS = ("one_long", "many_short", "tiny_docs", "kv_longer", "kv_shorter")

# (layout, mask, Hq, Hkv, D, dtype): every layout x mask for GQA bf16 D=128,
# plus head dims, MHA and float16 on a subset.
CASES = [(lay, m, 8, 2, 128, jnp.bfloat16) for lay in LAYOUTS for m in MASKS]
CASES += [(lay, "causal_bottom_right", h, h // g, d, jnp.bfloat16)
          for d in (64, 256) for lay, h, g in (("many_short", 8, 1),
                                               ("kv_longer", 4, 4))]
CASES += [("many_short", m, 8, 2, 64, jnp.float16) for m in MASKS]
CASES += [("one_long", "causal_top_left", 4, 4, 128, jnp.bfloat16)]


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  den = np.linalg.norm(b)
  num = np.linalg.norm(a - b)
  return float(num / den) if den > 0 else float(num)


def random_inputs(layout, hq, hkv, d, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (layout.tq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (layout.tkv, hkv, d),
                        jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (layout.tkv, hkv, d),
                        jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (layout.tq, hq, d), jnp.float32).astype(dtype)
  return q, k, v, do


def run_backend(backend, q, k, v, do, seg, mask, scale):
  @jax.jit
  def run(q, k, v, do, seg):
    out, lse = backend.forward(q, k, v, seg, mask=mask, scale=scale)
    grads = backend.backward(q, k, v, out, lse, do, seg, mask=mask,
                             scale=scale)
    return out, lse, grads
  return jax.block_until_ready(run(q, k, v, do, seg))


def _skip_if_unsupported(err, d):
  text = str(err)
  if d == 256 and ("check_support" in text or "create_execution_plans" in text
                   or "build_plans" in text):
    pytest.skip(f"cuDNN does not support D=256 here: {text[:300]}")
  raise err


@pytest.mark.parametrize("layout_kind,mask,hq,hkv,d,dtype", CASES)
def test_matches_xla(layout_kind, mask, hq, hkv, d, dtype, record_error):
  layout = make_layout(layout_kind)
  seg = layout.segments(loose=(layout_kind == "tiny_docs"))
  q, k, v, do = random_inputs(layout, hq, hkv, d, dtype)
  scale = d ** -0.5
  try:
    out, lse, (dq, dk, dv) = run_backend(CUDNN, q, k, v, do, seg, mask, scale)
  except jax.errors.JaxRuntimeError as e:
    _skip_if_unsupported(e, d)
  f32 = lambda x: x.astype(jnp.float32)
  r_out, r_lse, (r_dq, r_dk, r_dv) = run_backend(
      XLA, f32(q), f32(k), f32(v), f32(do), seg, mask, scale)

  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert not np.isnan(np.asarray(x, np.float32)).any(), name
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  assert not np.isnan(lse).any()
  # Rows that see no key (or no segment) carry -inf in both.
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  live = ~np.isneginf(r_lse)
  if live.any():
    err = rel_err(lse[live], r_lse[live])
    record_error(dtype, "lse", err)
    assert err < TOL, ("lse", err)

  for name, got, want in (("out", out, r_out), ("dq", dq, r_dq),
                          ("dk", dk, r_dk), ("dv", dv, r_dv)):
    err = rel_err(np.asarray(got, np.float32), want)
    record_error(dtype, name, err)
    assert err < TOL, (name, err)

  # Exact zeros where nothing is computed.
  dead_q = ~layout.covered_q_rows()
  no_key = np.isneginf(r_lse).all(axis=1)
  assert not np.asarray(out, np.float32)[dead_q | no_key].any()
  assert not np.asarray(dq, np.float32)[dead_q].any()
  unread = ~layout.read_kv_rows()
  assert not np.asarray(dk, np.float32)[unread].any()
  assert not np.asarray(dv, np.float32)[unread].any()


def test_fused_attention_grad_matches_xla(record_error):
  """End to end through jax_cp.fused_attention's custom_vjp, batched."""
  b, t, hq, hkv, d = 2, 512, 8, 2, 128
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  q = jax.random.normal(keys[0], (b, t, hq, d)).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, hkv, d)).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, hkv, d)).astype(jnp.bfloat16)
  lens = jnp.array([[300, 100, 0], [1, 200, 256]], jnp.int32)
  offs = jnp.array([[0, 320, 420], [0, 1, 256]], jnp.int32)

  def loss(backend, q, k, v):
    out = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                                 attn_mask_type="causal_bottom_right",
                                 backend=backend, max_seqlen_q=300,
                                 max_seqlen_kv=300)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.sum(out.astype(jnp.float32) * w)

  grads = jax.jit(jax.grad(lambda *a: loss("cudnn", *a), argnums=(0, 1, 2)))
  ref = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2)))
  got = grads(q, k, v)
  want = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, w in zip(("dq", "dk", "dv"), got, want):
    err = rel_err(np.asarray(g, np.float32), w)
    record_error(jnp.bfloat16, f"fused_{name}", err)
    assert err < TOL, (name, err)


def test_graph_cache_hits_on_second_call():
  layout = make_layout("many_short", seed=3)
  seg = layout.segments()
  q, k, v, do = random_inputs(layout, 8, 2, 64, jnp.bfloat16, seed=3)
  # The scale is part of the cache key: an unusual one keeps other tests'
  # graphs out of the counts.
  mask, scale = "causal_bottom_right", 0.1171875
  run_backend(CUDNN, q, k, v, do, seg, mask, scale)  # builds (or reuses)
  cudnn_backend.reset_graph_cache_stats()
  q2, k2, v2, do2 = random_inputs(layout, 8, 2, 64, jnp.bfloat16, seed=4)
  run_backend(CUDNN, q2, k2, v2, do2, seg, mask, scale)
  stats = cudnn_backend.graph_cache_stats()
  assert stats["builds"] == 0, stats
  assert stats["hits"] >= 2, stats  # one forward, one backward
  # A new shape builds a new graph, counted once.
  seg_loose = layout.segments(loose=True)
  run_backend(CUDNN, q2, k2, v2, do2, seg_loose, mask, scale)
  assert cudnn_backend.graph_cache_stats()["builds"] == 2


def test_errors_are_reported_not_crashes():
  """A malformed call surfaces as a Python exception naming the target."""
  layout = make_layout("tiny_docs")
  q, k, v, _ = random_inputs(layout, 4, 4, 64, jnp.bfloat16)
  # Call the FFI target directly (bypassing the wrapper's checks) with
  # metadata rows of S entries instead of S + 1 (rounded up to 4): the
  # handler must refuse it.
  call = jax.ffi.ffi_call(
      cudnn_backend.FWD_TARGET,
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)))
  s = layout.q_lens.shape[0]
  meta = jnp.zeros((cudnn_backend.SEGMENT_META_ROWS, s), jnp.int32)
  attrs = dict(segments=np.int64(s), mask=np.int64(0), scale=np.float32(1.0),
               max_seqlen_q=np.int64(2), max_seqlen_kv=np.int64(2),
               window_left=np.int64(-1), tiled=np.int64(0),
               offset_bits=np.int64(32), poison=np.int64(0))
  run = lambda attrs, *a: jax.jit(lambda *x: call(*x, **attrs))(*a)
  with pytest.raises(Exception, match=cudnn_backend.FWD_TARGET):
    jax.block_until_ready(run(attrs, q, k, v, meta))
  # An offset width other than 32 or 64 is refused by name, as is a
  # window whose band bound (window_left + 1) would overflow an int.
  good_meta = jnp.zeros((cudnn_backend.SEGMENT_META_ROWS, -(-(s + 1) // 4) *
                         4), jnp.int32)
  for bad, what in (({"offset_bits": np.int64(16)}, "offset_bits"),
                    ({"poison": np.int64(2)}, "poison"),
                    ({"mask": np.int64(1), "window_left": np.int64(2**31 - 1)},
                     "window_left")):
    with pytest.raises(Exception, match=what):
      jax.block_until_ready(run({**attrs, **bad}, q, k, v, good_meta))


@pytest.mark.parametrize("layout_kind,mask", [
    ("many_short", "causal_top_left"), ("kv_longer", "causal_bottom_right")])
def test_into_writes_only_its_rows(layout_kind, mask, record_error):
  """Two calls on disjoint segment sets, the second writing into the
  first's out/lse (forward) and dq (backward) in place, equal one call on
  all segments; the rows the second call does not cover come through
  bit for bit."""
  layout = make_layout(layout_kind, seed=3)
  q, k, v, do = random_inputs(layout, 8, 2, 128, jnp.bfloat16, seed=3)
  s = layout.q_lens.shape[0]
  pick = np.arange(s) % 2 == 1
  seg_a, seg_b, seg_all = (layout.subset(~pick), layout.subset(pick),
                           layout.subset(pick | ~pick))

  @jax.jit
  def two_calls(q, k, v, do):
    o, l = CUDNN.forward(q, k, v, seg_a, mask=mask, scale=0.1)
    o, l = CUDNN.forward(q, k, v, seg_b, mask=mask, scale=0.1, into=(o, l))
    dq, dk_a, dv_a = CUDNN.backward(q, k, v, o, l, do, seg_a, mask=mask,
                                    scale=0.1)
    dq, dk_b, dv_b = CUDNN.backward(q, k, v, o, l, do, seg_b, mask=mask,
                                    scale=0.1, dq_into=dq)
    return o, l, dq, dk_a + dk_b, dv_a + dv_b

  @jax.jit
  def one_call(q, k, v, do):
    o, l = CUDNN.forward(q, k, v, seg_all, mask=mask, scale=0.1)
    return (o, l) + CUDNN.backward(q, k, v, o, l, do, seg_all, mask=mask,
                                   scale=0.1)

  got = [np.asarray(x, np.float32) for x in two_calls(q, k, v, do)]
  want = [np.asarray(x, np.float32) for x in one_call(q, k, v, do)]
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    finite = np.isfinite(w)
    np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
    err = rel_err(g[finite], w[finite])
    record_error(jnp.bfloat16, f"into-{name}", err)
    # Same kernels on the same rows: equal up to summation order in dk/dv.
    assert err < (1e-2 if name in ("dk", "dv") else 1e-6), (name, err)
  # Rows of the first call only are untouched by the second.
  rows_a = np.zeros(layout.tq, bool)
  for off, n in zip(layout.q_offs[~pick], layout.q_lens[~pick]):
    rows_a[off:off + n] = True
  ref_a = [np.asarray(x, np.float32) for x in jax.jit(
      lambda q, k, v: CUDNN.forward(q, k, v, seg_a, mask=mask, scale=0.1))(
          q, k, v)]
  np.testing.assert_array_equal(got[0][rows_a], ref_a[0][rows_a])
  np.testing.assert_array_equal(got[1][rows_a], ref_a[1][rows_a])


def test_into_needs_rows_see_keys():
  layout = make_layout("many_short")
  q, k, v, _ = random_inputs(layout, 8, 2, 64, jnp.bfloat16)
  seg = layout.segments()
  out, lse = CUDNN.forward(q, k, v, seg, mask="causal_top_left", scale=0.1)
  with pytest.raises(ValueError, match="rows_see_keys"):
    CUDNN.forward(q, k, v, seg, mask="causal_top_left", scale=0.1,
                  into=(out, lse))


def test_dq_into_writes_only_its_rows(record_error):
  """Two backward calls on disjoint rows, the second writing into the
  first's dq (a fresh dq is 0 on the rows its call does not cover): the
  result is what one call on all segments gives, and the gaps between
  documents are exact zeros."""
  layout = make_layout("many_short", seed=5)
  q, k, v, do = random_inputs(layout, 8, 2, 128, jnp.bfloat16, seed=5)
  live = layout.q_lens > 0
  cut = int(np.flatnonzero(live)[live.sum() // 2])
  r = int(layout.q_offs[cut])                       # a document's first row
  ends = layout.q_offs + layout.q_lens
  before = live & (ends <= r)
  seg_a, seg_b, seg_all = (layout.subset(before),
                           layout.subset(live & ~before), layout.subset(live))
  mask = "causal_top_left"

  @jax.jit
  def two_calls(q, k, v, do):
    o, l = CUDNN.forward(q, k, v, seg_all, mask=mask, scale=0.1)
    dq, _, _ = CUDNN.backward(q, k, v, o, l, do, seg_a, mask=mask, scale=0.1)
    return CUDNN.backward(q, k, v, o, l, do, seg_b, mask=mask, scale=0.1,
                          dq_into=dq)[0]

  @jax.jit
  def one_call(q, k, v, do):
    o, l = CUDNN.forward(q, k, v, seg_all, mask=mask, scale=0.1)
    return CUDNN.backward(q, k, v, o, l, do, seg_all, mask=mask,
                          scale=0.1)[0]

  got = np.asarray(two_calls(q, k, v, do), np.float32)
  want = np.asarray(one_call(q, k, v, do), np.float32)
  assert np.isfinite(got).all()
  err = rel_err(got, want)
  record_error(jnp.bfloat16, "dq_into-dq", err)
  assert err < 1e-6, err
  np.testing.assert_array_equal(got[~layout.covered_q_rows()], 0.0)
