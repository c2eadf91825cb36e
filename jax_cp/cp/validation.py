"""Checks of CP's arguments (row metadata, cp sizes, mesh axes, the
``max_seqlen`` bound): every ``check_*`` raises ``ValueError`` naming the
argument, the rule it broke and the offending values, before any kernel
runs. The attention call's own checks (q/k/v, masks, windows) are
:mod:`jax_cp.attention.validation`'s.

Checks on metadata values run only when the values are concrete (numpy, or
JAX arrays outside a trace); under ``jit`` the shape and configuration
checks still run at trace time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_cp.attention.validation import check_window_size, concrete
from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.dual_chunk_swap import (  # the cost model's
  check_dual_chunk_divisible as check_dual_chunk_divisible,
)
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy

#: The masks of CP attention: causal within each document, or none.
CP_MASK_TYPES = ("causal", "no_mask")


def check_cp_size(cp_size: Any) -> None:
  if not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
    raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")


def check_cp_rank(cp_rank: Any, cp_size: int) -> None:
  r = concrete(cp_rank)
  if r is not None and not 0 <= int(r) < cp_size:
    raise ValueError(f"cp_rank={int(r)} is outside [0, cp_size={cp_size})")


def check_divisible_tokens(total_tokens: int, cp_size: int,
                           argname: str = "T") -> None:
  if total_tokens % cp_size:
    raise ValueError(
        f"the token count {argname}={total_tokens} must be divisible by "
        f"cp_size={cp_size} (T % cp == {total_tokens % cp_size})")


def check_cu_seqlens_padded(cu_seqlens_padded: Any,
                            total_tokens: int | None = None) -> None:
  """Shape ``[N+1]``/``[B, N+1]``; if concrete: starts at 0, never
  decreases, ends at ``total_tokens`` (when given) in every row."""
  ndim = np.ndim(cu_seqlens_padded)
  if ndim not in (1, 2) or np.shape(cu_seqlens_padded)[-1] < 2:
    raise ValueError(
        "cu_seqlens_padded must have shape [N+1] or [B, N+1] with N >= 1, "
        f"got shape {np.shape(cu_seqlens_padded)}")
  cuP = concrete(cu_seqlens_padded)
  if cuP is None:
    return
  cuP = cuP.reshape(-1, cuP.shape[-1])
  for row, c in enumerate(cuP):
    where = f" (row {row})" if len(cuP) > 1 else ""
    if c[0] != 0:
      raise ValueError(f"cu_seqlens_padded{where} must start at 0, got "
                       f"{c[0]}: {c.tolist()}")
    bad = np.nonzero(np.diff(c) < 0)[0]
    if bad.size:
      i = int(bad[0])
      raise ValueError(
          f"cu_seqlens_padded{where} must be non-decreasing, but entry "
          f"{i + 1} ({c[i + 1]}) < entry {i} ({c[i]}): {c.tolist()}")
    if total_tokens is not None and c[-1] != total_tokens:
      raise ValueError(
          f"cu_seqlens_padded{where}[-1]={c[-1]} must equal the token count "
          f"T={total_tokens} of the inputs")
  if len(set(cuP[:, -1].tolist())) > 1:
    raise ValueError("every row of cu_seqlens_padded must end at the same T, "
                     f"got {cuP[:, -1].tolist()}")


def check_cu_seqlens(cu_seqlens: Any, cu_seqlens_padded: Any) -> None:
  """Same shape as the padded one; if concrete: starts at 0, lengths are
  non-negative and never above the padded lengths."""
  if np.shape(cu_seqlens) != np.shape(cu_seqlens_padded):
    raise ValueError(
        f"cu_seqlens {np.shape(cu_seqlens)} and cu_seqlens_padded "
        f"{np.shape(cu_seqlens_padded)} must have the same shape")
  cu, cuP = concrete(cu_seqlens), concrete(cu_seqlens_padded)
  if cu is None:
    return
  cu = cu.reshape(-1, cu.shape[-1])
  lens = np.diff(cu, axis=-1)
  if (cu[:, 0] != 0).any():
    raise ValueError(f"cu_seqlens must start at 0, got {cu[:, 0].tolist()}")
  if (lens < 0).any():
    row, b = map(int, np.argwhere(lens < 0)[0])
    raise ValueError(f"cu_seqlens must be non-decreasing: document {b} of "
                     f"row {row} has length {lens[row, b]}")
  if cuP is None:
    return
  plens = np.diff(cuP.reshape(-1, cuP.shape[-1]), axis=-1)
  if (lens > plens).any():
    row, b = map(int, np.argwhere(lens > plens)[0])
    raise ValueError(
        f"document {b} (row {row}) has valid length {lens[row, b]} above its "
        f"padded length {plens[row, b]} (cu_seqlens vs cu_seqlens_padded)")


def check_seq_len_matches(n_tokens: int, cu_seqlens_padded: Any,
                          argname: str) -> None:
  cuP = concrete(cu_seqlens_padded)
  if cuP is not None and cuP.size and int(cuP.reshape(-1)[-1]) != n_tokens:
    raise ValueError(
        f"{argname} has {n_tokens} tokens but cu_seqlens_padded[-1] is "
        f"{int(cuP.reshape(-1)[-1])}; they must match")


def check_attention_config(strategy: CPLoadBalancingStrategy,
                           attn_mask_type: str, window_size: Any,
                           dtype: Any) -> None:
  """The supported configurations of CP attention: causal or unmasked
  attention, a causal sliding window
  (:func:`jax_cp.attention.validation.check_window_size`), causal only
  with NO_LOAD_BALANCE, floating q, no FP8."""
  if attn_mask_type not in CP_MASK_TYPES:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} is not supported by "
                     f"CP attention; expected one of {list(CP_MASK_TYPES)}")
  check_window_size(window_size, attn_mask_type)
  strategy_for(strategy).check_mask(attn_mask_type)
  if not jax.numpy.issubdtype(np.dtype(dtype), jax.numpy.floating):
    raise ValueError(f"q must have a floating dtype (bfloat16, float16 or "
                     f"float32), got q.dtype={np.dtype(dtype).name}")
  if "float8" in np.dtype(dtype).name:
    raise ValueError(f"FP8 inputs (dtype={np.dtype(dtype).name}) are not "
                     f"supported by CP attention")


def check_comm_type(comm_type: str, strategy: CPLoadBalancingStrategy,
                    window_left: int, cp_size: int, total_tokens: int
                    ) -> None:
  """The ring exchange (``comm_type="ring"``) with a sliding window: none
  under DUAL_CHUNK_SWAP, whose windowed plan reads per-document key ranges
  across chunks; under NO_LOAD_BALANCE a window shorter than ``(cp-1) *
  T/cp`` tokens, which the halo exchange moves (a longer one reaches the
  whole row: the all-gather)."""
  if comm_type != "ring" or window_left < 0 or cp_size == 1:
    return
  strategy_for(strategy).check_ring_window(window_left, cp_size,
                                          total_tokens)


def check_comm_axes(comm_type: str, cp_axes: tuple[str, ...]) -> None:
  """``comm_type="all_to_all+ring"`` runs the all-to-all over the inner
  mesh axis and the ring over the outer one: it needs ``cp_axis=(outer,
  inner)``, two axes."""
  if comm_type == "all_to_all+ring" and len(cp_axes) != 2:
    raise ValueError(
        f"comm_type='all_to_all+ring' needs cp_axis=(outer, inner), two mesh "
        f"axes (the all-to-all over the inner, the ring over the outer), got "
        f"cp_axis={cp_axes[0] if len(cp_axes) == 1 else cp_axes!r}")
  if comm_type not in ("all_to_all", "all_to_all+ring") and len(cp_axes) > 2:
    raise ValueError(f"cp_axis={cp_axes!r}: at most two mesh axes")


def check_head_scatter(q_heads: int, kv_heads: int, size: int,
                       comm_type: str) -> None:
  """The all-to-all exchanges scatter the heads over ``size`` ranks: every
  rank gets ``Hq / size`` query heads and the K/V heads they use, so
  ``Hq % size == 0``, and ``Hkv % size == 0`` or (fewer K/V heads than
  ranks) ``size % Hkv == 0``, each K/V head then sent to the ``size /
  Hkv`` ranks whose query heads read it. Heads are counted per tensor
  parallel shard."""
  if q_heads % size:
    raise ValueError(
        f"comm_type={comm_type!r} scatters the query heads over {size} "
        f"ranks: q has {q_heads} heads (per head_axis shard), not a "
        f"multiple of {size}")
  if kv_heads % size and size % kv_heads:
    raise ValueError(
        f"comm_type={comm_type!r} over {size} ranks needs the K/V heads "
        f"({kv_heads} per head_axis shard) to be a multiple or a divisor of "
        f"{size}")


def check_mesh_axis(mesh: Any, axis: str | None, argname: str) -> None:
  if axis is None:
    return
  names = tuple(getattr(mesh, "axis_names", ()) or ())
  if axis not in names:
    raise ValueError(f"{argname}={axis!r} is not an axis of the mesh; its "
                     f"axes are {names}")


def check_cu_seqlens_rank(q_shape, **metadata: Any) -> None:
  """Row metadata is ``[N+1]`` for q ``[T, H, D]`` and ``[B, N+1]`` for q
  ``[B, T, H, D]``, of an integer dtype."""
  batched = len(q_shape) == 4
  for name, x in metadata.items():
    if np.ndim(x) != (2 if batched else 1) or (
        batched and np.shape(x)[0] != q_shape[0]):
      raise ValueError(
          f"{name} must be [N+1] for q [T, H, D] or [B, N+1] for q "
          f"[B, T, H, D]; got {name} {np.shape(x)} with q {tuple(q_shape)}")
    dtype = jax.numpy.result_type(x)
    if not jax.numpy.issubdtype(dtype, jax.numpy.integer):
      raise ValueError(f"{name} must hold integers, got {dtype}")


def check_max_seqlen(max_seqlen: Any, cu_seqlens_padded: Any,
                     total_tokens: int, cu_seqlens: Any = None,
                     strategy: CPLoadBalancingStrategy | None = None,
                     cp_size: int = 1) -> int:
  """``max_seqlen`` as an int bound in ``[1, T]`` (None = T); when the
  metadata is concrete, raises if a document's span
  (:func:`document_spans`) is longer."""
  if max_seqlen is None:
    return total_tokens
  if isinstance(max_seqlen, jax.core.Tracer) or int(max_seqlen) < 1:
    raise ValueError(f"max_seqlen must be a static positive int, got "
                     f"{max_seqlen!r}")
  check_max_seqlen_bound(cu_seqlens_padded, max_seqlen, cu_seqlens,
                         strategy, cp_size)
  return min(int(max_seqlen), total_tokens)


def spans_padded_slots(strategy: CPLoadBalancingStrategy | None,
                       cp_size: int) -> bool:
  """Whether a document's whole padded slot counts against ``max_seqlen``,
  by the strategy's rule (DUAL_CHUNK_SWAP at cp > 1 cuts every slot into
  ``2*cp`` chunks of its padded length, so the kernels' bounds hold padded
  lengths); elsewhere (NO_LOAD_BALANCE, cp = 1, layer chunks: no
  strategy) a query reads back only over its document's valid tokens."""
  if not strategy:
    return False
  return strategy_for(strategy).spans_padded_slots(cp_size)


