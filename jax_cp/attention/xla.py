"""The ``"xla"`` backend: varlen attention in plain JAX, on any platform.

It materialises the dense ``[Tq, Tkv]`` score matrix per head with the
segment mask applied, in float32 whatever the input dtype, so it is the
reference the cuDNN backend is checked against and the CPU/CI path. Memory
grows with ``Tq * Tkv * Hq``: keep it for moderate sizes.

It has no in-place writes (``supports_in_place`` is False): every call
returns fresh buffers and the CP layer merges them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp.attention.backend import Backend, Segments, poisoned
from jax_cp.attention.mask import AttentionMask

_HIGHEST = jax.lax.Precision.HIGHEST


def segment_mask(seg: Segments, tq: int, tkv: int, mask: str,
                 window_left: int = -1):
  """Boolean ``[Tq, Tkv]``: which KV rows each Q row sees, and the int32
  ``[Tq]`` segment index of each Q row (-1 where no segment covers it).
  ``window_left >= 0`` bounds a causal mask to a band: a Q row sees the KV
  rows at most ``window_left`` before its diagonal."""
  t = jnp.arange(tq, dtype=jnp.int32)
  inside = ((t[None, :] >= seg.q_offsets[:, None])
            & (t[None, :] < (seg.q_offsets + seg.q_lens)[:, None]))  # [S, Tq]
  covered = inside.any(axis=0)
  sid = jnp.where(covered, jnp.argmax(inside, axis=0), 0)
  q_off, q_len = seg.q_offsets[sid], seg.q_lens[sid]
  kv_off, kv_len = seg.kv_offsets[sid], seg.kv_lens[sid]
  u = jnp.arange(tkv, dtype=jnp.int32)[None, :]
  i = u - kv_off[:, None]                       # KV row within the segment
  j = (t - q_off)[:, None]                      # Q row within the segment
  ok = covered[:, None] & (i >= 0) & (i < kv_len[:, None])
  offset = AttentionMask(mask).diagonal_offset(q_len, kv_len)
  if offset is not None:
    diagonal = j + offset[:, None]
    ok &= i <= diagonal
    if window_left >= 0:
      ok &= i >= diagonal - window_left
  return ok, jnp.where(covered, sid, -1)


def _scores(q, k, scale):
  tq, hq, d = q.shape
  hkv = k.shape[1]
  qg = q.astype(jnp.float32).reshape(tq, hkv, hq // hkv, d)
  s = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32),
                 precision=_HIGHEST)
  return s * scale                                    # [Hkv, G, Tq, Tkv]


def _probs(q, k, lse, ok, scale):
  tq, hq, _ = q.shape
  hkv = k.shape[1]
  s = _scores(q, k, scale)
  lse_g = lse.reshape(tq, hkv, hq // hkv).transpose(1, 2, 0)[..., None]
  finite = jnp.isfinite(lse_g)
  p = jnp.exp(s - jnp.where(finite, lse_g, 0.0))
  return jnp.where(ok & finite, p, 0.0)


def forward(q, k, v, seg: Segments, *, mask: str, scale: float,
            window_left: int = -1):
  """``(out, lse)`` of the contract (:mod:`jax_cp.attention.backend`)."""
  tq, hq, d = q.shape
  ok, _ = segment_mask(seg, tq, k.shape[0], mask, window_left)
  s = jnp.where(ok, _scores(q, k, scale), -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.sum(jnp.exp(s - m_safe), axis=-1, keepdims=True)
  lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)),
                  -jnp.inf)
  p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0))
  p = jnp.where(ok, p, 0.0)
  out = jnp.einsum("hgqk,khd->qhgd", p, v.astype(jnp.float32),
                   precision=_HIGHEST)
  out = out.reshape(tq, hq, d).astype(q.dtype)
  lse = lse[..., 0].transpose(2, 0, 1).reshape(tq, hq)
  return poisoned(seg, out, lse)


def backward(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
             scale: float, window_left: int = -1):
  """``(dq, dk, dv)`` of the contract (:mod:`jax_cp.attention.backend`)."""
  tq, hq, d = q.shape
  tkv, hkv, _ = k.shape
  g = hq // hkv
  ok, _ = segment_mask(seg, tq, tkv, mask, window_left)
  p = _probs(q, k, lse, ok, scale)                     # [Hkv, G, Tq, Tkv]
  do = dout.astype(jnp.float32).reshape(tq, hkv, g, d)
  o = out.astype(jnp.float32).reshape(tq, hkv, g, d)
  dv = jnp.einsum("hgqk,qhgd->khd", p, do, precision=_HIGHEST)
  dp = jnp.einsum("qhgd,khd->hgqk", do, v.astype(jnp.float32),
                  precision=_HIGHEST)
  delta = jnp.einsum("qhgd,qhgd->hgq", do, o)[..., None]
  ds = p * (dp - delta) * scale
  dq = jnp.einsum("hgqk,khd->qhgd", ds, k.astype(jnp.float32),
                  precision=_HIGHEST).reshape(tq, hq, d)
  dk = jnp.einsum("hgqk,qhgd->khd", ds,
                  q.astype(jnp.float32).reshape(tq, hkv, g, d),
                  precision=_HIGHEST)
  return poisoned(seg, dq.astype(q.dtype), dk.astype(k.dtype),
                  dv.astype(v.dtype))


def is_available(platform: str) -> bool:
  """Runs on every platform."""
  del platform
  return True


# Its backward is dense einsums in a fixed order: deterministic wherever
# XLA's own dots are (docs/determinism.md).
BACKEND = Backend(name="xla", forward=forward, backward=backward,
                  is_available=is_available, exact_past_bounds=True,
                  handles_poison=True, deterministic_backward=backward)
