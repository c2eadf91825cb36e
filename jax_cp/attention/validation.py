"""Checks of an attention call's arguments: every ``check_*`` raises
``ValueError`` naming the argument, the rule it broke and the offending
values, before any kernel runs.

Checks on values run only when the values are concrete (numpy, or JAX
arrays outside a trace, :func:`concrete`); under ``jit`` the shape, dtype
and configuration checks still run at trace time.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

#: The masks of a varlen call: ``"causal_bottom_right"`` (the last Q row of
#: a segment sees its last KV row), ``"causal_top_left"`` (Q row ``j`` sees
#: KV rows ``<= j``), ``"no_mask"``.
MASK_TYPES = ("no_mask", "causal_top_left", "causal_bottom_right")


def concrete(x: Any) -> np.ndarray | None:
  """``x`` as a numpy array if its value is known now, else None."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return None


def check_mask_type(attn_mask_type: Any) -> str:
  """One of :data:`MASK_TYPES`."""
  if attn_mask_type not in MASK_TYPES:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} is not one of "
                     f"{list(MASK_TYPES)}")
  return attn_mask_type


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
  """``softmax_scale``, or ``1/sqrt(head_dim)`` when None."""
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  scale = float(softmax_scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"softmax_scale must be a positive finite float, got "
                     f"{softmax_scale!r}")
  return scale


def check_window_size(window_size: Any, attn_mask_type: str) -> int:
  """The left bound of a causal sliding window ``(left, 0)``: a query at
  document position ``i`` sees keys ``[i - left, i]``. Returns ``left``,
  or -1 for no window (``None``, ``(-1, 0)``, and ``(-1, -1)``, the
  unbounded window of any mask). A bounded window needs a causal mask and
  ``right == 0``; ``left`` is an int ``>= 0`` (``0``: a query sees only
  itself) or ``-1`` (unbounded)."""
  if window_size is None:
    return -1
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise ValueError(f"window_size must be None or a pair (left, right) of "
                     f"ints, got {window_size!r}") from None
  for name, x in (("left", left), ("right", right)):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
      raise ValueError(f"window_size={tuple(window_size)!r}: {name} must be "
                       f"a static int, got {type(x).__name__}")
  left, right = int(left), int(right)
  if (left, right) == (-1, -1):
    return -1
  if right != 0:
    raise ValueError(
        f"window_size={(left, right)}: the right window must be 0 (causal "
        f"sliding window); keys after the query are not supported")
  if left < -1:
    raise ValueError(
        f"window_size={(left, right)}: the left window must be >= 0, or -1 "
        f"for no bound, got {left}")
  if left >= 0 and attn_mask_type == "no_mask":
    raise ValueError(
        f"window_size={(left, right)} is a causal sliding window; it needs "
        f"a causal mask, got attn_mask_type={attn_mask_type!r}")
  return left


def check_qkv_shapes(q_shape, k_shape, v_shape, *, allow_cross: bool = False
                     ) -> None:
  """Rank 3 ``[T, H, D]`` or 4 ``[B, T, H, D]``, same rank and batch, equal
  head dims, ``Hq % Hkv == 0``, K and V alike, and (self-attention) equal
  token counts."""
  if len(q_shape) not in (3, 4):
    raise ValueError(f"q must be [T, H, D] or [B, T, H, D], got shape "
                     f"{tuple(q_shape)}")
  if len(k_shape) != len(q_shape) or len(v_shape) != len(q_shape):
    raise ValueError(f"q, k, v must have the same rank; got {tuple(q_shape)}, "
                     f"{tuple(k_shape)}, {tuple(v_shape)}")
  if tuple(k_shape) != tuple(v_shape):
    raise ValueError(f"k {tuple(k_shape)} and v {tuple(v_shape)} must have "
                     "the same shape")
  if len(q_shape) == 4 and q_shape[0] != k_shape[0]:
    raise ValueError(f"batch sizes differ: q {q_shape[0]}, k {k_shape[0]}")
  if q_shape[-1] != k_shape[-1]:
    raise ValueError(f"head dims differ: q has {q_shape[-1]}, k/v have "
                     f"{k_shape[-1]}")
  hq, hkv = q_shape[-2], k_shape[-2]
  if hkv < 1 or hq % hkv:
    raise ValueError(f"the number of query heads ({hq}) must be a multiple of "
                     f"the number of key/value heads ({hkv}) (GQA/MQA)")
  if not allow_cross and q_shape[-3] != k_shape[-3]:
    raise ValueError(
        f"CP attention is self-attention: q has {q_shape[-3]} tokens but k/v "
        f"have {k_shape[-3]} (cross-attention is not supported)")