def document_spans(cu_seqlens: Any, cu_seqlens_padded: Any,
                   strategy: CPLoadBalancingStrategy | None = None,
                   cp_size: int = 1):
  """Per slot, the tokens the ``max_seqlen`` bound must cover, ``[..,
  N]`` (numpy for numpy metadata, else JAX): the valid length, or with
  DUAL_CHUNK_SWAP at cp > 1 (:func:`spans_padded_slots`) the padded
  length of a slot that holds a token. An empty slot (valid length 0: the
  padding after a row's last document, a row of padding) spans nothing,
  whatever its padded length. Without ``cu_seqlens`` (None) every padded
  slot counts in full."""
  return slot_spans(cu_seqlens, cu_seqlens_padded,
                    spans_padded_slots(strategy, cp_size))


def slot_spans(cu_seqlens: Any, cu_seqlens_padded: Any,
               padded_slots: bool):
  """:func:`document_spans` by the rule ``padded_slots`` (a slot that
  holds a token counts with its padded length, else its valid one)."""
  xp = np if all(isinstance(x, (np.ndarray, list, tuple)) or x is None
                 for x in (cu_seqlens, cu_seqlens_padded)) else jax.numpy
  cuP = xp.asarray(cu_seqlens_padded)
  padded = cuP[..., 1:] - cuP[..., :-1]
  if cu_seqlens is None:
    return padded
  cu = xp.asarray(cu_seqlens)
  valid = cu[..., 1:] - cu[..., :-1]
  if padded_slots:
    return xp.where(valid > 0, padded, 0)
  return valid


