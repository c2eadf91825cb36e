"""Packing documents into THD rows with a strategy's padding.

:func:`pack_documents` fills rows of ``T`` tokens with documents back to
back, next-token labels included. Each document is padded at its end to a
multiple of :func:`pad_multiple_for` (``2*cp`` for DUAL_CHUNK_SWAP, whose two
chunks per rank split every document in ``2*cp`` equal parts; 1 for
NO_LOAD_BALANCE); one that does not fit in what is left of a row is split
there, and its tail starts the next row as a new document (positions
restart at 0). :func:`balance_rows` then reorders each row's documents so
that NO_LOAD_BALANCE's contiguous chunks hold near-equal attention work.

The rows are host (numpy) arrays in physical order, with their metadata:
hand them to :func:`jax_cp.data.make_global_batch` (``rows.tensors``,
``rows.cu_seqlens_padded``, ``cu_seqlens=rows.cu_seqlens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jax_cp.cp.layout import CPLayout, check_layout
from jax_cp.cp.partition import get_position_ids
from jax_cp.cp.strategy import CPLoadBalancingStrategy
from jax_cp.planning.document_order import (
  balance_document_order,
  permute_documents,
)


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """R packed rows of T tokens (numpy, host), next-token labels included.

  Index it like an array of rows: ``rows[a:b]`` (a batch), ``rows[idx]``
  (the rows of :func:`jax_cp.data.process_batch_rows`).

  Attributes:
    tokens: int32 ``[R, T]`` input tokens (``pad_id`` on padding).
    labels: int32 ``[R, T]`` the next token of the same document.
    loss_mask: float32 ``[R, T]`` 1 where ``labels`` is a real target.
    position_ids: int32 ``[R, T]`` position of each token in its document.
    cu_seqlens: int32 ``[R, N+1]`` cumulative valid document lengths.
    cu_seqlens_padded: int32 ``[R, N+1]`` cumulative padded lengths; unused
      document slots at the end are empty (repeat the last value).
  """

  tokens: np.ndarray
  labels: np.ndarray
  loss_mask: np.ndarray
  position_ids: np.ndarray
  cu_seqlens: np.ndarray
  cu_seqlens_padded: np.ndarray

  TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  @property
  def max_seqlen(self) -> int:
    """The longest padded document: the static ``max_seqlen`` bound."""
    return int(np.diff(self.cu_seqlens_padded, axis=-1).max())

  @property
  def tensors(self) -> dict[str, np.ndarray]:
    """The per-token arrays (:attr:`TOKEN_FIELDS`) by name."""
    return {k: getattr(self, k) for k in self.TOKEN_FIELDS}

  def __getitem__(self, index) -> PackedRows:
    """The rows ``index`` (a slice or integer array) of every field."""
    if isinstance(index, (int, np.integer)):
      index = slice(index, index + 1)
    return PackedRows(**{f.name: getattr(self, f.name)[index]
                         for f in dataclasses.fields(self)})


def pad_multiple_for(layout: CPLayout) -> int:
  """Padded document lengths of rows for ``layout`` must be multiples of
  this: ``2 * cp`` for DUAL_CHUNK_SWAP (its two chunks per rank split every
  document in ``2 * cp`` equal parts), 1 (no padding) for NO_LOAD_BALANCE
  and without CP. The cp size is the layout's, or read from the context
  mesh."""
  layout = check_layout(layout, "pad_multiple_for")
  if layout.cp_axis is None:
    return 1
  cp = layout.cp_size or layout.resolve_cp_size()
  if layout.strategy is CPLoadBalancingStrategy.DUAL_CHUNK_SWAP:
    return 2 * int(cp)
  return 1


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _fill_rows(docs, seq_len: int, num_rows: int, multiple: int) -> list:
  """Per row, its ``(tokens, padded length)`` documents."""
  docs = iter(docs)
  pending = np.zeros(0, np.int32)
  rows = []
  for _ in range(num_rows):
    row, free = [], seq_len
    while free:
      if not pending.size:
        try:
          pending = np.asarray(next(docs), np.int32).reshape(-1)
        except StopIteration:
          raise ValueError(f"docs ran out before num_rows={num_rows} rows "
                           f"of seq_len={seq_len} tokens were filled") from None
        continue
      padded = _round_up(pending.size, multiple)
      if padded <= free:
        row.append((pending, padded))
        free -= padded
        pending = np.zeros(0, np.int32)
      else:          # split: the head fills the row, the tail waits
        row.append((pending[:free], free))
        pending, free = pending[free:], 0
    rows.append(row)
  return rows


def pack_documents(docs: Iterable, seq_len: int, num_rows: int,
                   pad_multiple: int = 1, max_docs: int | None = None,
                   pad_id: int = 0) -> PackedRows:
  """Packs documents into ``num_rows`` rows of ``seq_len`` tokens.

  Args:
    docs: documents (1-D int arrays of token ids), consumed as needed; the
      same documents give the same rows, and row ``i`` does not depend on
      ``num_rows``.
    seq_len: tokens per row ``T``; a multiple of ``pad_multiple``.
    num_rows: rows to build.
    pad_multiple: every padded document length is a multiple of it
      (:func:`pad_multiple_for` of the layout).
    max_docs: document slots per row ``N`` (static); default: the most any
      row needs, rounded up to a multiple of 8.
    pad_id: the token of padding positions.

  Returns:
    A :class:`PackedRows`.

  Raises:
    ValueError: ``seq_len`` is not a multiple of ``pad_multiple``, a row
      needs more than ``max_docs`` slots, or the documents run out.
  """
  for name, x in (("seq_len", seq_len), ("num_rows", num_rows),
                  ("pad_multiple", pad_multiple)):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
      raise ValueError(f"{name} must be a positive int, got {x!r}")
  if seq_len % pad_multiple:
    raise ValueError(f"seq_len={seq_len} must be a multiple of "
                     f"pad_multiple={pad_multiple}")
  rows = _fill_rows(docs, seq_len, num_rows, pad_multiple)
  n = max(len(r) for r in rows)
  if max_docs is None:
    max_docs = _round_up(n, 8)
  elif max_docs < n:
    raise ValueError(f"max_docs={max_docs} < {n} documents in a row")
  tokens = np.full((num_rows, seq_len), pad_id, np.int32)
  labels = np.full((num_rows, seq_len), pad_id, np.int32)
  mask = np.zeros((num_rows, seq_len), np.float32)
  cu = np.zeros((num_rows, max_docs + 1), np.int32)
  cu_p = np.zeros((num_rows, max_docs + 1), np.int32)
  for i, row in enumerate(rows):
    cu[i, 1:len(row) + 1] = np.cumsum([d.size for d, _ in row])
    cu_p[i, 1:len(row) + 1] = np.cumsum([p for _, p in row])
    cu[i, len(row) + 1:], cu_p[i, len(row) + 1:] = cu[i, len(row)], seq_len
    for b, (doc, _) in enumerate(row):
      s, n_tok = cu_p[i, b], doc.size
      tokens[i, s:s + n_tok] = doc
      labels[i, s:s + n_tok - 1] = doc[1:]
      mask[i, s:s + n_tok - 1] = 1.0
  return PackedRows(tokens=tokens, labels=labels, loss_mask=mask,
                    position_ids=np.asarray(get_position_ids(cu_p), np.int32),
                    cu_seqlens=cu, cu_seqlens_padded=cu_p)


def balance_rows(rows: PackedRows, layout: CPLayout,
                 window_size=None) -> PackedRows:
  """Every row with its documents reordered so that NO_LOAD_BALANCE's
  contiguous chunks of the layout's ranks hold near-equal attention work
  (:func:`jax_cp.planning.balance_document_order`, then
  :func:`jax_cp.planning.permute_documents` on the metadata and every
  per-token array). Documents move whole, so labels, loss mask and
  positions stay right. DUAL_CHUNK_SWAP (every rank holds a share of every
  document): the rows as they are."""
  order = balance_document_order(rows.cu_seqlens, rows.cu_seqlens_padded,
                                 layout, window_size=window_size)
  out = permute_documents(order, rows.cu_seqlens, rows.cu_seqlens_padded,
                          *rows.tensors.values(), seq_dim=1)
  return PackedRows(cu_seqlens=out[0], cu_seqlens_padded=out[1],
                    **dict(zip(PackedRows.TOKEN_FIELDS, out[2:])))


__all__ = ("PackedRows", "balance_rows", "pack_documents",
           "pad_multiple_for")
