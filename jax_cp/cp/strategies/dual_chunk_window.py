"""DUAL_CHUNK_SWAP's windowed metadata (docs/internals.md, Call plans):
a windowed chunk split into its diagonal, near and far parts
(:func:`split_windowed_block`), and the near and far parts of both steps
over compact buffers (:func:`window_compaction`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.cp.strategies.metadata import StepMetadata


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