def check_max_seqlen_bound(cu_seqlens_padded: Any, max_seqlen: Any,
                           cu_seqlens: Any = None,
                           strategy: CPLoadBalancingStrategy | None = None,
                           cp_size: int = 1) -> None:
  """Raises if a concrete row holds a document whose span
  (:func:`document_spans`) is longer than ``max_seqlen`` (a no-op for
  traced metadata; traced ``cu_seqlens`` with concrete padded metadata
  are checked as if every slot held tokens).

  Raises:
    ValueError: naming the row, the slot, its valid and padded lengths
      and the bound.
  """
  cuP = concrete(cu_seqlens_padded)
  if cuP is None or not cuP.size:
    return
  cuP = cuP.reshape(-1, cuP.shape[-1])
  cu = concrete(cu_seqlens)
  if cu is not None:
    cu = cu.reshape(cuP.shape)
  spans = document_spans(cu, cuP, strategy, cp_size)
  if not spans.size or int(spans.max()) <= int(max_seqlen):
    return
  row, slot = map(int, np.argwhere(spans == spans.max())[0])
  padded = int(cuP[row, slot + 1] - cuP[row, slot])
  if cu is None:
    detail = ("cu_seqlens not given: every padded slot counts, the "
              "padding after a row's last document too")
  else:
    valid = int(cu[row, slot + 1] - cu[row, slot])
    rule = ("DUAL_CHUNK_SWAP cuts the padded slot into chunks"
            if spans_padded_slots(strategy, cp_size) else
            "its valid tokens count")
    detail = f"valid length {valid}, padded length {padded}; {rule}"
  raise ValueError(
      f"max_seqlen={max_seqlen} is smaller than the longest padded document "
      f"({padded} tokens) that counts: slot {slot} of row {row} ({detail}). "
      "Raise max_seqlen to the longest document, or split documents longer "
      "than it")


def check_batch_axis_rank(batch_axis: Any, q_shape) -> None:
  """A batch (data-parallel) axis needs inputs ``[B, T, H, D]``."""
  if batch_axis and len(q_shape) != 4:
    raise ValueError(f"batch_axis={batch_axis!r} needs inputs [B, T, H, D], "
                     f"got q {tuple(q_shape)}")


def check_head_axis_divides(head_axis: str | None, size: int,
                            q_shape, k_shape) -> None:
  """A head (tensor-parallel) axis must divide ``Hq`` and ``Hkv``."""
  if head_axis is not None and (k_shape[-2] % size or q_shape[-2] % size):
    raise ValueError(f"head_axis={head_axis!r} of size {size} must divide "
                     f"Hq={q_shape[-2]} and Hkv={k_shape[-2]}")
