"""The varlen attention backend contract, as :class:`typing.Protocol` types.

A backend computes causal or non-causal attention over *ragged segments* of
a packed token buffer. The CP layer above talks to backends only through
this contract (docs/internals.md, Backend contract), so it is backend-neutral:

``forward(q, k, v, seg, *, mask, scale, window_left=-1) -> (out, lse)``
    q: ``[Tq, Hq, D]``; k, v: ``[Tkv, Hkv, D]`` (``Hq % Hkv == 0``).
    seg: a :class:`Segments` (per-segment lengths and *token* offsets, int32
    ``[S]``, plus static bounds ``max_seqlen_q``/``max_seqlen_kv``).
    Segment i attends Q rows ``[q_offsets[i], q_offsets[i]+q_lens[i])`` to KV
    rows ``[kv_offsets[i], kv_offsets[i]+kv_lens[i])``. Segments with a zero
    length contribute nothing. Q row ranges of different segments never
    overlap.
    mask: one of :data:`MASK_TYPES`. ``"causal_bottom_right"``: Q row j of a
    segment sees KV rows ``<= j + kv_len - q_len``; ``"causal_top_left"``: KV
    rows ``<= j``; ``"no_mask"``: all ``kv_len`` rows.
    window_left: static int; ``>= 0`` (causal masks only) bounds the mask to
    a diagonal band, a sliding window: Q row j also sees no KV row more than
    ``window_left`` before its diagonal (``j + kv_len - q_len`` bottom-right,
    ``j`` top-left). -1: no bound. A backend without windows may leave the
    keyword out; the CP layer passes it only for a bounded window.
    scale: python float, multiplies ``q @ k^T``.
    Returns out ``[Tq, Hq, D]`` in q's dtype, exactly 0 on rows no segment
    covers (and on rows that see no key), and lse ``[Tq, Hq]`` float32, the
    natural-log log-sum-exp of the scaled scores of each row; ``-inf`` on rows
    that see no key.

``backward(q, k, v, out, lse, dout, seg, *, mask, scale, window_left=-1)
-> (dq, dk, dv)``
    Gradients of ``sum(out * dout)``; ``out``/``lse`` are the forward's.
    dq is 0 on uncovered rows, dk/dv are 0 on KV rows no segment reads.

``forward_out(q, k, v, seg, *, mask, scale, window_left=-1) -> out``
    Optional: the inference form, ``forward``'s ``out`` with no softmax
    statistics computed or written. The primitive calls it for a forward
    that nothing differentiates and that returns no lse; a backend without
    it runs ``forward`` and drops lse.

``is_available(platform) -> bool``: whether the backend can run on a JAX
platform name (``"cpu"``, ``"cuda"``, ...).

``merge_rows(dst, src, row_offset, op) -> dst'``: ``dst [B, Td, ...]`` with
rows ``[row_offset, row_offset + Ts)`` of axis 1 replaced by
``op(those rows, src)`` (``op`` ``"add"`` or ``"max"``, formed in float32),
everything else unchanged (:mod:`jax_cp.attention.decompose.merge` has
the portable version).

``dtypes``: the q/k/v dtypes the backend takes, or None for every floating
dtype (optional; a backend without the attribute takes every one).
``backend="auto"`` runs inputs of another dtype on the ``xla`` backend
(:func:`jax_cp.attention.registry.resolve_backend`); a backend named
explicitly raises ``ValueError`` on them.

``exact_past_bounds``: True when results do not depend on the static
bounds ``max_seqlen_q``/``max_seqlen_kv`` (a longer segment is attended in
full); False when kernels are sized by them, as cuDNN's are, and a longer
segment gives wrong results.

``handles_poison``: True when the backend honours ``Segments.poison``
(every result NaN where it is set): the cudnn backend's handler reads the
flag on the device and costs nothing while it is clear; the xla backend
selects its results (:func:`poisoned`). For a backend without it the CP
layer multiplies K and V by NaN or 1 instead (:mod:`jax_cp.cp.guard`).

``scratch_limit``: the bound, in bytes, on the float32 working memory of
one call: the backend keeps its own calls within it (the cudnn backward
runs in sub-calls past it: :mod:`jax_cp.attention.cudnn.split`) and the
CP ring keeps its float32 running buffers within it, running one group of
GQA heads at a time (:mod:`jax_cp.cp.exchange.ring`). None, or a backend without
the attribute: no bound (:func:`scratch_bound`). The ``xla`` backend has
none.

``configure``: optional, a function of the backend giving it as this
process's settings configure it; :func:`jax_cp.attention.registry.
resolve_backend` calls it on every resolution, so settings are read there
and never while a call is traced, and they are part of the resolved
(hashed) backend. The cudnn backend reads its ``scratch_limit`` from
``JAX_CP_CUDNN_BWD_SCRATCH_GIB`` this way.

``split_bottom_right_backward``: True when the backend runs the backward
of a bottom-right causal segment slower than the backward of its unmasked
rectangle plus its top-left triangle (cuDNN does, about 2x;
docs/decisions.md): the CP planner then splits such blocks in the
backward. The results are the same either way.

In-place writes are an optional capability (``supports_in_place``, the
:class:`InPlaceAttentionBackend` protocol). Such a backend also takes:

``forward(..., into=(out0, lse0))``: buffers shaped like the results that
    already hold 0 / ``-inf`` on every row this call covers; the results are
    ``out0`` / ``lse0`` with this call's rows written in (in place: no
    clearing, no extra buffers). Needs ``seg.rows_see_keys``.
``backward(..., dq_into=dq0)``: ``dq_into`` like ``into`` for dq: the
    result is ``dq0`` with the rows this call covers written in, every
    other row as ``dq0`` held it (a fresh dq is 0 on uncovered rows).

For a backend without the capability the CP planner merges the calls'
results itself (the rows are disjoint: out adds, lse takes the maximum,
dq adds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jax_cp.attention.decompose.merge import merge_rows_jnp
from jax_cp.attention.mask import AttentionMask
from jax_cp.attention.validation import MASK_TYPES  # noqa: F401


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """Ragged segment metadata for one attention call (a pytree).

  Attributes:
    q_lens: int32 ``[S]`` valid Q rows per segment.
    kv_lens: int32 ``[S]`` valid KV rows per segment.
    q_offsets: int32 ``[S]`` first Q row (token index) of each segment.
    kv_offsets: int32 ``[S]`` first KV row (token index) of each segment.
    max_seqlen_q: static bound on ``q_lens`` (kernels size grids by it).
    max_seqlen_kv: static bound on the ``kv_lens`` of segments with Q rows
      (a segment with ``q_len == 0`` reads nothing, whatever its
      ``kv_len``).
    rows_see_keys: static promise that every covered Q row sees at least
      one key (``kv_len > 0`` where ``q_len > 0``, and ``kv_len >= q_len``
      for the bottom-right mask); backends may then skip zeroing rows that
      see none, and in-place writes need it. The CP layer's calls always
      satisfy it.
    tiled: static promise that the segments tile the buffers: segment ``i``
      holds Q rows ``[i*max_seqlen_q, (i+1)*max_seqlen_q)`` and KV rows
      ``[i*max_seqlen_kv, (i+1)*max_seqlen_kv)`` (its offsets say so too),
      these bounds times S are the buffers' lengths, the mask is top-left
      causal and ``q_len <= kv_len``. With top-left masks no valid Q row
      then sees a row past its segment's length, so a backend may run the
      dense kernel without a padding mask (the cudnn backend does: it is
      the graph of ``jax.nn.dot_product_attention``) and mask the rows past
      the lengths itself. A batch of rows holding one document each, at
      cp=1, is tiled (docs/internals.md, Tiled calls). Such a kernel reads
      the padding rows, so they must hold finite values:
      :func:`jax_cp.fused_attention` and :func:`jax_cp.cp_attention` put
      zeros there (:mod:`jax_cp.attention.padding`).
    poison: None, or an int32 scalar: where it is nonzero, every result of
      the call (out, lse, dq, dk, dv) is NaN. The CP layer sets it for a
      backend with ``handles_poison`` when traced metadata break a
      ``max_seqlen`` bound the host had checked (:mod:`jax_cp.cp.guard`).
    tile_rows: static; 0, or the number ``n`` of equal rows the buffers
      hold (``Tq / n`` Q and ``Tkv / n`` K/V rows each, the bounds being
      those row lengths) where only the traced metadata tell whether the
      call is tiled: whether each row holds at most one segment with Q
      rows, from the row's start (:func:`row_tiling`). A backend may test
      that on the device and run its tiled kernel where it holds (the
      cudnn backend does, with a ``lax.cond``); the results are the same
      either way (docs/internals.md, Tiled calls). The padding rows must
      then hold finite values, as for ``tiled``.
  """

  q_lens: jax.Array
  kv_lens: jax.Array
  q_offsets: jax.Array
  kv_offsets: jax.Array
  max_seqlen_q: int = dataclasses.field(metadata=dict(static=True))
  max_seqlen_kv: int = dataclasses.field(metadata=dict(static=True))
  rows_see_keys: bool = dataclasses.field(default=False,
                                          metadata=dict(static=True))
  tiled: bool = dataclasses.field(default=False, metadata=dict(static=True))
  poison: jax.Array | None = None
  tile_rows: int = dataclasses.field(default=0, metadata=dict(static=True))


def row_segments(q_lens, kv_lens, q_offsets, kv_offsets, q_tokens: int,
                 kv_tokens: int, max_q: int, max_kv: int, *,
                 rows_see_keys: bool = False, tiled: bool = False,
                 clamp: bool = False, heaviest_first: bool = False,
                 may_tile: bool = False) -> Segments:
  """``[B, N]`` (or ``[N]``) segments over ``B`` rows of ``q_tokens`` Q and
  ``kv_tokens`` K/V rows as one :class:`Segments` list over the flattened
  ``[B*T]`` buffers. The bounds are capped by the token counts (and are at
  least 1).

  ``clamp`` (for metadata a caller passes in, which cannot be checked
  when traced) puts every segment into its row and its bound: its offset
  into ``[0, tokens]``, its length into ``[0, min(bound, tokens -
  offset)]``, so no kernel reads or writes outside the buffers. Without
  it the lengths stay as given, so a backend that is exact past its
  bounds (``exact_past_bounds``) attends a longer segment in full.
  ``heaviest_first`` orders the segments by their causal pairs
  ``q * (2 kv - q)``, most first: the order changes no result, and fused
  kernels, which start their thread blocks roughly in segment order, then
  leave short blocks for the end of the grid (docs/decisions.md). Tiled
  segments keep their order (segment ``i`` is row ``i``). ``may_tile``
  sets :attr:`Segments.tile_rows` to the row count (the metadata may tile
  the rows; only the device can tell) where the bounds are the rows'
  lengths and the call is not ``tiled`` already.
  """
  as32 = lambda x: jnp.asarray(x, jnp.int32)
  q_lens, kv_lens, q_offsets, kv_offsets = map(
      as32, (q_lens, kv_lens, q_offsets, kv_offsets))
  max_q = max(min(int(max_q), q_tokens), 1)
  max_kv = max(min(int(max_kv), kv_tokens), 1)
  if clamp:
    q_offsets = jnp.clip(q_offsets, 0, q_tokens)
    q_lens = jnp.clip(q_lens, 0, jnp.minimum(max_q, q_tokens - q_offsets))
    kv_offsets = jnp.clip(kv_offsets, 0, kv_tokens)
    kv_lens = jnp.clip(kv_lens, 0,
                       jnp.minimum(max_kv, kv_tokens - kv_offsets))
  if q_lens.ndim == 2:
    rows = jnp.arange(q_lens.shape[0], dtype=jnp.int32)[:, None]
    q_offsets = q_offsets + rows * q_tokens
    kv_offsets = kv_offsets + rows * kv_tokens
  seg = [x.reshape(-1) for x in (q_lens, kv_lens, q_offsets, kv_offsets)]
  if heaviest_first and not tiled and seg[0].shape[0] > 1:
    q, kv = seg[0].astype(jnp.float32), seg[1].astype(jnp.float32)
    order = jnp.argsort(-(q * (2 * kv - q)), stable=True)
    seg = [x[order] for x in seg]
  tile_rows = 0
  if may_tile and not tiled and (max_q, max_kv) == (q_tokens, kv_tokens):
    tile_rows = q_lens.shape[0] if q_lens.ndim == 2 else 1
  return Segments(*seg, max_q, max_kv, rows_see_keys=rows_see_keys,
                  tiled=tiled, tile_rows=tile_rows)


def packed(x):
  """``[B, T, ...]`` -> ``[B*T, ...]``: batched rows as the backends'
  packed buffer."""
  return x.reshape((-1,) + x.shape[2:])


def keyed_rows(q_lens, kv_lens, mask: str, window_left: int = -1, xp=jnp):
  """Per segment, the Q rows ``[first, end)`` (counted from the segment's
  first row) that see at least one key; the others see none and get out 0,
  lse ``-inf``. A bottom-right row ``j`` sees its diagonal key ``j + kv_len
  - q_len`` when that is ``>= 0``, window or not; a top-left row ``j`` sees
  keys ``[j - window_left, j]`` of ``[0, kv_len)``; an unmasked row sees
  every key. ``xp``: ``jnp``, or ``np`` for concrete metadata."""
  q, kv = q_lens, kv_lens
  m = AttentionMask(mask)
  if m.bottom_right:
    return xp.clip(q - kv, 0, q), q
  end = xp.where(kv > 0, q, 0)
  if m.causal and window_left >= 0:
    end = xp.minimum(end, kv + window_left)
  return xp.zeros_like(q), end


def tiling_applies(seg: Segments, mask: str, q_tokens: int,
                   kv_tokens: int) -> bool:
  """Static: whether a call may run tiled by its metadata
  (:attr:`Segments.tile_rows`): rows of equal length over both buffers,
  the bounds those lengths, a causal mask."""
  n = seg.tile_rows
  return (n > 0 and not seg.tiled
          and AttentionMask(mask).causal
          and q_tokens % n == 0 and kv_tokens % n == 0
          and seg.max_seqlen_q == q_tokens // n
          and seg.max_seqlen_kv == kv_tokens // n)


def row_tiling(seg: Segments, mask: str, q_tokens: int, kv_tokens: int
               ) -> tuple[jax.Array, Segments]:
  """Whether the segments of a call with :func:`tiling_applies` tile its
  rows, and the same call as tiled segments, from the traced metadata
  (a few integer ops on the ``[S]`` vectors, no pass over a tensor).

  With ``n = seg.tile_rows`` rows of ``s_q = q_tokens / n`` Q and ``s_kv
  = kv_tokens / n`` K/V rows, the segments tile them when every segment
  with Q rows (``q_len > 0``) starts a row of both buffers (``q_offset =
  b s_q``, ``kv_offset = b s_kv``), stays in it, has ``q_len <= kv_len``
  (``==`` with the bottom-right mask) and is its row's only such segment;
  segments without Q rows attend nothing and may lie anywhere. Then the
  call is the tiled one (:attr:`Segments.tiled`, top-left causal) whose
  segment ``b`` has row ``b``'s lengths (0 for a row without one): a Q row
  sees the same keys in both, and rows the original covers nowhere are
  past their tile's length.

  Returns:
    ``(holds, tiled)``: a bool scalar, and the ``n`` tiled segments
    (the bounds ``s_q``, ``s_kv``; ``poison`` and ``rows_see_keys`` kept).
  """
  n = seg.tile_rows
  sq, skv = q_tokens // n, kv_tokens // n
  ql, kl, qo, ko = (jnp.asarray(x).astype(jnp.int32)
                    for x in (seg.q_lens, seg.kv_lens, seg.q_offsets,
                              seg.kv_offsets))
  active = ql > 0
  row = qo // sq
  fits = kl == ql if AttentionMask(mask).bottom_right else kl >= ql
  fine = ((qo >= 0) & (qo < q_tokens) & (qo == row * sq) & (ko == row * skv)
          & (ql <= sq) & (kl <= skv) & fits)
  # Each segment with Q rows adds to its row; the others to bucket n.
  bucket = jnp.where(active & fine, row, n)

  def per_row(x):
    return jnp.zeros((n + 1,), jnp.int32).at[bucket].add(x)[:n]
  holds = jnp.all(fine | ~active) & jnp.all(per_row(active.astype(
      jnp.int32)) <= 1)
  rows = jnp.arange(n, dtype=jnp.int32)
  tiled = Segments(per_row(jnp.where(active, ql, 0)),
                   per_row(jnp.where(active, kl, 0)), rows * sq, rows * skv,
                   sq, skv, rows_see_keys=seg.rows_see_keys, tiled=True,
                   poison=seg.poison)
  return holds, tiled


Pair = tuple[jax.Array, jax.Array]
Triple = tuple[jax.Array, jax.Array, jax.Array]


class AttentionBackend(Protocol):
  """A named implementation of the varlen attention contract (see the
  module docstring)."""

  @property
  def name(self) -> str: ...

  @property
  def supports_in_place(self) -> bool: ...

  @property
  def exact_past_bounds(self) -> bool: ...

  @property
  def split_bottom_right_backward(self) -> bool: ...

  def is_available(self, platform: str) -> bool: ...

  def forward(self, q: jax.Array, k: jax.Array, v: jax.Array,
              seg: Segments, *, mask: str, scale: float,
              window_left: int = -1) -> Pair: ...

  def backward(self, q: jax.Array, k: jax.Array, v: jax.Array,
               out: jax.Array, lse: jax.Array, dout: jax.Array,
               seg: Segments, *, mask: str, scale: float,
               window_left: int = -1) -> Triple: ...

  def merge_rows(self, dst: jax.Array, src: jax.Array, row_offset: int,
                 op: str = "add") -> jax.Array: ...


class InPlaceAttentionBackend(AttentionBackend, Protocol):
  """A backend with ``supports_in_place``: its calls write their rows into
  the buffers of earlier calls (``into``, ``dq_into``)."""

  def forward(self, q: jax.Array, k: jax.Array, v: jax.Array,
              seg: Segments, *, mask: str, scale: float,
              window_left: int = -1,
              into: Pair | None = None) -> Pair: ...

  def backward(self, q: jax.Array, k: jax.Array, v: jax.Array,
               out: jax.Array, lse: jax.Array, dout: jax.Array,
               seg: Segments, *, mask: str, scale: float,
               window_left: int = -1,
               dq_into: jax.Array | None = None) -> Triple: ...


@dataclasses.dataclass(frozen=True)
class Backend:
  """An :class:`AttentionBackend` made of plain functions (hashable, so a
  CP config can hold it as static data).

  Attributes:
    name: the name users pass as ``backend=``.
    forward, backward: the attention calls.
    is_available: whether it runs on a JAX platform name.
    merge_rows: row merge; defaults to the portable ``jnp`` version.
    forward_out: the inference form (``out`` alone, no statistics), or
      None: ``forward``'s out (see the module docstring).
    supports_in_place: ``forward``/``backward`` take ``into``/``dq_into``
      (see :class:`InPlaceAttentionBackend`).
    exact_past_bounds: results do not depend on the segments' static
      bounds (see the module docstring).
    split_bottom_right_backward: the CP planner splits bottom-right blocks
      into a rectangle and a triangle in the backward (see the module
      docstring).
    dtypes: the q/k/v dtypes it takes; None: every floating dtype.
    handles_poison: it honours ``Segments.poison`` (see the module
      docstring).
    deterministic_backward: the backward of the deterministic mode
      (docs/determinism.md): same contract as ``backward``, with results
      bitwise the same from run to run; None where the backend has none
      (the mode then raises). :func:`in_deterministic_mode` swaps it in.
    deterministic: this instance's ``backward`` is its
      ``deterministic_backward``.
    scratch_limit: the bound on one call's float32 working memory, in
      bytes; None: no bound (see the module docstring).
    configure: the backend as this process's settings configure it, called
      where it is resolved; None: as registered (see the module
      docstring).
  """

  name: str
  forward: Callable[..., Pair]
  backward: Callable[..., Triple]
  is_available: Callable[[str], bool]
  merge_rows: Callable[..., jax.Array] = merge_rows_jnp
  forward_out: Callable[..., jax.Array] | None = None
  supports_in_place: bool = False
  exact_past_bounds: bool = False
  split_bottom_right_backward: bool = False
  dtypes: tuple[Any, ...] | None = None
  handles_poison: bool = False
  deterministic_backward: Callable[..., Triple] | None = None
  deterministic: bool = False
  scratch_limit: float | None = None
  configure: Callable[[Backend], Backend] | None = None


@dataclasses.dataclass(frozen=True)
class _Bounded:
  """A backward with its ``scratch_limit`` keyword given (compared and
  hashed by value, so equal bounds give equal backends)."""

  backward: Callable[..., Triple]
  scratch_limit: float

  def __call__(self, *args, **kwargs):
    return self.backward(*args, scratch_limit=self.scratch_limit, **kwargs)


def with_scratch_limit(backend: Backend, limit: float) -> Backend:
  """``backend``, whose ``backward`` and ``deterministic_backward`` take
  a ``scratch_limit`` keyword, with that keyword set to ``limit`` (bytes;
  ``inf``: no bound) and ``scratch_limit = limit``; ``backend`` itself
  where that is its bound already. For a backend's ``configure``."""
  if limit == backend.scratch_limit:
    return backend
  unbound = lambda f: f.backward if isinstance(f, _Bounded) else f
  bound = lambda f: None if f is None else _Bounded(unbound(f), limit)
  return dataclasses.replace(
      backend, scratch_limit=limit, backward=bound(backend.backward),
      deterministic_backward=bound(backend.deterministic_backward))


