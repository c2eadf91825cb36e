"""The halo call of a straddling document: one implementation for CP's
NO_LOAD_BALANCE chunks and for layer chunks (docs/internals.md, Call
plans).

A chunk of a row's tokens (a rank's chunk under NO_LOAD_BALANCE, or one
chunk of ``TransformerLayer.layer_chunk_size``) holds documents that start
inside it and, per row, at most one document that starts before it: the
document *straddles* the chunk's start. Its queries in the chunk see its
keys in the chunk and its keys before it. As one call that document is
bottom-right causal, whose cuDNN backward is slower than a top-left
one, many times so with a sliding window's band (docs/decisions.md).
Attention over a set of keys is a log-sum-exp merge of attention over its
parts, so the document's keys are split at the chunk's start:

* its keys in the chunk: top-left causal, a segment of the chunk's own
  call, which the caller runs;
* its keys before the chunk: the **halo call** of this module, the
  document's first rows of the chunk against those keys. Either a
  **rectangle** (every one of its rows sees every one of those keys: no
  window, or one that reaches past them), unmasked; or **reversed** (a
  sliding window of ``left`` keys bounds how far back a row reads: the
  halo holds the ``H`` keys before the chunk, row ``j`` sees halo row
  ``m`` when ``m >= j + H - left``): over the first ``rows`` rows with
  rows and keys both in reverse order that is plain top-left causal, and
  the document's keys are the first of the reversed halo.

Forward: :func:`forward` gives the halo call's rows, :func:`merge` merges
them into the chunk call's by log-sum-exp. Backward: given the merged
``out`` and ``lse``, :func:`backward` gives the halo call's dq on its rows
(the caller adds it to the chunk call's) and the dK/dV of the keys it
read. Rows of the call that are not the straddling document's count
nothing: in a rectangle no segment covers them; reversed, the forward's
merge drops them and the backward gives them zero out and dO and an lse
that makes every probability 0 (:data:`jax_cp.attention.decompose.merge.
NO_WEIGHT_LSE`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.attention.backend import (
  AttentionBackend,
  Segments,
  packed,
  row_segments,
)
from jax_cp.attention.decompose.merge import (
  NO_WEIGHT_LSE,
  merge_softmax_rows,
  reversed_prefix,
)


class HaloCall(NamedTuple):
  """The halo call of one chunk, for a batch of ``B`` rows.

  Attributes:
    segments: one segment per row, over the ``B * rows`` query rows of
      :func:`query_side` and the rows of the K/V buffer the call reads.
    rows: static: the call's query rows, the chunk's first ``rows`` (zero
      rows past the chunk when it is shorter).
    doc_rows: int ``[B]``: how many of those rows are the straddling
      document's (0 where no document straddles).
    reversed: static: rows and keys in reverse order, top-left causal
      (else an unmasked rectangle in sequence order).
  """

  segments: Segments
  rows: int
  doc_rows: jax.Array
  reversed: bool

  @property
  def mask(self) -> str:
    """The backend mask of the call."""
    return "causal_top_left" if self.reversed else "no_mask"


def halo_call(doc_rows, keys, key_offsets, *, rows: int, kv_tokens: int,
              max_kv: int, reversed: bool) -> HaloCall:
  """The halo call of the straddling documents of ``B`` rows.

  Args:
    doc_rows: int ``[B]``: the straddling document's queries in the chunk
      (from the chunk's first row).
    keys: int ``[B]``: its keys before the chunk (0: no document
      straddles).
    key_offsets: int ``[B]``: where those keys start in the K/V buffer (a
      rectangle's; a reversed call's K/V buffer is the ``kv_tokens`` keys
      right before the chunk, of which the document's are the last
      ``keys``, the first once reversed).
    rows: the call's query rows (static).
    kv_tokens: the rows of the K/V buffer (static).
    max_kv: the static bound on ``keys``.
    reversed: the call is reversed (see the module docstring).
  """
  doc_rows, keys = (jnp.asarray(x, jnp.int32) for x in (doc_rows, keys))
  live = keys > 0
  zero = jnp.zeros_like(keys)
  q_lens = jnp.where(live, rows if reversed else doc_rows, 0)
  offsets = zero if reversed else jnp.asarray(key_offsets, jnp.int32)
  seg = row_segments(q_lens[:, None], keys[:, None], zero[:, None],
                     offsets[:, None], rows, kv_tokens, rows, max_kv,
                     rows_see_keys=True, heaviest_first=True)
  return HaloCall(seg, int(rows), jnp.where(live, doc_rows, 0), reversed)


def query_side(call: HaloCall, x, fill=None):
  """The call's input from a query-side array ``x [B, Tq, ...]`` (q, out,
  lse, dO): its first ``call.rows`` rows; reversed, with zero rows past
  ``Tq`` and ``fill`` (when given) on the rows past each row's
  ``doc_rows``."""
  if not call.reversed:
    return x[:, :call.rows]
  return reversed_prefix(x, call.rows, call.doc_rows, fill)


def _key_side(call: HaloCall, k, v):
  if not call.reversed:
    return k, v
  return jnp.flip(k, axis=1), jnp.flip(v, axis=1)


def _chunk_order(call: HaloCall, x, n: int):
  """A per-row result back in the chunk's order, its first ``n`` rows."""
  return (jnp.flip(x, axis=1) if call.reversed else x)[:, :n]


