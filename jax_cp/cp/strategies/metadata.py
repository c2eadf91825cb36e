"""Per-step attention metadata of CP, the part every strategy shares
(docs/internals.md, Call plans); each strategy's own formulas are in its
module of :mod:`jax_cp.cp.strategies`.

Pure ``jnp`` functions of the row metadata (``cu_seqlens``,
``cu_seqlens_padded``). Every result is per document, int32 ``[..., N]``:

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

import jax.numpy as jnp


class StepMetadata(NamedTuple):
  q_lens: jnp.ndarray
  q_offsets: jnp.ndarray
  kv_lens: jnp.ndarray
  kv_offsets: jnp.ndarray


def lengths(cu_seqlens, cu_seqlens_padded):
  """``(valid lengths, padded lengths, padded starts)`` of the documents,
  int32 ``[..., N]``."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  return cu[..., 1:] - cu[..., :-1], cuP[..., 1:] - cuP[..., :-1], cuP[..., :-1]


def contiguous_chunk(cu_seqlens, cu_seqlens_padded, lo, size: int
                     ) -> StepMetadata:
  """The documents' parts in the causal call of the queries of tokens
  ``[lo, hi = lo + size)`` of the row, against the row's keys.

  With ``s = cuP[b]``: ``q_len = max(clamp(s+L, lo, hi) - clamp(s, lo,
  hi), 0)``, ``q_off = clamp(s, lo, hi) - lo``, ``kv_len = min(max(hi-s,
  0), L)``, ``kv_off = s``.
  """
  lens, _, starts = lengths(cu_seqlens, cu_seqlens_padded)
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
