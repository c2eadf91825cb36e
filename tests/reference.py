"""Independent references for the tests: plain masked attention on the
unpartitioned row, and random packed layouts.

Nothing here imports jax_cp's attention code: the reference builds the
document mask from token positions directly, so it shares no metadata logic
with the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def doc_mask(cu, cuP, causal=True, window=-1):
  """Boolean [T, T]: token i may attend token j (same document, both valid,
  and j <= i when causal; with a sliding window ``window >= 0`` also
  ``j >= i - window``). Built with a Python loop over documents."""
  cu, cuP = np.asarray(cu), np.asarray(cuP)
  t = int(cuP[-1])
  m = np.zeros((t, t), bool)
  for b in range(len(cuP) - 1):
    s, n = int(cuP[b]), int(cu[b + 1] - cu[b])
    blk = np.ones((n, n), bool)
    if causal:
      blk = np.tril(blk)
    if window >= 0:
      pos = np.arange(n)
      blk &= pos[None, :] >= pos[:, None] - window
    m[s:s + n, s:s + n] = blk
  return m


def attention(q, k, v, cu, cuP, causal=True, scale=None, window=-1):
  """Plain masked softmax attention in float32 on one row ``[T, H, D]``;
  rows that see nothing give 0. Differentiable with jax.grad. ``window``:
  the left bound of a causal sliding window (-1: none)."""
  m = jnp.asarray(doc_mask(cu, cuP, causal, window))
  d = q.shape[2]
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  return _masked_attention(q, k, v, m, jnp.float32(scale))


@jax.jit
def _masked_attention(q, k, v, m, scale):
  """The attention of :func:`attention` given its mask: one compiled
  program (eager calls and their gradients are not dispatched op by op)."""
  hq, hk = q.shape[1], k.shape[1]
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k = jnp.repeat(k, hq // hk, axis=1)
  v = jnp.repeat(v, hq // hk, axis=1)
  s = jnp.einsum("qhd,khd->hqk", q, k, precision=_HIGHEST) * scale
  s = jnp.where(m[None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1) * m[None]
  return jnp.einsum("hqk,khd->qhd", p, v, precision=_HIGHEST)


def batched_attention(q, k, v, cu, cuP, causal=True, window=-1):
  return jnp.stack([attention(q[i], k[i], v[i], cu[i], cuP[i], causal,
                              window=window)
                    for i in range(q.shape[0])])


def valid_token_mask(cu, cuP):
  """Boolean [T]: token is a valid (non-padding) token of some document."""
  cu, cuP = np.asarray(cu), np.asarray(cuP)
  out = np.zeros(int(cuP[-1]), bool)
  for b in range(len(cuP) - 1):
    out[cuP[b]:cuP[b] + cu[b + 1] - cu[b]] = True
  return out


def random_layout(rng, total, cp, kind, dual_chunk=True, max_docs=None,
                  pad=True):
  """A packed row of ``total`` tokens as (cu_seqlens, cu_seqlens_padded).

  kind: "one_long" (one document), "many_short" (documents shorter than cp
  included), "mixed" (long and short documents straddling rank
  boundaries). DUAL_CHUNK_SWAP layouts pad every document to a multiple of
  2*cp; with ``pad`` documents also get random extra padding. ``max_docs``
  adds empty trailing slots.
  """
  unit = 2 * cp if dual_chunk else 1
  assert total % unit == 0
  if kind == "one_long":
    plens = [total]
  else:
    plens, left = [], total
    hi = {"many_short": max(unit, total // 12),
          "mixed": max(unit, total // 2)}[kind]
    while left > 0:
      p = int(rng.integers(1, hi + 1))
      p = min(left, -(-p // unit) * unit)
      plens.append(p)
      left -= p
  lens = []
  for p in plens:
    if not pad:
      lens.append(p)
    elif kind == "many_short" and rng.random() < 0.3:
      lens.append(int(rng.integers(1, min(p, cp) + 1)))   # shorter than cp
    elif rng.random() < 0.5:
      lens.append(int(rng.integers(max(1, p - 2 * unit), p + 1)))
    else:
      lens.append(p)
  n = len(plens) if max_docs is None else max_docs
  assert n >= len(plens)
  cuP = np.zeros(n + 1, np.int32)
  cu = np.zeros(n + 1, np.int32)
  cuP[1:len(plens) + 1] = np.cumsum(plens)
  cu[1:len(lens) + 1] = np.cumsum(lens)
  cuP[len(plens) + 1:] = cuP[len(plens)]
  cu[len(lens) + 1:] = cu[len(lens)]
  return cu, cuP


def rows_with_longest(rng, total, w, batch, max_docs):
  """``(cu, cuP)`` ``[batch, max_docs+1]``: rows of ``total`` tokens whose
  padded documents are at most ``w`` long, one of exactly ``w`` per row
  (so ``w`` is a tight ``max_seqlen``), about 40 % of them with padding;
  unused slots are empty documents at the end."""
  cus, cuPs = [], []
  for _ in range(batch):
    plens = [w]
    while sum(plens) < total:
      plens.append(int(rng.integers(1, w + 1)))
    plens[-1] -= sum(plens) - total
    rng.shuffle(plens)
    plens = [p for p in plens if p > 0]
    lens = [p if rng.random() < 0.6 else int(rng.integers(1, p + 1))
            for p in plens]
    cuP = np.full(max_docs + 1, total, np.int32)
    cu = np.zeros(max_docs + 1, np.int32)
    cuP[0] = 0
    cuP[1:len(plens) + 1] = np.cumsum(plens)
    cu[1:len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1:] = cu[len(lens)]
    cus.append(cu)
    cuPs.append(cuP)
  return np.stack(cus), np.stack(cuPs)


def rel_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def attention_f64(q, k, v, cu, cuP, dout, causal=True, window=-1):
  """Plain masked attention on one row ``[T, H, D]`` in float64 numpy, and
  its gradients for the output's cotangent ``dout``, written out by hand
  (``dS = P * (dP - rowsum(dO * O))``): ``(out, dq, dk, dv)``. Rows that
  see nothing give 0."""
  m = doc_mask(cu, cuP, causal, window)
  q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
  hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
  g = hq // hk
  kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  scale = 1.0 / np.sqrt(d)
  s = np.einsum("qhd,khd->hqk", q, kr) * scale
  s = np.where(m[None], s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  p = np.exp(s - top)
  den = p.sum(-1, keepdims=True)
  p = p / np.where(den > 0, den, 1.0)
  out = np.einsum("hqk,khd->qhd", p, vr)
  dp = np.einsum("qhd,khd->hqk", dout, vr)
  rowsum = np.einsum("qhd,qhd->hq", dout, out)[..., None]
  ds = p * (dp - rowsum)
  dq = np.einsum("hqk,khd->qhd", ds, kr) * scale
  dkr = np.einsum("hqk,qhd->khd", ds, q) * scale
  dvr = np.einsum("hqk,qhd->khd", p, dout)
  t = q.shape[0]
  dk = dkr.reshape(t, hk, g, d).sum(2)
  dv = dvr.reshape(t, hk, g, v.shape[2]).sum(2)
  return out, dq, dk, dv
