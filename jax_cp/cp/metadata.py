"""Per-step attention metadata of CP (docs/internals.md, Call plans).

Pure ``jnp`` functions of (``cu_seqlens``, ``cu_seqlens_padded``, ``cp_size``,
traced ``rank``). Every result is per document, int32 ``[..., N]``:

* ``q_lens``: valid Q rows of the document in this step,
* ``q_offsets``: their first row in the *local* Q buffer,
* ``kv_lens``: KV rows the document's queries may see,
* ``kv_offsets``: their first row in the *gathered, sequence-ordered* KV
  buffer (physical token index).

With the bottom-right causal mask, the last Q row of a segment lines up with
its last KV row. ``kv_len >= q_len`` always holds.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class StepMetadata(NamedTuple):
  q_lens: jnp.ndarray
  q_offsets: jnp.ndarray
  kv_lens: jnp.ndarray
  kv_offsets: jnp.ndarray


def _lengths(cu_seqlens, cu_seqlens_padded):
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  return cu[..., 1:] - cu[..., :-1], cuP[..., 1:] - cuP[..., :-1], cuP[..., :-1]


def dual_chunk_swap_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                         step: int, causal: bool = True) -> StepMetadata:
  """DUAL_CHUNK_SWAP step ``step`` (0: chunk ``r``, 1: chunk ``2cp-1-r``).

  ``q_len = clamp(L - k*c, 0, c)``, ``q_off = cuP/cp + step*c``,
  ``kv_len = min(L, (k+1)*c)`` (causal) or ``L`` (no mask),
  ``kv_off = cuP``.
  """
  if step not in (0, 1):
    raise ValueError(f"step must be 0 or 1, got {step}")
  lens, plens, starts = _lengths(cu_seqlens, cu_seqlens_padded)
  rank = jnp.asarray(rank, jnp.int32)
  k = rank if step == 0 else 2 * cp_size - 1 - rank
  c = plens // (2 * cp_size)
  q_lens = jnp.clip(lens - k * c, 0, c)
  q_offsets = starts // cp_size + step * c
  kv_lens = jnp.minimum(lens, (k + 1) * c) if causal else lens
  return StepMetadata(q_lens, q_offsets, kv_lens, starts)


def no_load_balance_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                         total_tokens: int) -> StepMetadata:
  """NO_LOAD_BALANCE, the one step of rank ``r`` (causal only): the
  :func:`contiguous_chunk` of tokens ``[r*Tl, (r+1)*Tl)``."""
  local = total_tokens // cp_size
  return contiguous_chunk(cu_seqlens, cu_seqlens_padded,
                          jnp.asarray(rank, jnp.int32) * local, local)


def contiguous_chunk(cu_seqlens, cu_seqlens_padded, lo, size: int
                     ) -> StepMetadata:
  """The documents' parts in the causal call of the queries of tokens
  ``[lo, hi = lo + size)`` of the row, against the row's keys.

  With ``s = cuP[b]``: ``q_len = max(clamp(s+L, lo, hi) - clamp(s, lo,
  hi), 0)``, ``q_off = clamp(s, lo, hi) - lo``, ``kv_len = min(max(hi-s,
  0), L)``, ``kv_off = s``.
  """
  lens, _, starts = _lengths(cu_seqlens, cu_seqlens_padded)
  hi = lo + size
  q_lens = jnp.maximum(jnp.clip(starts + lens, lo, hi)
                       - jnp.clip(starts, lo, hi), 0)
  q_offsets = jnp.clip(starts, lo, hi) - lo
  kv_lens = jnp.minimum(jnp.maximum(hi - starts, 0), lens)
  return StepMetadata(q_lens, q_offsets, kv_lens, starts)


def split_bottom_right(meta: StepMetadata) -> tuple[StepMetadata, StepMetadata]:
  """Splits a bottom-right causal segment (Q of length q against KV of
  length kv >= q) into an unmasked rectangle ``Q x KV[:kv-q]`` and a
  top-left causal square ``Q x KV[kv-q:]``; together they see exactly what
  the bottom-right mask sees (merge the two by log-sum-exp). The rectangle
  gets ``q_len = 0`` where it would be empty."""
  q, kv = meta.q_lens, meta.kv_lens
  rect_kv = kv - q
  rect = StepMetadata(jnp.where(rect_kv > 0, q, 0), meta.q_offsets,
                      jnp.where(q > 0, rect_kv, 0), meta.kv_offsets)
  diag = StepMetadata(q, meta.q_offsets, q, meta.kv_offsets + rect_kv)
  return rect, diag


def _window_parts(meta: StepMetadata, window_left: int):
  """``(X, h, b, f, n)`` of :func:`split_windowed_block`: the KV row of the
  first Q row's diagonal, the keys before it in reach, how many of them
  are near and far, and the Q rows that see any of them (0 without)."""
  left = int(window_left)
  q = meta.q_lens
  before = jnp.where(q > 0, meta.kv_lens - q, 0)
  h = jnp.minimum(before, left)
  b = jnp.minimum(jnp.maximum(left - q, 0), h)
  n = jnp.where(h > 0, jnp.minimum(q, left), 0)
  return meta.kv_offsets + before, h, b, h - b, n


def split_windowed_block(meta: StepMetadata, window_left: int,
                         q_tokens: int, kv_tokens: int
                         ) -> tuple[StepMetadata, StepMetadata, StepMetadata]:
  """Splits a windowed bottom-right segment into three parts that cuDNN
  runs as fast top-left or unmasked calls (docs/internals.md, Call plans).

  The segment's ``q`` Q rows are the last ``q`` of its ``kv`` keys (a
  DUAL_CHUNK_SWAP chunk), so Q row ``j`` sits at key row ``X + j`` with
  ``X = kv_offset + kv - q``, and sees the keys ``[X + j - left, X + j]``
  of the segment. With ``h = min(left, kv - q)`` keys before ``X`` in
  reach, ``b = min(max(left - q, 0), h)`` of them (the nearest) seen by
  every row and ``f = h - b`` further ones:

  * ``diag``: Q against the keys ``[X, X + q)``, the top-left band;
  * ``near``: all Q rows against the ``b`` keys ``[X - b, X)``, unmasked;
  * ``far``: the first ``n = min(q, left)`` Q rows against the ``f`` keys
    ``[X - h, X - b)``: row ``j`` sees key ``X - b - 1 - m`` when
    ``m <= n - 1 - j``, which with both axes reversed is plain top-left
    causal. Its offsets are in the *mirrored* buffers (row ``t`` of a
    row of ``q_tokens`` Q rows at ``q_tokens - 1 - t``, of ``kv_tokens``
    KV rows at ``kv_tokens - 1 - t``).

  Parts without work have ``q_len = kv_len = 0``. The call plan runs the
  diagonal as returned and the near and far parts over compact buffers
  instead (:func:`window_compaction`, the same parts with other offsets).
  """
  q = meta.q_lens
  live = q > 0
  start, h, b, f, n = _window_parts(meta, window_left)
  diag = StepMetadata(q, meta.q_offsets, q, start)
  near = StepMetadata(jnp.where(b > 0, q, 0), meta.q_offsets, b, start - b)
  has_far = live & (f > 0)
  far = StepMetadata(jnp.where(has_far, n, 0),
                     jnp.clip(q_tokens - meta.q_offsets - n, 0, q_tokens),
                     jnp.where(has_far, f, 0),
                     jnp.clip(kv_tokens - (start - b), 0, kv_tokens))
  return diag, near, far


class WindowRows(NamedTuple):
  """The compact buffers of DUAL_CHUNK_SWAP's windowed near and far calls
  (:func:`window_compaction`), as index maps, per row ``[B, ..]``:

  * ``q_src [B, Sq]``: the local Q row of each compact Q row;
  * ``q_valid [B, Sq]``: whether a compact Q row holds one;
  * ``q_inv [B, Tl]``: the compact row of each local Q row;
  * ``q_has [B, Tl]``: whether the local Q row has one;
  * ``kv_src [B, Skv]``, ``kv_valid [B, Skv]``: the gathered KV row of each
    compact KV row;
  * ``kv_inv [2, B, T]``, ``kv_has [2, B, T]``: per step, the compact KV
    row of each gathered KV row (a KV row is in at most one region of
    each step: the two steps' regions may overlap, each step's do not).
  """

  q_src: jnp.ndarray
  q_valid: jnp.ndarray
  q_inv: jnp.ndarray
  q_has: jnp.ndarray
  kv_src: jnp.ndarray
  kv_valid: jnp.ndarray
  kv_inv: jnp.ndarray
  kv_has: jnp.ndarray


def _exclusive_cumsum(x):
  return jnp.cumsum(x, axis=-1) - x


def _count_le(sorted_rows, i):
  """Per row of ``sorted_rows [B, S]`` (non-decreasing): how many of its
  entries are ``<= i`` for each index of ``i [n]``, ``[B, n]`` int32. A
  binary search per index (``O(n log S)`` work and ``O(B n)`` memory, never
  a ``[B, n, S]`` comparison)."""
  count = lambda row: jnp.searchsorted(row, i, side="right")
  return jax.vmap(count)(sorted_rows).astype(jnp.int32)


def _segment_of(ends, i):
  """Per row of ``ends [B, S]`` (non-decreasing segment ends): the segment
  ``[B, n]`` holding each index of ``i [n]``."""
  return jnp.minimum(_count_le(ends, i), ends.shape[-1] - 1)


def window_compaction(steps: tuple[StepMetadata, StepMetadata],
                      cu_seqlens_padded, cp_size: int, window_left: int,
                      q_tokens: int, kv_tokens: int, sq: int, skv: int
                      ) -> tuple[StepMetadata, StepMetadata, WindowRows]:
  """The *near* and *far* parts of DUAL_CHUNK_SWAP's two windowed steps
  (:func:`split_windowed_block`) over compact buffers, and their index
  maps.

  Each (step, document) segment with keys before its chunk in reach gets
  its own region of ``n = min(q, left)`` compact Q rows (its chunk's first
  ``n`` rows, in reverse order) and ``h`` compact KV rows (the ``h`` keys
  before its chunk, nearest first). In those coordinates the near part
  (all rows against the nearest ``b`` keys, unmasked) and the far part
  (against the next ``f``, top-left causal) need no mirrored copy of the
  whole buffers, and no two segments share a compact KV row, so each
  part runs as one call in the backward too. Regions follow one another
  step by step, document by document; ``sq``/``skv`` are static bounds
  on their totals (:func:`window_compaction_sizes`).

  Returns ``(near, far, rows)``: ``near``/``far`` ``[B, 2N]`` over the
  compact buffers (``sq`` Q rows and ``skv`` KV rows per row).
  """
  both = StepMetadata(*(jnp.concatenate([getattr(m, k) for m in steps], -1)
                        for k in StepMetadata._fields))
  o = both.q_offsets
  x, h, b, f, n = _window_parts(both, window_left)
  q0, k0 = _exclusive_cumsum(n), _exclusive_cumsum(h)
  near = StepMetadata(jnp.where(b > 0, n, 0), q0, b, k0)
  far = StepMetadata(jnp.where(f > 0, n, 0), q0, f, k0 + b)

  take = lambda a, s: jnp.take_along_axis(a, s, axis=-1)
  i = jnp.arange(sq, dtype=jnp.int32)
  s = _segment_of(q0 + n, i)
  q_valid = i[None] < (q0 + n)[:, -1:]
  q_src = jnp.where(q_valid, take(o + n - 1, s) - (i[None] - take(q0, s)), 0)
  u = jnp.arange(skv, dtype=jnp.int32)
  s = _segment_of(k0 + h, u)
  kv_valid = u[None] < (k0 + h)[:, -1:]
  kv_src = jnp.where(kv_valid, take(x - 1, s) - (u[None] - take(k0, s)), 0)

  # Inverses: the document (and step) of every local Q / gathered KV row.
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  starts, plens = cuP[..., :-1], cuP[..., 1:] - cuP[..., :-1]
  ndoc = starts.shape[-1]
  doc_of = lambda firsts, r: _count_le(firsts[:, 1:], r)
  t = jnp.arange(q_tokens, dtype=jnp.int32)
  d = doc_of(starts // cp_size, t)
  rel = t[None] - take(starts // cp_size, d)
  c = take(plens // (2 * cp_size), d)
  step = (rel >= c).astype(jnp.int32)
  j = rel - step * c
  seg = step * ndoc + d
  q_has = j < take(n, seg)
  q_inv = jnp.where(q_has, take(q0 + n - 1, seg) - j, 0)
  g = jnp.arange(kv_tokens, dtype=jnp.int32)
  d = doc_of(starts, g)
  kv_inv, kv_has = [], []
  for st in (0, 1):
    seg = st * ndoc + d
    xs, hs = take(x, seg), take(h, seg)
    has = (g[None] >= xs - hs) & (g[None] < xs)
    kv_has.append(has)
    kv_inv.append(jnp.where(has, take(k0, seg) + xs - 1 - g[None], 0))
  rows = WindowRows(q_src, q_valid, q_inv, q_has, kv_src, kv_valid,
                    jnp.stack(kv_inv), jnp.stack(kv_has))
  return near, far, rows


def window_compaction_sizes(num_docs: int, cp_size: int, window_left: int,
                            max_chunk: int, q_tokens: int, kv_tokens: int
                            ) -> tuple[int, int]:
  """Static ``(Sq, Skv)`` of :func:`window_compaction`: each of the ``2N``
  segments has at most ``min(left, c)`` Q rows and ``min(left, (2cp-1)
  c)`` keys before its chunk (``c`` the longest chunk); in all at most
  the local rows, and ``(2cp-1)/(2cp)`` of a row's keys (chunk ``k``
  has at most ``k c`` before it, and a rank's two chunks ``k`` add to
  ``2cp-1``)."""
  left, segs = int(window_left), 2 * num_docs
  sq = min(q_tokens, segs * min(left, max_chunk))
  skv = min(-(-(2 * cp_size - 1) * kv_tokens // (2 * cp_size)),
            segs * min(left, (2 * cp_size - 1) * max_chunk))
  return max(sq, 1), max(skv, 1)


def no_load_balance_split(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                          total_tokens: int, exchanged_start
                          ) -> tuple[StepMetadata, StepMetadata]:
  """NO_LOAD_BALANCE step of rank ``r``, cut by where K/V come from.

  With ``lo = r*Tl``, a document that starts at or after ``lo`` sees only
  K/V of this rank: its Q and KV lengths agree (top-left == bottom-right
  causal), and it needs nothing from other ranks. At most one document per
  row starts before ``lo`` and reaches into the chunk (it *straddles* the
  boundary); only it needs remote K/V.

  Returns ``(local, straddle)``:

  * ``local`` ``[..., N]``: Q and KV offsets both index the *local* chunk.
  * ``straddle`` ``[..., 1]``: the straddling document (lengths 0 if none),
    Q offset 0 in the local chunk, KV offset into an exchanged buffer that
    holds physical tokens from ``exchanged_start`` on (0 for an all-gather,
    ``lo - halo`` for a halo exchange), bottom-right causal. A KV range
    that would start before the buffer is cut to the buffer: with a halo
    bounded by a sliding window the cut rows lie outside every query's
    window (otherwise only a document longer than the ``max_seqlen`` bound
    the buffer was sized by reaches there).
  """
  full = no_load_balance_step(cu_seqlens, cu_seqlens_padded, cp_size, rank,
                              total_tokens)
  lo = jnp.asarray(rank, jnp.int32) * (total_tokens // cp_size)
  starts = full.kv_offsets
  inside = (starts >= lo) & (full.q_lens > 0)
  rel = jnp.where(inside, starts - lo, 0)
  q_local = jnp.where(inside, full.q_lens, 0)
  local = StepMetadata(q_local, rel, q_local, rel)

  crossing = (starts < lo) & (full.q_lens > 0)
  has = crossing.any(axis=-1, keepdims=True)
  idx = jnp.argmax(crossing, axis=-1)[..., None]
  pick = lambda x: jnp.where(has, jnp.take_along_axis(x, idx, axis=-1), 0)
  q_len, kv_len, start = pick(full.q_lens), pick(full.kv_lens), pick(starts)
  kv_off = start - jnp.asarray(exchanged_start, jnp.int32)
  cut = jnp.maximum(-kv_off, 0)            # before the buffer (see above)
  straddle = StepMetadata(q_len, jnp.zeros_like(q_len),
                          jnp.where(has, kv_len - cut, 0),
                          jnp.maximum(kv_off, 0))
  return local, straddle


def ring_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank, step: int,
              *, dual_chunk: bool, causal: bool, total_tokens: int
              ) -> tuple[StepMetadata, str]:
  """Step ``step`` of the ring exchange on rank ``r``: this rank's Q
  chunk against the K/V chunk of rank ``src = (r - step) mod cp``, the
  one it holds then (docs/long_rows.md, Ring exchange). Offsets index
  the local Q rows and the held chunk's rows; returns the metadata and
  its mask, with ``q_len = kv_len = 0`` for a document that sees none of
  the chunk.

  DUAL_CHUNK_SWAP (document chunks of ``c = L_padded / 2cp`` tokens; this
  rank holds chunks ``r`` and ``2cp-1-r`` of each, ``qa`` and ``qb``
  valid rows, source ``src`` holds ``ka`` and ``kb``):

  * step 0: the local rows against themselves, top-left causal (the two
    chunks' positions rise with the local row);
  * ``src < r``: every row against chunk ``src`` (before both), unmasked;
  * ``src > r``: chunk ``2cp-1-r``'s rows against both of ``src``'s
    chunks (both before it), unmasked;
  * without a mask every step is all rows against all keys.

  NO_LOAD_BALANCE (causal): step 0 is the chunk's local call (each
  document's rows against its own rows in the chunk, top-left); a later
  step serves only the document that straddles into the chunk from
  before it (``[B, 1]``), its rows against its keys in chunk ``src = r -
  step`` (none when that wraps past rank 0), unmasked.
  """
  lens, plens, starts = _lengths(cu_seqlens, cu_seqlens_padded)
  rank = jnp.asarray(rank, jnp.int32)
  if dual_chunk:
    cp = cp_size
    c = plens // (2 * cp)
    local = starts // cp
    src = rank if step == 0 else (rank - step) % cp
    held = lambda k: jnp.clip(lens - k * c, 0, c)
    qa, qb = held(rank), held(2 * cp - 1 - rank)
    ka, kb = held(src), held(2 * cp - 1 - src)
    if not causal:
      meta, mask = StepMetadata(qa + qb, local, ka + kb, local), "no_mask"
    elif step == 0:
      meta = StepMetadata(qa + qb, local, qa + qb, local)
      mask = "causal_top_left"
    else:
      earlier = src < rank
      meta = StepMetadata(jnp.where(earlier, qa + qb, qb),
                          jnp.where(earlier, local, local + c),
                          jnp.where(earlier, ka, ka + kb), local)
      mask = "no_mask"
  else:
    tl = total_tokens // cp_size
    lo = rank * tl
    chunk = contiguous_chunk(cu_seqlens, cu_seqlens_padded, lo, tl)
    if step == 0:
      return StepMetadata(chunk.q_lens, chunk.q_offsets, chunk.q_lens,
                          chunk.q_offsets), "causal_top_left"
    crossing = (starts < lo) & (chunk.q_lens > 0)
    has = crossing.any(axis=-1, keepdims=True)
    idx = jnp.argmax(crossing, axis=-1)[..., None]
    pick = lambda x: jnp.where(has, jnp.take_along_axis(x, idx, axis=-1), 0)
    q, start, n = pick(chunk.q_lens), pick(starts), pick(lens)
    src_lo = (rank - step) * tl
    first = jnp.maximum(start, src_lo)
    kv = jnp.where(has & (rank >= step),
                   jnp.maximum(jnp.minimum(start + n, src_lo + tl) - first,
                               0), 0)
    meta = StepMetadata(q, jnp.zeros_like(q), kv, first - src_lo)
    mask = "no_mask"
  q_lens = jnp.where(meta.kv_lens > 0, meta.q_lens, 0)
  kv_lens = jnp.where(q_lens > 0, meta.kv_lens, 0)
  return StepMetadata(q_lens, meta.q_offsets, kv_lens,
                      jnp.where(kv_lens > 0, meta.kv_offsets, 0)), mask
