"""``fused_attention``: the varlen (THD) attention primitive, without CP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp import checks
from jax_cp.attention.backend import MASK_TYPES, Segments
from jax_cp.attention.registry import resolve_backend

_MASK_ALIASES = {"causal": "causal_bottom_right",
                 "padding_causal": "causal_bottom_right",
                 "padding": "no_mask"}


def check_mask_type(attn_mask_type: str) -> str:
  mask = _MASK_ALIASES.get(attn_mask_type, attn_mask_type)
  if mask not in MASK_TYPES:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of "
                     f"{list(MASK_TYPES) + list(_MASK_ALIASES)}")
  return mask


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  scale = float(softmax_scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"softmax_scale must be a positive finite float, got "
                     f"{softmax_scale!r}")
  return scale


def check_metadata_shapes(batch: int | None, **arrays) -> int:
  """All per-segment arrays have one shape, ``[N]`` or ``[B, N]``."""
  shapes = {name: np.shape(a) for name, a in arrays.items()}
  first = next(iter(shapes.values()))
  want_ndim = 1 if batch is None else 2
  for shape in shapes.values():
    if shape != first or len(shape) != want_ndim or (
        batch is not None and shape[0] != batch):
      raise ValueError(
          f"segment metadata must all be [N]{'' if batch is None else ' x B'} "
          f"int arrays matching q's batch; got {shapes}")
  return first[-1]


def _rows_see_keys(q_lens, kv_lens, mask: str) -> bool:
  """True when concrete metadata shows every covered row sees a key."""
  ql, kl = checks.concrete(q_lens), checks.concrete(kv_lens)
  if ql is None or kl is None:
    return False
  if mask == "causal_bottom_right":
    return bool(np.all((ql == 0) | (kl >= ql)))
  return bool(np.all((ql == 0) | (kl > 0)))


def _tiled_mask(q_lens, kv_lens, q_offs, kv_offs, mask: str, tq: int,
                tkv: int, max_q: int, max_kv: int) -> str | None:
  """The top-left mask when the call's segments tile its rows
  (:attr:`Segments.tiled`), else None: one segment per row at offset 0
  (known: concrete offsets), bounded by the row, top-left causal with
  ``q_len <= kv_len`` (known: the same length array, or concrete ones); a
  bottom-right mask with equal lengths is the same mask."""
  if np.shape(q_lens)[-1] != 1 or max_q != tq or max_kv != tkv or \
      mask == "no_mask":
    return None
  offsets = [checks.concrete(x) for x in (q_offs, kv_offs)]
  if any(o is None or np.any(o != 0) for o in offsets):
    return None
  if q_lens is kv_lens:
    return "causal_top_left"
  ql, kl = checks.concrete(q_lens), checks.concrete(kv_lens)
  if ql is None or kl is None:
    return None
  if mask == "causal_bottom_right":
    return "causal_top_left" if np.array_equal(ql, kl) else None
  return mask if np.all(ql <= kl) else None


def _clamp(offsets, lens, tokens: int, bound: int):
  """Offsets into ``[0, tokens]``, lengths into ``[0, min(bound, tokens -
  offset)]``."""
  offsets = jnp.clip(offsets, 0, tokens)
  return offsets, jnp.clip(lens, 0, jnp.minimum(bound, tokens - offsets))


def flatten_segments(q_lens, kv_lens, q_offs, kv_offs, tq, tkv, max_q, max_kv,
                     rows_see_keys=False, tiled=False) -> Segments:
  """``[B, N]`` (or ``[N]``) metadata over ``[B, Tq]`` / ``[B, Tkv]`` rows
  -> one :class:`Segments` list over the flattened ``[B*T]`` buffers, each
  segment clamped into its row and its bound."""
  as32 = lambda x: jnp.asarray(x, jnp.int32)
  q_lens, kv_lens, q_offs, kv_offs = map(as32, (q_lens, kv_lens, q_offs,
                                                kv_offs))
  # Concrete metadata was checked already; traced metadata cannot be, so it
  # is clamped: every segment then lies inside its buffer and within its
  # bound, and no kernel reads or writes outside the buffers.
  q_offs, q_lens = _clamp(q_offs, q_lens, tq, max_q)
  kv_offs, kv_lens = _clamp(kv_offs, kv_lens, tkv, max_kv)
  if q_lens.ndim == 2:
    rows = jnp.arange(q_lens.shape[0], dtype=jnp.int32)[:, None]
    q_offs = q_offs + rows * tq
    kv_offs = kv_offs + rows * tkv
  return Segments(q_lens.reshape(-1), kv_lens.reshape(-1),
                  q_offs.reshape(-1), kv_offs.reshape(-1), max_q, max_kv,
                  rows_see_keys, tiled)


def window_kwargs(window_left: int) -> dict:
  """The backend keywords of a sliding window: none without one, so
  backends without windows keep working."""
  return {} if window_left < 0 else dict(window_left=window_left)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, seg, backend, mask, scale, window_left):
  """(out, lse); callers stop the gradient of lse (its cotangent is dropped).
  ``backend`` is the resolved (hashable) backend."""
  return backend.forward(q, k, v, seg, mask=mask, scale=scale,
                         **window_kwargs(window_left))


def _attention_fwd(q, k, v, seg, backend, mask, scale, window_left):
  out, lse = _attention(q, k, v, seg, backend, mask, scale, window_left)
  return (out, lse), (q, k, v, seg, out, lse)


def _attention_bwd(backend, mask, scale, window_left, res, cotangents):
  dout, _ = cotangents       # lse is under stop_gradient: its cotangent is 0
  q, k, v, seg, out, lse = res
  dq, dk, dv = backend.backward(q, k, v, out, lse, dout.astype(out.dtype),
                                seg, mask=mask, scale=scale,
                                **window_kwargs(window_left))
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def fused_attention(q, k, v, q_seqlens, kv_seqlens, q_offsets, kv_offsets, *,
                    attn_mask_type: str = "causal_bottom_right",
                    softmax_scale: float | None = None,
                    backend: str = "auto",
                    max_seqlen_q: int | None = None,
                    max_seqlen_kv: int | None = None,
                    window_size=None,
                    return_lse: bool = False):
  """Attention over ragged segments of packed (THD) buffers, no CP.

  Segment ``i`` attends Q rows ``[q_offsets[i], q_offsets[i]+q_seqlens[i])``
  to KV rows ``[kv_offsets[i], kv_offsets[i]+kv_seqlens[i])``.

  Args:
    q: ``[Tq, Hq, D]`` or ``[B, Tq, Hq, D]``.
    k, v: ``[Tkv, Hkv, D]`` or ``[B, Tkv, Hkv, D]``; ``Hq % Hkv == 0``.
    q_seqlens, kv_seqlens: int ``[N]`` (``[B, N]``) actual lengths.
    q_offsets, kv_offsets: int ``[N]`` (``[B, N]``) first token of each
      segment within its row (for THD documents: ``cu_seqlens_padded[:-1]``).
    attn_mask_type: ``"causal_bottom_right"`` (alias ``"causal"``; the last Q
      row of a segment sees its last KV row), ``"causal_top_left"``, or
      ``"no_mask"``.
    softmax_scale: defaults to ``1/sqrt(D)``.
    backend: ``"auto"`` (cuDNN on CUDA when built and q/k/v are bfloat16 or
      float16; else XLA, with one logged line when cuDNN would have run but
      the inputs are float32), ``"cudnn"`` (bfloat16 or float16 only) or
      ``"xla"``.
    max_seqlen_q, max_seqlen_kv: static upper bounds on the segment lengths
      (default: the row lengths). Kernels size their grids by them, so tight
      bounds make short documents much faster. A segment longer than its
      bound gives undefined results on the cuDNN backend.
    window_size: ``None`` or a causal sliding window ``(left, 0)``: Q row
      ``j`` of a segment sees only the KV rows at most ``left`` before its
      diagonal (``j + kv_len - q_len`` bottom-right, ``j`` top-left), i.e. a
      query at document position ``i`` sees keys ``[i - left, i]``. ``left
      = -1``: no bound. Needs a causal mask.
    return_lse: also return the float32 log-sum-exp ``[.., Tq, Hq]``
      (``-inf`` on rows that see no key), under ``stop_gradient``.

  Returns:
    The output in q's shape and dtype; rows no segment covers are 0.
    Softmax runs in float32 whatever the input dtype.
  """
  checks.check_qkv_shapes(q.shape, k.shape, v.shape, allow_cross=True)
  checks.check_qkv_dtypes(q.dtype, k.dtype, v.dtype)
  mask = check_mask_type(attn_mask_type)
  window_left = checks.check_window_size(window_size, mask)
  scale = default_scale(q.shape[-1], softmax_scale)
  batch = q.shape[0] if q.ndim == 4 else None
  check_metadata_shapes(batch, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                        q_offsets=q_offsets, kv_offsets=kv_offsets)
  tq, tkv = q.shape[-3], k.shape[-3]
  max_q = tq if max_seqlen_q is None else min(int(max_seqlen_q), tq)
  max_kv = tkv if max_seqlen_kv is None else min(int(max_seqlen_kv), tkv)
  for name, value in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  checks.check_segments(q_seqlens, kv_seqlens, q_offsets, kv_offsets, tq, tkv)
  for name, lens, bound in (("q_seqlens", q_seqlens, max_q),
                            ("kv_seqlens", kv_seqlens, max_kv)):
    arr = checks.concrete(lens)
    if arr is not None and arr.size and arr.max() > bound:
      raise ValueError(f"{name} holds a segment of length {int(arr.max())} "
                       f"above its bound {bound} (max_seqlen / row length)")
  tiled_mask = _tiled_mask(q_seqlens, kv_seqlens, q_offsets, kv_offsets, mask,
                          tq, tkv, max_q, max_kv)
  if tiled_mask is not None:
    mask = tiled_mask
  seg = flatten_segments(q_seqlens, kv_seqlens, q_offsets, kv_offsets,
                          tq, tkv, max_q, max_kv,
                          _rows_see_keys(q_seqlens, kv_seqlens, mask),
                          tiled=tiled_mask is not None)
  resolved = resolve_backend(
      backend, dtype=q.dtype,
      score_bytes=4 * q.shape[-2] * math.prod(q.shape[:-2]) *
      math.prod(k.shape[:-2]))
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  out, lse = _attention(flat(q), flat(k), flat(v), seg, resolved, mask, scale,
                        window_left)
  out = out.reshape(q.shape)
  if not return_lse:
    return out
  return out, jax.lax.stop_gradient(lse).reshape(q.shape[:-1])
