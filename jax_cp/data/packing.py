"""Packing documents into THD rows with a strategy's padding.

:func:`pack_documents` fills rows of ``T`` tokens with documents back to
back, next-token labels included; :class:`DocumentPacker` does the same
batch after batch, a document cut at the end of one batch going on in the
next. Each document is padded at its end to a multiple of
:func:`pad_multiple_for` (``2*cp`` for DUAL_CHUNK_SWAP, whose two chunks
per rank split every document in ``2*cp`` equal parts; 1 for
NO_LOAD_BALANCE); one that does not fit in what is left of a row is split
there, and its tail starts the next row as a new document (positions
restart at 0). Documents longer than a ``max_seqlen`` bound can be split
into pieces first. Every row has the same number of document slots
(:func:`default_max_docs` unless given), so every batch has the same
shapes. :func:`balance_rows` then reorders each row's documents so that
NO_LOAD_BALANCE's contiguous chunks hold near-equal attention work.

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
from jax_cp.cp.strategies import strategy_for
from jax_cp.planning.document_order import (
  balance_document_order,
  permute_documents,
)
from jax_cp.typing import WindowSize


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
  return strategy_for(layout.strategy).pad_multiple(int(cp))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


#: The default ``max_docs`` gives a row one slot per this many tokens (or
#: per ``pad_multiple``, if larger): rows whose documents average at least
#: that many padded tokens fit.
DEFAULT_TOKENS_PER_SLOT = 64

#: ``max_docs="fit"``: the most any row of the batch needs, rounded up to a
#: multiple of 8 (shapes then change from batch to batch).
FIT = "fit"


def default_max_docs(seq_len: int, pad_multiple: int = 1) -> int:
  """The document slots per row that :func:`pack_documents` and
  :class:`DocumentPacker` give by default: ``ceil(seq_len /
  max(pad_multiple, DEFAULT_TOKENS_PER_SLOT))`` rounded up to a multiple
  of 8. It depends on nothing else, so every batch has the same shapes; a
  row whose documents average fewer padded tokens than
  ``max(pad_multiple, DEFAULT_TOKENS_PER_SLOT)`` needs more and raises.
  ``seq_len // pad_multiple`` slots always suffice."""
  check_packing_args(seq_len, 1, pad_multiple)
  return _round_up(-(-seq_len // max(pad_multiple, DEFAULT_TOKENS_PER_SLOT)),
                   8)


def _check_positive_int(value, name: str) -> int:
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def check_packing_args(seq_len: int, num_rows: int, pad_multiple: int,
                       max_docs=None, max_seqlen: int | None = None) -> None:
  """Raises a ``ValueError`` naming the argument of :func:`pack_documents`
  or :class:`DocumentPacker` that breaks its rule: ``seq_len``,
  ``num_rows``, ``pad_multiple`` positive ints, ``seq_len`` a multiple of
  ``pad_multiple``, ``max_docs`` ``None``, ``"fit"`` or a positive int,
  ``max_seqlen`` ``None`` or an int of at least ``pad_multiple``."""
  for name, x in (("seq_len", seq_len), ("num_rows", num_rows),
                  ("pad_multiple", pad_multiple)):
    _check_positive_int(x, name)
  if seq_len % pad_multiple:
    raise ValueError(f"seq_len={seq_len} must be a multiple of "
                     f"pad_multiple={pad_multiple}")
  if max_docs is not None and not (isinstance(max_docs, str)
                                   and max_docs == FIT):
    if isinstance(max_docs, str):
      raise ValueError(f"max_docs must be None, {FIT!r} or a positive int, "
                       f"got {max_docs!r}")
    _check_positive_int(max_docs, "max_docs")
  if max_seqlen is not None:
    _check_positive_int(max_seqlen, "max_seqlen")
    if max_seqlen < pad_multiple:
      raise ValueError(f"max_seqlen={max_seqlen} is smaller than "
                       f"pad_multiple={pad_multiple}: no piece of a split "
                       "document would fit in it once padded")


def check_document(doc, index: int) -> np.ndarray:
  """``doc`` as int32 tokens; raises a ``ValueError`` naming document
  ``index`` of ``docs`` unless it is a 1-D array of integers (or empty)."""
  arr = np.asarray(doc)
  if arr.size and (arr.ndim != 1
                   or not np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(f"document {index} of docs must be a 1-D array of int "
                     f"token ids, got shape {arr.shape} and dtype "
                     f"{arr.dtype}")
  return arr.astype(np.int32).reshape(-1)


class _DocsRanOut(Exception):
  """The documents ended before the rows were full."""


class _Pieces:
  """The documents in pieces of at most ``piece`` tokens (``None``: whole),
  the part of the current piece not yet placed in a row waiting."""

  def __init__(self, docs: Iterable, piece: int | None):
    self._docs = iter(docs)
    self._piece = piece
    self._read = 0                         # documents read
    self._rest = np.zeros(0, np.int32)     # the document after the piece
    self.piece = np.zeros(0, np.int32)     # what is left of the piece

  def current(self) -> np.ndarray:
    """The unplaced tokens of the current piece (a new one if it is used
    up; empty documents are skipped)."""
    while not self.piece.size:
      if not self._rest.size:
        try:
          doc = next(self._docs)
        except StopIteration:
          raise _DocsRanOut from None
        self._rest = check_document(doc, self._read)
        self._read += 1
      cut = self._rest.size if self._piece is None else self._piece
      self.piece, self._rest = self._rest[:cut], self._rest[cut:]
    return self.piece

  def pending(self) -> np.ndarray:
    """The tokens read from ``docs`` and not placed yet."""
    return np.concatenate([self.piece, self._rest])


def _fill_rows(source: _Pieces, seq_len: int, num_rows: int, multiple: int,
               max_docs: int | None, where: str) -> list:
  """Per row, its ``(tokens, padded length)`` documents; ``max_docs=None``:
  no limit. Raises :class:`_DocsRanOut` when the documents end first."""
  rows = []
  for r in range(num_rows):
    row, free = [], seq_len
    while free:
      if max_docs is not None and len(row) == max_docs:
        raise ValueError(
            f"{where}row {r} needs more than max_docs={max_docs} document "
            f"slots: {max_docs} documents fill {seq_len - free} of its "
            f"seq_len={seq_len} tokens. Pass a larger max_docs "
            f"(seq_len // pad_multiple = {seq_len // multiple} always "
            f"fits; the default is jax_cp.data.default_max_docs(seq_len, "
            f"pad_multiple)) or max_docs={FIT!r}")
      piece = source.current()
      padded = _round_up(piece.size, multiple)
      if padded <= free:
        row.append((piece, padded))
        free -= padded
        source.piece = piece[piece.size:]
      else:          # cut: the head fills the row, the tail waits
        row.append((piece[:free], free))
        source.piece, free = piece[free:], 0
    rows.append(row)
  return rows


def _to_rows(rows: list, seq_len: int, max_docs: int, pad_id: int
             ) -> PackedRows:
  """The :class:`PackedRows` of :func:`_fill_rows`' rows."""
  num_rows = len(rows)
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


class DocumentPacker:
  """Batches of packed rows from a stream of documents, every batch of the
  same shapes; a document cut at the end of a batch goes on in the next.

  Iterate it: each item is a :class:`PackedRows` of ``num_rows`` rows of
  ``seq_len`` tokens, packed as :func:`pack_documents` packs (documents
  back to back, each padded at its end to a multiple of ``pad_multiple``,
  one that does not fit in what is left of a row split there, its tail
  starting the next row as a new document, positions from 0). Consecutive
  batches are the consecutive rows of one :func:`pack_documents` call over
  all of them: every token of ``docs`` lands in exactly one row, in order.

  ``docs`` is read only as far as the rows need. When it ends before a
  batch is full, iteration stops, and the tokens read for that incomplete
  batch are not returned (as a data loader drops its last incomplete
  batch). What has been read and not placed yet, the rest of a cut
  document, is :attr:`pending`.

  Args:
    docs: documents (1-D int arrays of token ids), an iterable.
    seq_len: tokens per row ``T``; a multiple of ``pad_multiple``.
    num_rows: rows per batch.
    pad_multiple: every padded document length is a multiple of it
      (:func:`pad_multiple_for` of the layout).
    max_docs: document slots per row ``N`` (static): an int, ``None`` for
      :func:`default_max_docs` of ``seq_len`` and ``pad_multiple``, or
      ``"fit"``: the most a row of the batch needs, rounded up to a
      multiple of 8, which changes from batch to batch (a jitted step then
      compiles again for each new count).
    max_seqlen: split documents so that no padded document is longer:
      each document is cut into pieces of the largest multiple of
      ``pad_multiple`` not above it (the last piece the rest), every piece
      a document of its own (positions from 0, no label across the cut).
      Pass the layout's ``max_seqlen`` bound and every batch keeps to it.
      ``None``: documents are only cut where a row ends.
    pad_id: the token (and label) of padding positions.

  Attributes:
    seq_len, num_rows, pad_multiple, max_seqlen, pad_id: as given.
    max_docs: the slots per row (``"fit"`` if so given).

  Raises:
    ValueError: a bad argument (at construction, naming it and its rule);
      from ``next``: a row needs more than ``max_docs`` slots (naming the
      batch, the row and the counts), or a document is not a 1-D array of
      integers (naming it). After such an error the packer stops: each
      later ``next`` raises it again.
  """

  def __init__(self, docs: Iterable, seq_len: int, num_rows: int,
               pad_multiple: int = 1, *, max_docs: int | str | None = None,
               max_seqlen: int | None = None, pad_id: int = 0) -> None:
    check_packing_args(seq_len, num_rows, pad_multiple, max_docs,
                       max_seqlen)
    self.seq_len, self.num_rows = int(seq_len), int(num_rows)
    self.pad_multiple, self.pad_id = int(pad_multiple), pad_id
    self.max_seqlen = None if max_seqlen is None else int(max_seqlen)
    self.max_docs = (default_max_docs(seq_len, pad_multiple)
                     if max_docs is None else
                     max_docs if isinstance(max_docs, str) else int(max_docs))
    piece = (None if max_seqlen is None
             else max_seqlen // pad_multiple * pad_multiple)
    self._source = _Pieces(docs, piece)
    self._batches = 0
    self._error: ValueError | None = None

  @property
  def pending(self) -> np.ndarray:
    """int32 tokens read from ``docs`` and not in a row yet: the tail of a
    document cut at the end of the last batch (empty if none)."""
    return self._source.pending()

  def __iter__(self) -> DocumentPacker:
    return self

  def _next(self, where: str) -> PackedRows:
    """The next batch; raises :class:`_DocsRanOut` when ``docs`` ends."""
    if self._error is not None:
      raise ValueError(f"the packer stopped at an error: {self._error}")
    fit = isinstance(self.max_docs, str)
    try:
      rows = _fill_rows(self._source, self.seq_len, self.num_rows,
                        self.pad_multiple, None if fit else self.max_docs,
                        where)
    except ValueError as e:
      self._error = e
      raise
    n = _round_up(max(len(r) for r in rows), 8) if fit else self.max_docs
    self._batches += 1
    return _to_rows(rows, self.seq_len, n, self.pad_id)

  def __next__(self) -> PackedRows:
    try:
      return self._next(f"batch {self._batches}, ")
    except _DocsRanOut:
      raise StopIteration from None


def pack_documents(docs: Iterable, seq_len: int, num_rows: int,
                   pad_multiple: int = 1, max_docs: int | str | None = None,
                   pad_id: int = 0, *,
                   max_seqlen: int | None = None) -> PackedRows:
  """Packs documents into ``num_rows`` rows of ``seq_len`` tokens, once.

  A document that does not fit in what is left of a row is split there;
  its tail starts the next row. The tail of a document cut at the end of
  the *last* row is dropped: ``docs`` has been read past it, and a second
  call on the same iterator starts with the next document. To carry it
  into the next batch, iterate a :class:`DocumentPacker` instead.

  Args:
    docs: documents (1-D int arrays of token ids), consumed as needed; the
      same documents give the same rows, and row ``i`` does not depend on
      ``num_rows``.
    seq_len: tokens per row ``T``; a multiple of ``pad_multiple``.
    num_rows: rows to build.
    pad_multiple: every padded document length is a multiple of it
      (:func:`pad_multiple_for` of the layout).
    max_docs: document slots per row ``N`` (static); default:
      :func:`default_max_docs` of ``seq_len`` and ``pad_multiple``, the
      same for every call; ``"fit"``: the most any row needs, rounded up
      to a multiple of 8.
    pad_id: the token of padding positions.
    max_seqlen: split documents so that no padded document is longer
      (see :class:`DocumentPacker`); ``None``: only where rows end.

  Returns:
    A :class:`PackedRows`.

  Raises:
    ValueError: a bad argument (``seq_len`` not a multiple of
      ``pad_multiple``, ...), a row needs more than ``max_docs`` slots
      (naming the row and the counts), a document is not a 1-D array of
      integers, or the documents run out.
  """
  packer = DocumentPacker(docs, seq_len, num_rows, pad_multiple,
                          max_docs=max_docs, max_seqlen=max_seqlen,
                          pad_id=pad_id)
  try:
    return packer._next("")
  except _DocsRanOut:
    raise ValueError(f"docs ran out before num_rows={num_rows} rows of "
                     f"seq_len={seq_len} tokens were filled") from None


def balance_rows(rows: PackedRows, layout: CPLayout,
                 window_size: WindowSize = None) -> PackedRows:
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


__all__ = ("DocumentPacker", "PackedRows", "balance_rows", "check_document",
           "check_packing_args", "default_max_docs", "pack_documents",
           "pad_multiple_for")
