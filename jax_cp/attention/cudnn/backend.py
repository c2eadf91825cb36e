"""The ``"cudnn"`` attention backend: cuDNN SDPA over packed segments (XLA FFI).

Importing this module loads the compiled extension ``jax_cp._jax_cp_cuda``
and registers its FFI targets (SDPA forward and backward and the in-place
row merge of :mod:`jax_cp.attention.decompose.merge`) for the CUDA platform;
:data:`BACKEND` is the backend :mod:`jax_cp.attention.registry` lists.
Without the extension the import fails (the registry checks that it exists
before importing this module, and explains how to build it).

The backend supports in-place writes (``into=``, ``dq_into=``;
:class:`~jax_cp.attention.backend.InPlaceAttentionBackend`): a call writes
its rows into aliased buffers of an earlier call.

The wrapper is thin: it validates shapes and dtypes (``check_*`` functions,
``ValueError``), turns :class:`~jax_cp.attention.backend.Segments` into the
per-segment lengths and token offsets of the custom call (the handler
builds cuDNN's ragged *element* offsets from them, 64-bit where a call's
tensors reach :data:`INT32_OFFSET_ELEMENT_LIMIT` elements:
:func:`ragged_offset_bits`) and calls the custom call. The handler
gives the rows cuDNN leaves undefined their values, with a kernel that
reads the segment list on the device (no pass over the whole buffer, so
traced metadata cost what constants cost):

* Q rows no segment covers, and Q rows that see no key (``kv_len == 0``,
  ``j < q_len - kv_len`` with the bottom-right causal mask, rows past a
  top-left window's reach): 0 in ``out`` and ``dq``, ``-inf`` in ``lse``;
* KV rows no query sees: 0 in ``dk`` and ``dv``.

Tiled segments (``Segments.tiled``: one document per row of a batch, at
cp=1) run cuDNN's dense graph, the one ``jax.nn.dot_product_attention``
builds, without the ragged offsets and the padding mask that slow the
same kernels down: it runs at jax.nn's speed (docs/decisions.md). The
handler fills the rows past each segment's length after the forward; the
backward gets those rows' ``lse`` as a huge value, so their
probabilities and their share of every gradient are exactly 0, and reads
the ``lse`` head-major as cuDNN 9.19 wants for a dense graph
(docs/internals.md, Tiled calls). Segments whose traced metadata alone can
tell whether they tile their rows (``Segments.tile_rows``: a batch's
document slots with one document in a row, offsets passed as jit
arguments) run a ``lax.cond`` between the tiled and the ragged call, on
a predicate computed on the device (:func:`tiled_choice`): the tiled call
gives the same results (:func:`~jax_cp.attention.backend.row_tiling`)
and the documents make nearly all of its work.

A sliding window (``window_left``) is cuDNN's diagonal band,
``set_diagonal_band_left_bound(window_left + 1)`` on both alignments,
forward and backward (docs/internals.md, Sliding window); bottom-right segments
first drop the KV rows before their band (:func:`_cut_to_band`).

Limitation (cuDNN writes dK/dV per segment, it does not accumulate): the
segments' KV row ranges must not overlap for ``backward`` to be right. The CP
layer's per-document segments never overlap.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax  # Before the extension: JAX's CUDA plugin loads cuDNN/cudart.
import jax.numpy as jnp
import numpy as np

import jax_cp._jax_cp_cuda as _jax_cp_cuda  # ModuleNotFoundError when absent
from jax_cp.attention.backend import (
  MASK_TYPES,
  Backend,
  Segments,
  poisoned,
  row_tiling,
  tiling_applies,
  with_scratch_limit,
)
from jax_cp.attention.cudnn import split, workspace
from jax_cp.attention.decompose.merge import (
  NO_WEIGHT_LSE,
  check_merge_rows,
  merge_rows_jnp,
)
from jax_cp.attention.mask import AttentionMask

# The C++/Python contract comes from the extension (csrc/ffi_targets.h).
#: FFI target names by role, as the extension registers them.
FFI_TARGETS: dict[str, str] = dict(_jax_cp_cuda.FFI_TARGETS)
FWD_TARGET = FFI_TARGETS["sdpa_fwd"]
BWD_TARGET = FFI_TARGETS["sdpa_bwd"]
# The same calls writing into aliased buffers (``into=`` / ``dq_into=``).
FWD_INTO_TARGET = FFI_TARGETS["sdpa_fwd_into"]
#: The inference form: out alone, no softmax stats in the graph.
FWD_OUT_TARGET = FFI_TARGETS["sdpa_fwd_out"]
BWD_INTO_TARGET = FFI_TARGETS["sdpa_bwd_into"]
MERGE_TARGET = FFI_TARGETS["merge_rows"]
#: Values of the merge call's ``op`` attribute, and the dtypes it takes.
MERGE_OP_CODES: dict[str, int] = dict(_jax_cp_cuda.MERGE_OP_CODES)

#: Values of the custom calls' ``mask`` attribute.
MASK_CODES: dict[str, int] = dict(_jax_cp_cuda.MASK_CODES)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM: int = _jax_cp_cuda.MAX_HEAD_DIM
#: The segment metadata operand: int32 [rows, W], W >= S + 1 a multiple of
#: the width multiple.
SEGMENT_META_ROWS: int = _jax_cp_cuda.SEGMENT_META_ROWS
SEGMENT_META_WIDTH_MULTIPLE: int = _jax_cp_cuda.SEGMENT_META_WIDTH_MULTIPLE
MERGE_DTYPES = (jnp.dtype(jnp.float32),) + SUPPORTED_DTYPES
_INT32_LIMIT = 2**31


def graph_cache_stats() -> dict[str, int]:
  """``dict(builds=, hits=, entries=)`` of the process-wide graph cache."""
  return dict(_jax_cp_cuda.graph_cache_stats())


def reset_graph_cache_stats() -> None:
  """Zeroes the ``builds``/``hits`` counters (the cached graphs are kept)."""
  _jax_cp_cuda.reset_graph_cache_stats()


def retry_cudnn_handle() -> int:
  """Forgets the cuDNN handle creations that failed, so the next call on
  those devices tries ``cudnnCreate`` again; returns how many it forgot.

  A failed creation (typically a GPU without free memory) is remembered
  per device, and later calls fail at once with that message instead of
  calling cuDNN again; creation is retried by itself only once the
  device's free memory has grown by 64 MiB. Call this after freeing
  memory by other means."""
  return int(_jax_cp_cuda.reset_failed_handles())


def build_info() -> dict[str, Any]:
  """Compile-time versions of the cuDNN frontend, cuDNN and CUDA headers."""
  return dict(_jax_cp_cuda.build_info())


# ----------------------------------------------------------------------------
# Validation (static: shapes, dtypes, attributes)
# ----------------------------------------------------------------------------


def check_dtypes(q, k, v) -> None:
  """q, k, v must share one dtype, bfloat16 or float16."""
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(
        f"backend 'cudnn' needs bfloat16 or float16 q/k/v, got q.dtype="
        f"{q.dtype}; cast the inputs or use backend='xla'.")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(
        f"backend 'cudnn' needs q, k, v of one dtype; got q={q.dtype}, "
        f"k={k.dtype}, v={v.dtype}.")


def check_shapes(q, k, v) -> None:
  """q [Tq,Hq,D], k = v [Tkv,Hkv,D]; D a multiple of 8 <= 256; Hq % Hkv == 0."""
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError(
        f"backend 'cudnn' needs rank-3 [T, H, D] q/k/v; got q{q.shape} "
        f"k{k.shape} v{v.shape}.")
  if k.shape != v.shape or q.shape[2] != k.shape[2]:
    raise ValueError(
        f"k and v must have equal shapes and q's head dim; got q{q.shape} "
        f"k{k.shape} v{v.shape}.")
  d = q.shape[2]
  if d <= 0 or d % 8 != 0 or d > MAX_HEAD_DIM:
    raise ValueError(
        f"backend 'cudnn' needs a head dim that is a positive multiple of 8 "
        f"and <= {MAX_HEAD_DIM}; got D={d}.")
  hq, hkv = q.shape[1], k.shape[1]
  if hkv <= 0 or hq % hkv != 0:
    raise ValueError(
        f"the number of query heads must be a multiple of the number of "
        f"key/value heads; got Hq={hq}, Hkv={hkv}.")


def check_token_counts(q_shape, k_shape) -> None:
  """The call carries int32 token offsets: Tq and Tkv must be < 2**31."""
  for name, shape in (("q", q_shape), ("k/v", k_shape)):
    if int(shape[0]) >= _INT32_LIMIT:
      raise ValueError(
          f"{name} of shape {tuple(shape)} has {shape[0]} tokens; backend "
          f"'cudnn' takes at most 2**31 - 1 tokens per call.")


#: The largest element count that cuDNN 9.19's ragged backward addresses
#: exactly with int32 element offsets, per tensor it addresses through them
#: (Q, K/V, and its own float32 buffers sized like Q and like K/V at the
#: query heads): past it dK/dV and then dQ come out wrong
#: (docs/internals.md, Ragged offsets). At or past it a
#: call gets int64 offsets.
INT32_OFFSET_ELEMENT_LIMIT = 2**29


def _dq_accumulator_rows(q_shape, segments: int, max_q: int) -> int:
  """The rows of the backward's float32 dQ accumulator: the packed Q rows,
  or the segment slots ``S * max_seqlen_q`` where the frontend ignores the
  packed totals (a head dim that is not a multiple of 16)."""
  tq, hq, d = (int(n) for n in q_shape)
  ws = workspace.backward_workspace(tq, tq, hq, hq, d,
                                          segments=segments,
                                          max_seqlen_q=max_q)
  return ws.dq_accum // (4 * hq * d)


def ragged_offset_bits(q_shape, k_shape, segments: int, max_q: int) -> int:
  """The width (32 or 64) of the ragged element offsets of a call.

  32 while every tensor cuDNN addresses through the offsets holds fewer
  than :data:`INT32_OFFSET_ELEMENT_LIMIT` elements, 64 otherwise. The
  tensors are Q and K/V, and the backward's float32 buffers: the dQ
  accumulator (``Tq * Hq * D`` elements, or ``S * max_seqlen_q * Hq * D``
  where the frontend sizes it by the segment slots, with a head dim that is
  not a multiple of 16) and dK/dV at the ``Hq`` query heads
  (``Tkv * Hq * D``). Static shapes only: one graph per shape.
  """
  _, hq, d = (int(n) for n in q_shape)
  tkv, hkv, _ = (int(n) for n in k_shape)
  rows_q = _dq_accumulator_rows(q_shape, segments, max_q)
  largest = max(rows_q * hq * d, tkv * max(hq, hkv) * d)
  return 64 if largest >= INT32_OFFSET_ELEMENT_LIMIT else 32


#: How much larger than the packed one a slot-sized dQ accumulator may be
#: (and at least how many bytes) before the backward refuses the call.
SLOT_ACCUMULATOR_FACTOR = 4
SLOT_ACCUMULATOR_MIN_BYTES = 2**30


def check_backward_workspace(q_shape, segments: int, max_q: int,
                             tiled: bool) -> None:
  """With a head dim that is not a multiple of 16 the frontend sizes the
  backward's float32 dQ accumulator by the segment slots (``S *
  max_seqlen_q`` rows) instead of the packed rows: at many segments that
  is far more memory than the call holds. Raise, before any kernel, when
  it exceeds :data:`SLOT_ACCUMULATOR_FACTOR` times the packed size and
  :data:`SLOT_ACCUMULATOR_MIN_BYTES`."""
  if tiled:
    return
  tq, hq, d = (int(n) for n in q_shape)
  rows = _dq_accumulator_rows(q_shape, segments, max_q)
  slot_bytes = rows * hq * d * 4
  if rows > SLOT_ACCUMULATOR_FACTOR * tq and \
      slot_bytes > SLOT_ACCUMULATOR_MIN_BYTES:
    raise ValueError(
        f"backend 'cudnn' backward with head dim D={d} (not a multiple of "
        f"16): cuDNN sizes its float32 dQ accumulator by the segment slots, "
        f"S * max_seqlen_q = {segments} * {max_q} rows * Hq={hq} * D * 4 = "
        f"{slot_bytes / 2**30:.1f} GiB, against {tq * hq * d * 4 / 2**30:.2f} "
        f"GiB for the call's Tq={tq} rows. Use a head dim that is a "
        f"multiple of 16, a tighter max_seqlen, or fewer segments per call.")


def check_mask(mask) -> None:
  if mask not in MASK_CODES:
    raise ValueError(f"mask must be one of {MASK_TYPES}, got {mask!r}.")


def check_window(window_left, mask) -> None:
  """A static int >= -1; a bounded window only with a causal mask."""
  if isinstance(window_left, bool) or not isinstance(
      window_left, (int, np.integer)) or window_left < -1 or \
      window_left >= _INT32_LIMIT - 1:
    raise ValueError(f"window_left must be a static int in [-1, 2**31 - 1), "
                     f"got {window_left!r}.")
  if window_left >= 0 and not AttentionMask(mask).causal:
    raise ValueError(f"window_left={window_left} is a causal sliding window; "
                     f"mask='no_mask' has none.")


def _cut_to_band(seg: Segments, mask: str, window_left: int) -> Segments:
  """Bottom-right segments without the KV rows before the band of their
  first Q row (``max(kv_len - q_len - window_left, 0)`` rows): no query
  sees them, so they leave every segment's KV range and the handler sets
  their dK/dV rows to 0 rather than leaving them to the kernel, which may
  skip the fully masked tiles. Results are unchanged."""
  if window_left < 0 or not AttentionMask(mask).bottom_right:
    return seg
  q_lens = seg.q_lens.astype(jnp.int32)
  kv_lens = seg.kv_lens.astype(jnp.int32)
  skip = jnp.where(q_lens > 0,
                   jnp.maximum(kv_lens - q_lens - window_left, 0), 0)
  return dataclasses.replace(seg, kv_lens=kv_lens - skip,
                             kv_offsets=seg.kv_offsets.astype(jnp.int32)
                             + skip)


def check_segments(seg: Segments) -> None:
  """Four int [S] vectors (S >= 1) and non-negative static bounds."""
  shapes = {name: getattr(seg, name).shape
            for name in ("q_lens", "kv_lens", "q_offsets", "kv_offsets")}
  if len(set(shapes.values())) != 1 or len(shapes["q_lens"]) != 1 or \
      shapes["q_lens"][0] < 1:
    raise ValueError(
        f"segment metadata must be four int vectors of one length S >= 1; "
        f"got shapes {shapes}.")
  for name in ("q_lens", "kv_lens", "q_offsets", "kv_offsets"):
    if not jnp.issubdtype(getattr(seg, name).dtype, jnp.integer):
      raise ValueError(f"seg.{name} must be an integer array, got "
                       f"{getattr(seg, name).dtype}.")
  for name in ("max_seqlen_q", "max_seqlen_kv"):
    value = getattr(seg, name)
    if not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"seg.{name} must be a static int >= 0, got {value!r}.")


def check_tiled(seg: Segments, mask: str, tq: int, tkv: int) -> None:
  """Tiled segments: top-left causal, ``S * max_seqlen == T`` for Q and KV."""
  if not seg.tiled:
    return
  s = seg.q_lens.shape[0]
  if AttentionMask(mask) is not AttentionMask.causal_top_left or \
      s * seg.max_seqlen_q != tq or \
      s * seg.max_seqlen_kv != tkv:
    raise ValueError(
        f"Segments(tiled=True) needs mask='causal_top_left' and S * "
        f"max_seqlen == T for Q and KV; got mask={mask!r}, S={s}, "
        f"max_seqlen_q={seg.max_seqlen_q}, max_seqlen_kv={seg.max_seqlen_kv},"
        f" Tq={tq}, Tkv={tkv}.")


def check_like(name: str, x, shape, dtype=None) -> None:
  if tuple(x.shape) != tuple(shape) or (dtype is not None and
                                        jnp.dtype(x.dtype) != jnp.dtype(dtype)):
    want = f"{tuple(shape)}" + (f" {jnp.dtype(dtype)}" if dtype else "")
    raise ValueError(f"{name} must be {want}, got {tuple(x.shape)} {x.dtype}.")


def _check_call(q, k, v, seg, mask) -> None:
  check_dtypes(q, k, v)
  check_shapes(q, k, v)
  check_token_counts(q.shape, k.shape)
  check_mask(mask)
  check_segments(seg)
  check_tiled(seg, mask, q.shape[0], k.shape[0])


def _scale_value(scale, head_dim: int) -> np.float32:
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)
  scale = float(scale)
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}.")
  return np.float32(scale)


# ----------------------------------------------------------------------------
# Metadata for the custom call
# ----------------------------------------------------------------------------


#: A ragged call's graph has ``s`` dims that are multiples of this (or the
#: call's rows): cuDNN 9.19's Hopper kernels tile a segment's rows by 64
#: and its keys by 128, and a bound off those multiples runs slower
#: (docs/decisions.md). Not a backward whose buffers the frontend sizes by
#: the segment slots (head dims off multiples of 16): there the exact
#: bound keeps them smallest.
GRAPH_SEQLEN_MULTIPLE = 128


def _exact_backward_bounds(q_shape, v_shape, tiled: bool) -> bool:
  """Whether a backward keeps its segments' bounds as the graph's ``s``
  dims: tiled, or its buffers sized by the segment slots."""
  return tiled or not workspace.honours_packed_totals(
      int(q_shape[-1]), int(v_shape[-1]))


def _graph_bounds(seg: Segments, tq: int, tkv: int) -> tuple[int, int]:
  """The segments' static bounds, capped by the token counts."""
  return min(int(seg.max_seqlen_q), tq), min(int(seg.max_seqlen_kv), tkv)


