"""fused_attention (the varlen primitive) with the xla backend against a
float64 numpy reference written segment by segment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp.attention import MASK_TYPES, registry
from tests.reference import rel_err

D = 8


def np_reference(q, k, v, ql, kl, qo, ko, mask, scale):
  """float64 attention per segment; returns out [Tq,Hq,D], lse [Tq,Hq]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  tq, hq, _ = q.shape
  g = hq // k.shape[1]
  out = np.zeros_like(q)
  lse = np.full((tq, hq), -np.inf)
  for s in range(len(ql)):
    for j in range(ql[s]):
      row = qo[s] + j
      n = kl[s]
      if mask == "causal_bottom_right":
        n = min(n, j + kl[s] - ql[s] + 1)
      elif mask == "causal_top_left":
        n = min(n, j + 1)
      if n <= 0:
        continue
      for h in range(hq):
        kk = k[ko[s]:ko[s] + n, h // g]
        sc = kk @ q[row, h] * scale
        m = sc.max()
        p = np.exp(sc - m)
        lse[row, h] = m + np.log(p.sum())
        out[row, h] = (p / p.sum()) @ v[ko[s]:ko[s] + n, h // g]
  return out, lse


def random_segments(rng, tq, tkv, n, kv_longer):
  """n segments with gaps between them, empty ones and length-1 ones."""
  ql, kl, qo, ko = [], [], [], []
  qpos = kpos = 0
  for i in range(n):
    qlen = 0 if i % 4 == 3 else (1 if i % 4 == 2 else int(rng.integers(2, 9)))
    klen = qlen + (int(rng.integers(0, 6)) if kv_longer else 0)
    qlen = min(qlen, tq - qpos)
    klen = min(klen, tkv - kpos)
    qlen = min(qlen, klen)
    ql.append(qlen)
    kl.append(klen)
    qo.append(qpos)
    ko.append(kpos)
    qpos += qlen + int(rng.integers(0, 3))     # gaps: uncovered rows
    kpos += klen + int(rng.integers(0, 3))
  return [np.asarray(x, np.int32) for x in (ql, kl, qo, ko)]


@pytest.mark.parametrize("mask", MASK_TYPES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)],
                         ids=["mha", "gqa", "mqa"])
def test_fused_attention_forward_backward(mask, heads, record_error):
  rng = np.random.default_rng(hash((mask, heads)) % 2**32)
  tq, tkv, n = 48, 72, 9
  kv_longer = mask == "causal_bottom_right"
  ql, kl, qo, ko = random_segments(rng, tq, tkv if kv_longer else tq, n,
                                   kv_longer)
  if not kv_longer:
    tkv = tq
  hq, hkv = heads
  q = rng.standard_normal((tq, hq, D)).astype(np.float32)
  k = rng.standard_normal((tkv, hkv, D)).astype(np.float32)
  v = rng.standard_normal((tkv, hkv, D)).astype(np.float32)
  scale = 0.3
  out, lse = jax_cp.fused_attention(
      q, k, v, ql, kl, qo, ko, attn_mask_type=mask, softmax_scale=scale,
      backend="xla", return_lse=True, max_seqlen_q=int(ql.max()),
      max_seqlen_kv=int(kl.max()))
  want, want_lse = np_reference(q, k, v, ql, kl, qo, ko, mask, scale)
  record_error(jnp.float32, "out", rel_err(out, want))
  assert rel_err(out, want) < 1e-5
  covered = np.isfinite(want_lse)
  np.testing.assert_array_equal(np.isfinite(lse), covered)
  np.testing.assert_allclose(np.asarray(lse)[covered], want_lse[covered],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[~covered.any(-1)], 0.0)

  # Gradients against finite differences of the float64 reference along a
  # random direction (independent of any autodiff).
  w = rng.standard_normal(q.shape)
  f = lambda q, k, v: jnp.sum(jax_cp.fused_attention(
      q, k, v, ql, kl, qo, ko, attn_mask_type=mask, softmax_scale=scale,
      backend="xla") * w)
  grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  for i, g in enumerate(grads):
    direction = rng.standard_normal(g.shape)
    eps = 1e-4
    args_p = [np.asarray(x, np.float64) for x in (q, k, v)]
    args_m = [a.copy() for a in args_p]
    args_p[i] = args_p[i] + eps * direction
    args_m[i] = args_m[i] - eps * direction
    fp = np.sum(np_reference(*args_p, ql, kl, qo, ko, mask, scale)[0] * w)
    fm = np.sum(np_reference(*args_m, ql, kl, qo, ko, mask, scale)[0] * w)
    numeric = (fp - fm) / (2 * eps)
    analytic = float(np.sum(np.asarray(g, np.float64) * direction))
    err = abs(analytic - numeric) / max(abs(numeric), 1e-6)
    record_error(jnp.float32, "d" + "qkv"[i], err)
    assert err < 1e-3, (i, analytic, numeric)
  # Uncovered rows get no gradient.
  np.testing.assert_array_equal(np.asarray(grads[0])[~covered.any(-1)], 0.0)


def test_fused_attention_batched_bf16_matches_rows():
  rng = np.random.default_rng(5)
  b, t = 3, 32
  q = jnp.asarray(rng.standard_normal((b, t, 4, D)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((b, t, 2, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((b, t, 2, D)), jnp.bfloat16)
  segs = [random_segments(rng, t, t, 5, False) for _ in range(b)]
  ql, kl, qo, ko = (np.stack([s[i] for s in segs]) for i in range(4))
  out = jax_cp.fused_attention(q, k, v, ql, kl, qo, ko,
                               attn_mask_type="causal_top_left",
                               backend="xla")
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  for i in range(b):
    want, _ = np_reference(q[i].astype(np.float32), k[i].astype(np.float32),
                           v[i].astype(np.float32), ql[i], kl[i], qo[i],
                           ko[i], "causal_top_left", 1 / np.sqrt(D))
    assert rel_err(out[i], want) < 1e-2


def test_auto_backend_on_cpu_is_xla():
  assert registry.resolve_backend("auto", "cpu").name == "xla"
  with pytest.raises(ValueError, match="backend='nope' is not available"):
    registry.resolve_backend("nope")


@pytest.mark.parametrize("n", [1, 3])
def test_offsets_none_are_segments_back_to_back(n):
  """``q_offsets=None`` / ``kv_offsets=None``: the segments lie back to
  back from each row's start; traced lengths (jit) give the values of the
  explicit offsets and of the float64 reference, output and gradients."""
  rng = np.random.default_rng(30 + n)
  b, t, hq, hkv, d = 2, 32, 4, 2, 8
  lens = rng.integers(1, t // n + 1, (b, n)).astype(np.int32)
  offs = (np.cumsum(lens, -1) - lens).astype(np.int32)
  q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
  k, v = (rng.standard_normal((b, t, hkv, d)).astype(np.float32)
          for _ in range(2))
  do = rng.standard_normal(q.shape).astype(np.float32)

  def loss(q, k, v, lens, offs):
    o = jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                               attn_mask_type="causal_bottom_right",
                               backend="xla")
    return jnp.sum(o * do), o
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, got), got_g = grad(q, k, v, lens, None)
  (_, want), want_g = grad(q, k, v, lens, offs)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  ref = np.stack([np_reference(q[i], k[i], v[i], lens[i], lens[i], offs[i],
                               offs[i], "causal_bottom_right", d ** -0.5)[0]
                  for i in range(b)])
  assert rel_err(np.asarray(got), ref) < 1e-5
