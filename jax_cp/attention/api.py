"""``fused_attention``: the varlen (THD) attention primitive, without CP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention import padding, validation
from jax_cp.attention.backend import keyed_rows, row_segments
from jax_cp.attention.mask import AttentionMask
from jax_cp.attention.registry import resolve_backend
from jax_cp.typing import Array, ArrayLike, WindowSize


def _rows_see_keys(q_lens, kv_lens, mask: str, window_left: int) -> bool:
  """True when concrete metadata shows every covered row sees a key
  (:func:`~jax_cp.attention.backend.keyed_rows`)."""
  ql, kl = validation.concrete(q_lens), validation.concrete(kv_lens)
  if ql is None or kl is None:
    return False
  first, end = keyed_rows(ql, kl, mask, window_left, xp=np)
  return bool(np.all((first == 0) & (end == ql)))


def _tiled_mask(q_lens, kv_lens, q_offs, kv_offs, mask: str, tq: int,
                tkv: int, max_q: int, max_kv: int) -> str | None:
  """The top-left mask when the call's segments tile its rows
  (:attr:`Segments.tiled`), else None: one segment per row at offset 0
  (known: concrete offsets), bounded by the row, top-left causal with
  ``q_len <= kv_len`` (known: the same length array, or concrete ones); a
  bottom-right mask with equal lengths is the same mask."""
  m = AttentionMask(mask)
  if np.shape(q_lens)[-1] != 1 or max_q != tq or max_kv != tkv or \
      not m.causal:
    return None
  offsets = [validation.concrete(x) for x in (q_offs, kv_offs)]
  if any(o is None or np.any(o != 0) for o in offsets):
    return None
  if q_lens is kv_lens:
    return "causal_top_left"
  ql, kl = validation.concrete(q_lens), validation.concrete(kv_lens)
  if ql is None or kl is None:
    return None
  if m.bottom_right:
    return "causal_top_left" if np.array_equal(ql, kl) else None
  return mask if np.all(ql <= kl) else None


def _may_tile(tiled_mask: str | None, mask: str, metadata) -> bool:
  """Whether a call whose tiling :func:`_tiled_mask` could not establish
  on the host may still tile its rows by traced metadata
  (:attr:`Segments.tile_rows`, decided on the device): a causal mask, and
  some metadata traced (concrete ones were read on the host)."""
  return (tiled_mask is None and AttentionMask(mask).causal
          and any(validation.concrete(x) is None for x in metadata))


def _packed_offsets(lens):
  """Offsets of segments that lie back to back from their row's start: 0
  (static) for one segment per row, else the exclusive cumulative sum of
  the lengths."""
  if np.shape(lens)[-1] == 1:
    return np.zeros(np.shape(lens), np.int32)
  lens = jnp.asarray(lens, jnp.int32)
  return jnp.cumsum(lens, axis=-1) - lens


def window_kwargs(window_left: int) -> dict:
  """The backend keywords of a sliding window: none without one, so
  backends without windows keep working."""
  return {} if window_left < 0 else dict(window_left=window_left)


def _padding_rows(seg, q, k, zero_padding: bool):
  """``(q_valid, kv_valid)`` of a call that clears its padding rows
  (:mod:`jax_cp.attention.padding`), else ``(None, None)``."""
  if not zero_padding:
    return None, None
  return padding.segment_rows(seg, q.shape[0], k.shape[0])


def _clear_inputs(q, k, v, seg, zero_padding: bool):
  """q, k, v with 0 on the rows no segment reads (when ``zero_padding``)."""
  q_valid, kv_valid = _padding_rows(seg, q, k, zero_padding)
  (q,) = padding.zero_rows(q_valid, q)
  k, v = padding.zero_rows(kv_valid, k, v)
  return q, k, v


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention(q, k, v, seg, backend, mask, scale, window_left,
               zero_padding):
  """(out, lse); callers stop the gradient of lse (its cotangent is dropped).
  ``backend`` is the resolved (hashable) backend; ``zero_padding``: clear
  the padding rows of q, k, v (and of dout in the backward) first."""
  q, k, v = _clear_inputs(q, k, v, seg, zero_padding)
  return backend.forward(q, k, v, seg, mask=mask, scale=scale,
                         **window_kwargs(window_left))


def _attention_fwd(q, k, v, seg, backend, mask, scale, window_left,
                   zero_padding):
  q, k, v = _clear_inputs(q, k, v, seg, zero_padding)
  out, lse = backend.forward(q, k, v, seg, mask=mask, scale=scale,
                             **window_kwargs(window_left))
  return (out, lse), (q, k, v, seg, out, lse)


def _attention_bwd(backend, mask, scale, window_left, zero_padding, res,
                   cotangents):
  dout, _ = cotangents       # lse is under stop_gradient: its cotangent is 0
  q, k, v, seg, out, lse = res
  # The residual q, k, v are cleared already; dout's padding rows are not.
  (dout,) = padding.zero_rows(_padding_rows(seg, q, k, zero_padding)[0],
                              dout.astype(out.dtype))
  dq, dk, dv = backend.backward(q, k, v, out, lse, dout, seg, mask=mask,
                                scale=scale, **window_kwargs(window_left))
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention_out(q, k, v, seg, backend, mask, scale, window_left,
                   zero_padding):
  """out alone. Undifferentiated, this is the inference form
  (``backend.forward_out``: no softmax statistics computed or written);
  differentiated, the forward keeps lse for the backward."""
  if backend.forward_out is None:
    return _attention(q, k, v, seg, backend, mask, scale, window_left,
                      zero_padding)[0]
  q, k, v = _clear_inputs(q, k, v, seg, zero_padding)
  return backend.forward_out(q, k, v, seg, mask=mask, scale=scale,
                             **window_kwargs(window_left))


def _attention_out_fwd(q, k, v, seg, backend, mask, scale, window_left,
                       zero_padding):
  (out, _), res = _attention_fwd(q, k, v, seg, backend, mask, scale,
                                 window_left, zero_padding)
  return out, res


def _attention_out_bwd(backend, mask, scale, window_left, zero_padding, res,
                       dout):
  return _attention_bwd(backend, mask, scale, window_left, zero_padding, res,
                        (dout, None))


_attention_out.defvjp(_attention_out_fwd, _attention_out_bwd)


def fused_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                    q_seqlens: ArrayLike, kv_seqlens: ArrayLike,
                    q_offsets: ArrayLike | None = None,
                    kv_offsets: ArrayLike | None = None, *,
                    attn_mask_type: str = "causal_bottom_right",
                    softmax_scale: float | None = None,
                    backend: str = "auto",
                    max_seqlen_q: int | None = None,
                    max_seqlen_kv: int | None = None,
                    window_size: WindowSize = None,
                    return_lse: bool = False,
                    deterministic: bool | None = None
                    ) -> Array | tuple[Array, Array]:
  """Attention over ragged segments of packed (THD) buffers, no CP.

  Segment ``i`` attends Q rows ``[q_offsets[i], q_offsets[i]+q_seqlens[i])``
  to KV rows ``[kv_offsets[i], kv_offsets[i]+kv_seqlens[i])``.

  Args:
    q: ``[Tq, Hq, D]`` or ``[B, Tq, Hq, D]``.
    k, v: ``[Tkv, Hkv, D]`` or ``[B, Tkv, Hkv, D]``; ``Hq % Hkv == 0``.
    q_seqlens, kv_seqlens: int ``[N]`` (``[B, N]``) actual lengths.
    q_offsets, kv_offsets: int ``[N]`` (``[B, N]``) first token of each
      segment within its row (for THD documents: ``cu_seqlens_padded[:-1]``),
      or None: the segments lie back to back from the row's start. With
      one segment per row (``N == 1``) None states the offset 0 statically,
      so traced lengths of a row holding one document from its start still
      run cuDNN's dense graph (docs/internals.md, Tiled calls). Traced
      offsets (or several segments per row) with the rows' lengths as
      bounds let the cuDNN backend choose that graph on the device, where
      every row holds one segment from its start.
    attn_mask_type: ``"causal_bottom_right"`` (the last Q row of a segment
      sees its last KV row), ``"causal_top_left"`` (Q row ``j`` sees KV
      rows ``<= j``), or ``"no_mask"``.
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
      (``-inf`` on rows that see no key), under ``stop_gradient``. Without
      it, a forward that nothing differentiates runs the inference form:
      no log-sum-exp is computed or written (the cudnn backend's
      ``forward_out``).
    deterministic: the deterministic mode (docs/determinism.md): ``True``
      runs the backend's deterministic backward (bitwise the same results
      run to run; on cuDNN slower and with a larger scratch, split over
      head groups and K/V ranges where it must be, ``ValueError`` where no
      split fits), ``False`` the fastest one, ``None`` (default) follows
      XLA's ``--xla_gpu_exclude_nondeterministic_ops``.

  Returns:
    The output in q's shape and dtype; rows no segment covers are 0.
    Softmax runs in float32 whatever the input dtype. Q rows no segment
    covers and K/V rows no segment reads reach no other row's output or
    gradient, whatever they hold (NaN and infinities included), nor does
    the output's cotangent on uncovered rows; their gradients are 0.
  """
  if q_offsets is None:
    q_offsets = _packed_offsets(q_seqlens)
  if kv_offsets is None:
    kv_offsets = (q_offsets if kv_seqlens is q_seqlens
                  else _packed_offsets(kv_seqlens))
  validation.check_qkv_shapes(q.shape, k.shape, v.shape, allow_cross=True)
  validation.check_qkv_dtypes(q.dtype, k.dtype, v.dtype)
  mask = validation.check_mask_type(attn_mask_type)
  window_left = validation.check_window_size(window_size, mask)
  scale = validation.default_scale(q.shape[-1], softmax_scale)
  batch = q.shape[0] if q.ndim == 4 else None
  validation.check_metadata_shapes(
      batch, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, q_offsets=q_offsets,
      kv_offsets=kv_offsets)
  tq, tkv = q.shape[-3], k.shape[-3]
  max_q = tq if max_seqlen_q is None else min(int(max_seqlen_q), tq)
  max_kv = tkv if max_seqlen_kv is None else min(int(max_seqlen_kv), tkv)
  for name, value in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  validation.check_segments(q_seqlens, kv_seqlens, q_offsets, kv_offsets, tq,
                            tkv)
  for name, lens, bound in (("q_seqlens", q_seqlens, max_q),
                            ("kv_seqlens", kv_seqlens, max_kv)):
    arr = validation.concrete(lens)
    if arr is not None and arr.size and arr.max() > bound:
      raise ValueError(f"{name} holds a segment of length {int(arr.max())} "
                       f"above its bound {bound} (max_seqlen / row length)")
  tiled_mask = _tiled_mask(q_seqlens, kv_seqlens, q_offsets, kv_offsets, mask,
                          tq, tkv, max_q, max_kv)
  if tiled_mask is not None:
    mask = tiled_mask
  metadata = (q_seqlens, kv_seqlens, q_offsets, kv_offsets)
  seg = row_segments(*metadata, tq, tkv, max_q, max_kv,
                     rows_see_keys=_rows_see_keys(q_seqlens, kv_seqlens, mask,
                                                  window_left),
                     tiled=tiled_mask is not None, clamp=True,
                     may_tile=_may_tile(tiled_mask, mask, metadata))
  resolved = resolve_backend(
      backend, dtype=q.dtype,
      score_bytes=4 * q.shape[-2] * math.prod(q.shape[:-2]) *
      math.prod(k.shape[:-2]), deterministic=deterministic)
  # Rows no segment reads are cleared unless concrete metadata show none.
  zero_padding = padding.may_hold_padding(
      *(validation.concrete(x) for x in (q_seqlens, kv_seqlens, q_offsets,
                                         kv_offsets)), tq, tkv)
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  if not return_lse:
    return _attention_out(flat(q), flat(k), flat(v), seg, resolved, mask,
                          scale, window_left, zero_padding).reshape(q.shape)
  out, lse = _attention(flat(q), flat(k), flat(v), seg, resolved, mask, scale,
                        window_left, zero_padding)
  return (out.reshape(q.shape),
          jax.lax.stop_gradient(lse).reshape(q.shape[:-1]))