def graph_seqlen(bound: int, rows: int, exact: bool) -> int:
  """The ``s`` dim of a call's graph for segments of at most ``bound`` of
  its ``rows`` rows: ``bound`` rounded up to
  :data:`GRAPH_SEQLEN_MULTIPLE`, at most ``rows``; ``bound`` itself where
  ``exact`` (a tiled call, whose segments tile the rows, or a backward
  with slot-sized buffers)."""
  if exact:
    return int(bound)
  m = GRAPH_SEQLEN_MULTIPLE
  return min(-(-int(bound) // m) * m, int(rows))


def _lengths(seg: Segments, max_q: int, max_kv: int):
  """int32 lengths, clipped to [0, bound] so cuDNN never runs past a bound."""
  q_lens = jnp.clip(seg.q_lens.astype(jnp.int32), 0, max_q)
  kv_lens = jnp.clip(seg.kv_lens.astype(jnp.int32), 0, max_kv)
  return q_lens, kv_lens


def _token_starts(token_offsets, tokens: int):
  """[S+1] int32: where each segment starts, in tokens, then the total."""
  starts = token_offsets.astype(jnp.int32)
  return jnp.concatenate([starts, jnp.full((1,), tokens, jnp.int32)])


def _segment_meta(seg: Segments, q_shape, k_shape, max_q: int, max_kv: int):
  """The packed int32 ``[4, W]`` metadata operand (see csrc/sdpa_ffi_common.h):
  q_lens, kv_lens (``[S]``) and the token offsets q_start, kv_start
  (``[S+1]``), each row zero-padded to ``W``, the next multiple of
  :data:`SEGMENT_META_WIDTH_MULTIPLE` (4) of ``S+1``. One small array per
  call (XLA builds it in one fusion); the handler turns the token offsets
  into cuDNN's element offsets, 32- or 64-bit (``offset_bits``). Entry
  ``S`` of row 0 holds ``seg.poison`` where the call has one (attribute
  ``poison = 1``): the handler then fills every result with NaN."""
  tq, tkv = q_shape[0], k_shape[0]
  s = seg.q_lens.shape[0]
  m = SEGMENT_META_WIDTH_MULTIPLE
  w = -(-(s + 1) // m) * m
  q_lens, kv_lens = _lengths(seg, max_q, max_kv)
  if seg.poison is not None:
    flag = jnp.asarray(seg.poison).astype(jnp.int32).reshape(1)
    q_lens = jnp.concatenate([q_lens, flag])
  rows = (q_lens, kv_lens, _token_starts(seg.q_offsets, tq),
          _token_starts(seg.kv_offsets, tkv))
  return jnp.stack([jnp.pad(r, (0, w - r.shape[0])) for r in rows])


def _attributes(seg: Segments, q_shape, k_shape, mask: str, scale: np.float32,
                max_q: int, max_kv: int, window_left: int,
                tiled: bool = False):
  s = seg.q_lens.shape[0]
  return dict(segments=np.int64(s),
              mask=np.int64(AttentionMask(mask).code), scale=scale,
              max_seqlen_q=np.int64(max_q), max_seqlen_kv=np.int64(max_kv),
              window_left=np.int64(window_left), tiled=np.int64(tiled),
              offset_bits=np.int64(ragged_offset_bits(q_shape, k_shape, s,
                                                      max_q)),
              poison=np.int64(seg.poison is not None))


#: The lse a tiled backward reads on rows past a segment's length: every
#: exp(score - lse) there is 0 (scores are far below it; no inf arithmetic).
TILED_PAST_LENGTH_LSE = np.float32(NO_WEIGHT_LSE)


def _tiled_stats(seg: Segments, lse):
  """A tiled backward's stats: rows past a segment's length (``lse = -inf``
  from the forward) get :data:`TILED_PAST_LENGTH_LSE`, and the ``[Tq, Hq]``
  buffer holds them head-major per segment (``[S, Hq, s]``), the layout of
  the dense graph's Stats input."""
  s, hq = seg.q_lens.shape[0], lse.shape[1]
  stats = jnp.where(jnp.isneginf(lse), TILED_PAST_LENGTH_LSE,
                    lse).astype(jnp.float32)
  stats = stats.reshape(s, seg.max_seqlen_q, hq).transpose(0, 2, 1)
  return stats.reshape(lse.shape)


# ----------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------


def check_into(seg: Segments, name: str, x, shape, dtype) -> None:
  """Buffers to write into must match the call's outputs, and the rows
  the call covers must all see a key (nothing is masked afterwards)."""
  check_like(name, x, shape, dtype)
  if not seg.rows_see_keys:
    raise ValueError(f"{name}= needs Segments(rows_see_keys=True): rows "
                     f"written in place are not masked afterwards.")


#: A call that may be tiled by its metadata takes the tiled graph only
#: where its documents make at least this share of the tiled graph's
#: causal work: the dense kernel computes every row of its tiles, padding
#: and empty rows included, the ragged one only the documents' rows, at a
#: few percent more per pair (the module docstring).
TILED_MIN_WORK_SHARE = 0.95


def _causal_pairs(q, window_left: int):
  """float32 (query, key) pairs of ``q`` top-left causal rows, each seeing
  at most ``window_left + 1`` keys (-1: no window)."""
  q = jnp.asarray(q, jnp.float32)
  if window_left < 0:
    return q * (q + 1) / 2
  band = jnp.float32(window_left + 1)
  return jnp.where(q <= band, q * (q + 1) / 2,
                   band * (band + 1) / 2 + (q - band) * band)


def tiled_choice(seg: Segments, mask: str, q_tokens: int, kv_tokens: int,
                 window_left: int = -1):
  """``(take, tiled)`` of a call that may be tiled by its metadata: the
  tiled segments (:func:`~jax_cp.attention.backend.row_tiling`) and
  whether to run them, on the device: where they give the call's results
  and its documents make at least :data:`TILED_MIN_WORK_SHARE` of their
  causal work."""
  holds, tiled = row_tiling(seg, mask, q_tokens, kv_tokens)
  work = jnp.sum(_causal_pairs(tiled.q_lens, window_left))
  full = tiled.q_lens.shape[0] * _causal_pairs(tiled.max_seqlen_q,
                                               window_left)
  return holds & (work >= TILED_MIN_WORK_SHARE * full), tiled


def _tiled_or_ragged(call, seg: Segments, mask: str, q_shape, k_shape,
                     window_left: int, in_place: bool):
  """``call(seg, mask)``; for segments that may tile their rows by the
  traced metadata (:attr:`Segments.tile_rows`,
  :func:`~jax_cp.attention.backend.tiling_applies`) a ``lax.cond`` on the
  device between the tiled call (the dense graph) where
  :func:`tiled_choice` takes it and ``call`` itself: both give the same
  results. In-place writes have no tiled call."""
  if seg.tile_rows:
    if not in_place and tiling_applies(seg, mask, q_shape[0], k_shape[0]):
      check_segments(seg)
      take, tiled = tiled_choice(seg, mask, q_shape[0], k_shape[0],
                                 window_left)
      seg = dataclasses.replace(seg, tile_rows=0)
      return jax.lax.cond(take, lambda: call(tiled, "causal_top_left"),
                          lambda: call(seg, mask))
    seg = dataclasses.replace(seg, tile_rows=0)
  return call(seg, mask)


def forward(q, k, v, seg: Segments, *, mask: str, scale: float,
            window_left: int = -1, into=None):
  """Varlen attention forward (see :mod:`jax_cp.attention.backend`).

  Returns ``(out [Tq,Hq,D] in q's dtype, lse [Tq,Hq] float32)``. With
  ``into=(out, lse)`` the custom call writes the covered rows of those
  buffers in place (aliased; no clearing, no extra outputs).
  ``window_left >= 0``: cuDNN's diagonal band (a sliding window).
  """
  return _tiled_or_ragged(
      lambda s, m: _forward(q, k, v, s, mask=m, scale=scale,
                            window_left=window_left, into=into, stats=True),
      seg, mask, q.shape, k.shape, window_left, into is not None)


def forward_out(q, k, v, seg: Segments, *, mask: str, scale: float,
                window_left: int = -1):
  """The inference form of :func:`forward`: ``out`` alone. The cuDNN graph
  computes and writes no softmax statistics (``jax_cp_cudnn_sdpa_fwd_out``),
  as for a forward that nothing differentiates."""
  return _tiled_or_ragged(
      lambda s, m: _forward(q, k, v, s, mask=m, scale=scale,
                            window_left=window_left, into=None, stats=False),
      seg, mask, q.shape, k.shape, window_left, False)


def _forward(q, k, v, seg: Segments, *, mask: str, scale: float,
             window_left: int, into, stats: bool):
  """:func:`forward` (``stats``) or :func:`forward_out`."""
  _check_call(q, k, v, seg, mask)
  check_window(window_left, mask)
  seg = _cut_to_band(seg, mask, window_left)
  scale = _scale_value(scale, q.shape[2])
  tq, hq, _ = q.shape
  if into is not None:
    check_into(seg, "into[0]", into[0], q.shape, q.dtype)
    check_into(seg, "into[1]", into[1], (tq, hq), jnp.float32)
  max_q, max_kv = _graph_bounds(seg, tq, k.shape[0])
  if max_q == 0 or max_kv == 0:  # No segment can attend anything.
    if into is not None:
      return poisoned(seg, *into)
    if not stats:
      return poisoned(seg, jnp.zeros_like(q))[0]
    return poisoned(seg, jnp.zeros_like(q),
                    jnp.full((tq, hq), -jnp.inf, jnp.float32))
  meta = _segment_meta(seg, q.shape, k.shape, max_q, max_kv)
  result_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((tq, hq), jnp.float32))
  tiled = seg.tiled and into is None
  attrs = _attributes(seg, q.shape, k.shape, mask, scale,
                      graph_seqlen(max_q, tq, tiled),
                      graph_seqlen(max_kv, k.shape[0], tiled), window_left,
                      tiled=tiled)
  if into is not None:
    return jax.ffi.ffi_call(
        FWD_INTO_TARGET, result_types, input_output_aliases={3: 0, 4: 1},
        vmap_method="sequential")(q, k, v, into[0], into[1], meta, **attrs)
  # The handler gives every row that sees no key (outside the segments, or
  # before a bottom-right diagonal, or past a window) 0 and -inf, on the
  # device: nothing is left to mask here, whatever the metadata.
  if not stats:
    return jax.ffi.ffi_call(FWD_OUT_TARGET, result_types[0],
                            vmap_method="sequential")(q, k, v, meta, **attrs)
  return tuple(jax.ffi.ffi_call(FWD_TARGET, result_types,
                                vmap_method="sequential")(q, k, v, meta,
                                                          **attrs))


def backward(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
             scale: float, window_left: int = -1, dq_into=None,
             deterministic: bool = False,
             scratch_limit: float = workspace.DEFAULT_BACKWARD_SCRATCH_LIMIT):
  """Gradients ``(dq, dk, dv)`` of ``sum(out * dout)``, in q/k/v's dtype.

  With ``dq_into`` the custom call writes the covered rows of that buffer
  in place (aliased) instead of a fresh dq (whose uncovered rows are 0);
  its other rows keep their values.
  ``window_left >= 0``: cuDNN's diagonal band (a sliding window).

  A call whose cuDNN workspace (float32 buffers in proportion to its query
  heads, :mod:`jax_cp.attention.cudnn.workspace`) would exceed
  ``scratch_limit`` bytes (the resolved backend's ``scratch_limit``:
  :func:`_configure`) runs as sub-calls over whole GQA head
  groups, one after another, and where one KV head's still would, each
  over ranges of its K/V rows (:mod:`jax_cp.attention.cudnn.split`); the
  results are the same (dq up to the float32 sum of the slices' shares).

  ``deterministic``: every custom call runs cuDNN's deterministic
  algorithm (attribute ``deterministic = 1``), whose dP buffer the split
  bounds as well (:func:`deterministic_backward`, docs/determinism.md).

  Raises:
    ValueError: besides the argument checks, with ``deterministic`` a
      call whose dP buffer fits the scratch bound in no split.
  """
  return _tiled_or_ragged(
      lambda s, m: _backward(q, k, v, out, lse, dout, s, mask=m, scale=scale,
                             window_left=window_left, dq_into=dq_into,
                             deterministic=deterministic,
                             scratch_limit=scratch_limit),
      seg, mask, q.shape, k.shape, window_left, dq_into is not None)


def _backward(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
              scale: float, window_left: int, dq_into, deterministic: bool,
              scratch_limit: float):
  """:func:`backward` of one graph: tiled where ``seg.tiled``."""
  _check_call(q, k, v, seg, mask)
  check_window(window_left, mask)
  seg = _cut_to_band(seg, mask, window_left)
  check_like("out", out, q.shape)
  check_like("dout", dout, q.shape)
  check_like("lse", lse, q.shape[:2])
  if dq_into is not None:
    check_into(seg, "dq_into", dq_into, q.shape, q.dtype)
  scale = _scale_value(scale, q.shape[2])
  max_q, max_kv = _graph_bounds(seg, q.shape[0], k.shape[0])
  if max_q == 0 or max_kv == 0:
    dq = jnp.zeros_like(q) if dq_into is None else dq_into
    return poisoned(seg, dq, jnp.zeros_like(k), jnp.zeros_like(v))
  tiled = seg.tiled and dq_into is None
  segments = seg.q_lens.shape[0]
  if deterministic and tiled and window_left < 0 and not _fits_unsliced(
      q.shape, v.shape, segments, max_q, max_kv, scratch_limit):
    tiled = False  # The ragged graph can be cut into K/V slices.
  exact = _exact_backward_bounds(q.shape, v.shape, tiled)
  graph_q = graph_seqlen(max_q, q.shape[0], exact)
  check_backward_workspace(q.shape, segments, graph_q, tiled)
  seg = dataclasses.replace(seg, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                            tiled=tiled)
  return split.backward_within_scratch_limit(
      _backward_call, q, k, v, out, lse, dout, seg, max_seqlen_q=graph_q,
      mask=mask, scale=scale, window_left=window_left, dq_into=dq_into,
      deterministic=deterministic, scratch_limit=scratch_limit,
      max_seqlen_kv=graph_seqlen(max_kv, k.shape[0], exact))


def _fits_unsliced(q_shape, v_shape, segments: int, max_q: int,
                   max_kv: int, scratch_limit: float) -> bool:
  """Whether a tiled deterministic backward fits the scratch bound in
  head groups alone (a tiled graph is not cut into K/V slices)."""
  try:
    workspace.backward_split(
        int(q_shape[0]), int(v_shape[0]), int(q_shape[1]), int(v_shape[1]),
        int(q_shape[2]), head_dim_v=int(v_shape[2]), segments=segments,
        max_seqlen_q=max_q, max_seqlen_kv=max_kv, kv_slices=False,
        deterministic=True, limit=scratch_limit)
  except ValueError:
    return False
  return True


def deterministic_backward(q, k, v, out, lse, dout, seg: Segments, *,
                           mask: str, scale: float, window_left: int = -1,
                           dq_into=None,
                           scratch_limit: float =
                           workspace.DEFAULT_BACKWARD_SCRATCH_LIMIT):
  """:func:`backward` in the deterministic mode (``deterministic=True``):
  the backend's ``deterministic_backward``."""
  return backward(q, k, v, out, lse, dout, seg, mask=mask, scale=scale,
                  window_left=window_left, dq_into=dq_into,
                  deterministic=True, scratch_limit=scratch_limit)


def _backward_call(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
                   scale: np.float32, window_left: int, dq_into=None,
                   deterministic: bool = False):
  """One ``jax_cp_cudnn_sdpa_bwd`` call on checked inputs (:func:`backward`
  checks them and sets the segments' static bounds and ``tiled`` in
  ``seg``)."""
  max_q, max_kv, tiled = seg.max_seqlen_q, seg.max_seqlen_kv, seg.tiled
  meta = _segment_meta(seg, q.shape, k.shape, max_q, max_kv)
  if tiled:
    stats = _tiled_stats(seg, lse)
  elif seg.rows_see_keys:
    # Covered rows have a finite lse; cuDNN reads no other row.
    stats = lse.astype(jnp.float32)
  else:
    # Rows that see no key carry lse = -inf; cuDNN recomputes
    # P = exp(s - lse) with masked scores s = -inf, and -inf - (-inf) is NaN.
    # Any finite value gives P = 0 there (out is 0 on those rows too): 0.
    stats = jnp.where(jnp.isneginf(lse), 0.0, lse).astype(jnp.float32)
  result_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct(k.shape, k.dtype),
                  jax.ShapeDtypeStruct(v.shape, v.dtype))
  exact = _exact_backward_bounds(q.shape, v.shape, tiled)
  attrs = _attributes(seg, q.shape, k.shape, mask, scale,
                      graph_seqlen(max_q, q.shape[0], exact),
                      graph_seqlen(max_kv, k.shape[0], exact), window_left,
                      tiled)
  # The backward's own attribute: cuDNN's deterministic algorithm.
  attrs["deterministic"] = np.int64(deterministic)
  inputs = (q, k, v, out.astype(q.dtype), dout.astype(q.dtype), stats)
  if dq_into is not None:
    return jax.ffi.ffi_call(
        BWD_INTO_TARGET, result_types, input_output_aliases={6: 0},
        vmap_method="sequential")(*inputs, dq_into, meta, **attrs)
  # dq rows that see no key are 0 (the handler fills them after the graph).
  return tuple(jax.ffi.ffi_call(BWD_TARGET, result_types,
                                vmap_method="sequential")(*inputs, meta,
                                                          **attrs))


def merge_rows(dst, src, row_offset: int, op: str = "add"):
  """In-place ``merge_rows`` (see :mod:`jax_cp.attention.decompose.merge`): one
  kernel over ``src``'s elements on ``dst``'s (aliased) buffer; XLA copies
  ``dst`` first only if it is still used elsewhere. Other dtypes than
  float32/bfloat16/float16 take the ``jnp`` version."""
  check_merge_rows(dst, src, row_offset, op)
  if jnp.dtype(dst.dtype) not in MERGE_DTYPES:
    return merge_rows_jnp(dst, src, row_offset, op)
  if src.size == 0:
    return dst
  return jax.ffi.ffi_call(
      MERGE_TARGET, jax.ShapeDtypeStruct(dst.shape, dst.dtype),
      input_output_aliases={0: 0}, vmap_method="sequential",
  )(dst, src, row_offset=np.int64(row_offset),
    op=np.int64(MERGE_OP_CODES[op]))


def _is_available(platform: str) -> bool:
  return platform in ("cuda", "gpu")


for _name, _capsule in _jax_cp_cuda.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

def _configure(backend: Backend) -> Backend:
  """The backend's ``configure``: its scratch bound from
  ``JAX_CP_CUDNN_BWD_SCRATCH_GIB``
  (:func:`~jax_cp.attention.cudnn.workspace.backward_scratch_limit`),
  read once per resolution."""
  return with_scratch_limit(backend, workspace.backward_scratch_limit())


BACKEND = Backend(name="cudnn", forward=forward, backward=backward,
                  forward_out=forward_out,
                  is_available=_is_available, merge_rows=merge_rows,
                  supports_in_place=True, split_bottom_right_backward=True,
                  dtypes=SUPPORTED_DTYPES, handles_poison=True,
                  deterministic_backward=deterministic_backward,
                  scratch_limit=float(
                      workspace.DEFAULT_BACKWARD_SCRATCH_LIMIT),
                  configure=_configure)