def scratch_bound(backend: AttentionBackend) -> float:
  """The backend's ``scratch_limit`` in bytes; ``inf`` where it has
  none."""
  limit = getattr(backend, "scratch_limit", None)
  return math.inf if limit is None else float(limit)


def in_deterministic_mode(backend: AttentionBackend,
                          deterministic: bool) -> AttentionBackend:
  """``backend`` as the mode ``deterministic`` runs it: unchanged when the
  mode is off, else with its ``deterministic_backward`` as ``backward``.
  A function of the backend's fields, so equal backends give equal
  (equally hashed) results.

  Raises:
    ValueError: the mode is on and the backend has no deterministic
      backward (never a silent nondeterministic one).
  """
  if not deterministic or getattr(backend, "deterministic", False):
    return backend
  det = getattr(backend, "deterministic_backward", None)
  if det is None or not isinstance(backend, Backend):
    raise ValueError(
        f"the deterministic mode is on (deterministic=True, or XLA's "
        f"--xla_gpu_exclude_nondeterministic_ops with deterministic=None) "
        f"but backend {backend.name!r} has no deterministic backward "
        f"(Backend.deterministic_backward); use backend 'cudnn' or 'xla', "
        f"or deterministic=False (docs/determinism.md).")
  return dataclasses.replace(backend, backward=det, deterministic=True)


def poisoned(seg: Segments, *results):
  """``results`` with every element NaN where ``seg.poison`` is set (for
  a backend that applies :attr:`Segments.poison` to its results);
  unchanged without a poison."""
  if seg.poison is None:
    return results
  broken = jnp.asarray(seg.poison) != 0
  return tuple(jnp.where(broken, jnp.asarray(jnp.nan, x.dtype), x)
               for x in results)