def forward(backend: AttentionBackend, call: HaloCall, q, k, v, *,
            scale: float):
  """The halo call's forward: ``(out, lse)`` on the chunk's first ``n =
  min(rows, Tq)`` rows, ``[B, n, Hq, D]`` and ``[B, n, Hq]``, for queries
  ``q [B, Tq, Hq, D]`` and the K/V buffer ``k``, ``v`` ``[B, S, Hkv,
  D]``."""
  n = min(call.rows, q.shape[1])
  qh = query_side(call, q)
  kh, vh = _key_side(call, k, v)
  out, lse = backend.forward(packed(qh), packed(kh), packed(vh), call.segments,
                             mask=call.mask, scale=scale)
  return (_chunk_order(call, out.reshape(qh.shape), n),
          _chunk_order(call, lse.reshape(qh.shape[:3]), n))


def merge(out, lse, part_out, part_lse, call: HaloCall, merge_rows):
  """The chunk call's ``out [B, Tq, ..]`` and ``lse`` with the halo call's
  rows (:func:`forward`) merged in by log-sum-exp on the straddling
  document's rows (:func:`jax_cp.attention.decompose.merge.
  merge_softmax_rows`)."""
  n = part_out.shape[1]
  valid = jnp.arange(n)[None, :] < call.doc_rows[:, None]
  return merge_softmax_rows(out, lse, part_out, part_lse, valid, merge_rows)


def backward(backend: AttentionBackend, call: HaloCall, q, k, v, out, lse,
             dout, *, scale: float):
  """The halo call's backward on the merged ``out`` and ``lse``: ``(dq
  [B, n, Hq, D], dk, dv)``, dq on the chunk's first ``n = min(rows,
  Tq)`` rows, dK/dV shaped like ``k``, ``v`` (in sequence order)."""
  n, heads = min(call.rows, q.shape[1]), q.shape[2]
  qh = query_side(call, q, 0)
  kh, vh = _key_side(call, k, v)
  dq, dk, dv = backend.backward(
      packed(qh), packed(kh), packed(vh), packed(query_side(call, out, 0)),
      query_side(call, lse, NO_WEIGHT_LSE).reshape(-1, heads),
      packed(query_side(call, dout, 0)), call.segments, mask=call.mask,
      scale=scale)
  dk, dv = _key_side(call, dk.reshape(kh.shape), dv.reshape(vh.shape))
  return _chunk_order(call, dq.reshape(qh.shape), n), dk, dv
