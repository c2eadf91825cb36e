"""Validation: every ``check_*`` raises ``ValueError`` naming the argument,
the rule it broke and the offending values, before any kernel runs.

Checks on metadata values run only when the values are concrete (numpy, or
JAX arrays outside a trace); under ``jit`` the shape and configuration
checks still run at trace time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jax_cp.strategy import CPLoadBalancingStrategy

CP_COMM_TYPES = ("all_gather",)
# Accepted besides CP_COMM_TYPES: the exchange without communication
# (KVExchange.communicate), for timing a step's exchange.
CP_COMM_LOCAL_COPIES = "local_copies"
CP_MASK_TYPES = ("causal", "no_mask")


def concrete(x: Any) -> np.ndarray | None:
  """``x`` as a numpy array if its value is known now, else None."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return None


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


def check_dual_chunk_divisible(cu_seqlens_padded: Any, cp_size: int) -> None:
  """DUAL_CHUNK_SWAP needs every padded length divisible by ``2*cp``."""
  cuP = concrete(cu_seqlens_padded)
  if cuP is None:
    return
  plens = np.diff(cuP.reshape(-1, cuP.shape[-1]), axis=-1)
  bad = np.argwhere(plens % (2 * cp_size) != 0)
  if bad.size:
    row, b = map(int, bad[0])
    raise ValueError(
        f"load_balancing_strategy=dual_chunk_swap needs every padded document "
        f"length divisible by 2*cp_size={2 * cp_size}; document {b} (row "
        f"{row}) has padded length {plens[row, b]}. Pad documents to a "
        f"multiple of {2 * cp_size}, or use NO_LOAD_BALANCE (any length).")


def check_seq_len_matches(n_tokens: int, cu_seqlens_padded: Any,
                          argname: str) -> None:
  cuP = concrete(cu_seqlens_padded)
  if cuP is not None and cuP.size and int(cuP.reshape(-1)[-1]) != n_tokens:
    raise ValueError(
        f"{argname} has {n_tokens} tokens but cu_seqlens_padded[-1] is "
        f"{int(cuP.reshape(-1)[-1])}; they must match")


def check_attention_config(strategy: CPLoadBalancingStrategy,
                           attn_mask_type: str, cp_comm_type: str,
                           window_size: Any, dtype: Any) -> None:
  """The supported configurations of CP attention: the all-gather
  exchange (or the benchmarks' local copies), causal or unmasked attention,
  a causal sliding window (:func:`check_window_size`), causal only with
  NO_LOAD_BALANCE, floating q, no FP8."""
  if cp_comm_type not in CP_COMM_TYPES + (CP_COMM_LOCAL_COPIES,):
    raise ValueError(f"cp_comm_type={cp_comm_type!r} is not supported; jax_cp "
                     f"implements {list(CP_COMM_TYPES)}")
  if attn_mask_type not in CP_MASK_TYPES:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} is not supported by "
                     f"CP attention; expected one of {list(CP_MASK_TYPES)}")
  check_window_size(window_size, attn_mask_type)
  if strategy is CPLoadBalancingStrategy.NO_LOAD_BALANCE:
    if attn_mask_type != "causal":
      raise ValueError(
          f"load_balancing_strategy=no_load_balance needs causal attention, "
          f"got attn_mask_type={attn_mask_type!r}")
  if not jax.numpy.issubdtype(np.dtype(dtype), jax.numpy.floating):
    raise ValueError(f"q must have a floating dtype (bfloat16, float16 or "
                     f"float32), got q.dtype={np.dtype(dtype).name}")
  if "float8" in np.dtype(dtype).name:
    raise ValueError(f"FP8 inputs (dtype={np.dtype(dtype).name}) are not "
                     f"supported by CP attention")


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
  if left >= 0 and attn_mask_type in ("no_mask", "padding"):
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
  lens2, offs2 = lens.reshape(-1, lens.shape[-1]), offs.reshape(-1,
                                                                offs.shape[-1])
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
                     total_tokens: int) -> int:
  """``max_seqlen`` as an int bound in ``[1, T]`` (None = T); when the
  metadata is concrete, raises if a padded document is longer."""
  if max_seqlen is None:
    return total_tokens
  if isinstance(max_seqlen, jax.core.Tracer) or int(max_seqlen) < 1:
    raise ValueError(f"max_seqlen must be a static positive int, got "
                     f"{max_seqlen!r}")
  check_max_seqlen_bound(cu_seqlens_padded, max_seqlen)
  return min(int(max_seqlen), total_tokens)


def check_max_seqlen_bound(cu_seqlens_padded: Any, max_seqlen: Any) -> None:
  """Raises if a concrete row holds a padded document longer than
  ``max_seqlen`` (a no-op for traced metadata)."""
  cuP = concrete(cu_seqlens_padded)
  if cuP is None or not cuP.size:
    return
  longest = int(np.diff(cuP.reshape(-1, cuP.shape[-1]), axis=-1).max(
      initial=0))
  if longest > int(max_seqlen):
    raise ValueError(
        f"max_seqlen={max_seqlen} is smaller than the longest padded "
        f"document ({longest} tokens) in cu_seqlens_padded")


#: What a step does when its traced metadata breaks the ``max_seqlen``
#: bound (:mod:`jax_cp.seqlen_guard`).
MAX_SEQLEN_VIOLATIONS = ("fallback", "error", "checked_on_host")


#: DUAL_CHUNK_SWAP's windowed call plans (docs/design.md, Call plans).
DCS_WINDOW_PLANS = ("split", "split_backward", "bottom_right")


def check_dcs_window_plan(dcs_window_plan: Any) -> None:
  if dcs_window_plan not in DCS_WINDOW_PLANS:
    raise ValueError(f"dcs_window_plan={dcs_window_plan!r} is not one of "
                     f"{list(DCS_WINDOW_PLANS)}")


def check_max_seqlen_violation(max_seqlen_violation: Any) -> None:
  if max_seqlen_violation not in MAX_SEQLEN_VIOLATIONS:
    raise ValueError(f"max_seqlen_violation={max_seqlen_violation!r} is not "
                     f"one of {list(MAX_SEQLEN_VIOLATIONS)}")


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