def check_qkv_dtypes(q_dtype, k_dtype, v_dtype) -> None:
  """q, k and v share one floating dtype (not FP8)."""
  dtypes = {"q": np.dtype(q_dtype), "k": np.dtype(k_dtype),
            "v": np.dtype(v_dtype)}
  for name, dt in dtypes.items():
    if not jax.numpy.issubdtype(dt, jax.numpy.floating):
      raise ValueError(
          f"{name} must have a floating dtype (bfloat16, float16 or float32), "
          f"got {name}.dtype={dt.name}")
    if "float8" in dt.name:
      raise ValueError(f"FP8 inputs ({name}.dtype={dt.name}) are not "
                       f"supported")
  if len(set(dtypes.values())) > 1:
    raise ValueError(
        "q, k and v must have one dtype, got "
        + ", ".join(f"{n}.dtype={d.name}" for n, d in dtypes.items()))


def check_metadata_shapes(batch: int | None, **arrays) -> int:
  """All per-segment arrays have one shape, ``[N]`` or ``[B, N]``; returns
  N."""
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


def check_segments(q_seqlens: Any, kv_seqlens: Any, q_offsets: Any,
                   kv_offsets: Any, q_tokens: int, kv_tokens: int) -> None:
  """Rules of ragged segment metadata (``fused_attention``), checked when
  the values are concrete: lengths and offsets are non-negative, every
  segment lies inside its buffer (``offset + length <= tokens``), and the
  Q rows of different segments of a row never overlap (every Q row is
  written by at most one segment). K/V rows may be shared: they are only
  read."""
  named = {"q_seqlens": q_seqlens, "kv_seqlens": kv_seqlens,
           "q_offsets": q_offsets, "kv_offsets": kv_offsets}
  values = {n: concrete(a) for n, a in named.items()}
  for name, arr in values.items():
    if arr is not None and not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{name} must be an integer array, got dtype "
                       f"{arr.dtype}")
    if arr is not None and arr.size and arr.min() < 0:
      i = np.unravel_index(int(np.argmin(arr)), arr.shape)
      raise ValueError(f"{name} must be >= 0, but {name}"
                       f"{[int(j) for j in i]} = {int(arr[i])}")
  for side, tokens in (("q", q_tokens), ("kv", kv_tokens)):
    lens, offs = values[f"{side}_seqlens"], values[f"{side}_offsets"]
    if lens is None or offs is None:
      continue
    end = offs.astype(np.int64) + lens
    bad = np.argwhere((lens > 0) & (end > tokens))
    if bad.size:
      i = tuple(int(j) for j in bad[0])
      raise ValueError(
          f"segment {list(i)} runs past the end of the buffer: "
          f"{side}_offsets={int(offs[i])} + {side}_seqlens={int(lens[i])} = "
          f"{int(end[i])} > {tokens} {side} tokens")
  lens, offs = values["q_seqlens"], values["q_offsets"]
  if lens is None or offs is None:
    return
  lens2 = lens.reshape(-1, lens.shape[-1])
  offs2 = offs.reshape(-1, offs.shape[-1])
  for row, (ln, of) in enumerate(zip(lens2, offs2)):
    live = np.nonzero(ln > 0)[0]
    order = live[np.argsort(of[live], kind="stable")]
    for a, b in zip(order[:-1], order[1:]):
      if of[a] + ln[a] > of[b]:
        where = f" (row {row})" if len(lens2) > 1 else ""
        raise ValueError(
            f"the Q rows of segments {int(a)} and {int(b)}{where} overlap: "
            f"[{int(of[a])}, {int(of[a] + ln[a])}) and "
            f"[{int(of[b])}, {int(of[b] + ln[b])}) (q_offsets/q_seqlens); "
            f"every Q row may belong to one segment only")
