"""Real variable-length documents packed into THD rows, for the examples.

The documents are the Python standard library's own ``.py`` files, read as
bytes (a byte-level vocabulary of 256): real text of very different lengths
that every Python installation has, so nothing is downloaded. The file order
is sorted, then shuffled with a seed, so every run sees the same data.

Packing (:func:`pack_documents`) fills rows of ``T`` tokens with documents
back to back. Each document is padded at its end to a multiple of
``pad_multiple`` (``2*cp`` for DUAL_CHUNK_SWAP, 1 for NO_LOAD_BALANCE, see
:func:`pad_multiple_for`); one that does not fit in what is left of a row is
split there and its tail starts the next row as a new document (positions
restart at 0). Files longer than ``max_doc_len`` are cut to their first
``max_doc_len`` bytes. For NO_LOAD_BALANCE the documents of each row can
then be reordered so that every rank's contiguous chunk holds near-equal
attention work (:func:`balance_rows`); packing order is arbitrary, since
documents never attend to each other.

Two views for context parallelism (both from :mod:`jax_cp`):

* global view (``jit`` + sharded arrays): :func:`reorder_rows_for_cp` puts
  the tokens in :func:`jax_cp.reorder_for_cp` layout; shard the token axis
  contiguously over the cp mesh axis and rank ``r`` holds its own tokens;
* per-rank view (a data loader feeding one process per device, or a
  ``shard_map`` body): :func:`rows_on_cp_rank` slices out the tokens of one
  rank with :func:`jax_cp.get_batch_on_this_cp_rank`.

The metadata (``cu_seqlens``, ``cu_seqlens_padded``) is never reordered: it
always describes the global row in physical order.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
from collections.abc import Iterable, Iterator

import numpy as np

import jax_cp
from jax_cp import CPLoadBalancingStrategy

VOCAB_SIZE = 256   # bytes
PAD_ID = 0         # byte 0 never occurs in Python source


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """R packed rows of T tokens (numpy, host), next-token labels included.

  Attributes:
    tokens: int32 ``[R, T]`` input bytes (``PAD_ID`` on padding).
    labels: int32 ``[R, T]`` the next byte of the same document.
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

  def rows(self, start: int, stop: int) -> PackedRows:
    """Rows ``[start, stop)`` (a batch)."""
    return PackedRows(**{f.name: getattr(self, f.name)[start:stop]
                         for f in dataclasses.fields(self)})

  def as_dict(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def stdlib_files(seed: int = 0) -> list[pathlib.Path]:
  """The standard library's ``.py`` files (not site-packages), sorted and
  then shuffled with ``seed``."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py")
                 if not {"site-packages", "dist-packages"}
                 & set(p.relative_to(root).parts))
  if not files:
    raise RuntimeError(f"no .py files found under {root}")
  order = np.random.default_rng(seed).permutation(len(files))
  return [files[i] for i in order]


def iter_documents(seed: int = 0, max_doc_len: int | None = None
                   ) -> Iterator[np.ndarray]:
  """Endless stream of documents (uint8 arrays): the stdlib files in the
  order of :func:`stdlib_files`, each cut to ``max_doc_len`` bytes; empty
  files are skipped. After the last file, starts over in a new order
  (``seed + epoch``)."""
  epoch = 0
  while True:
    for path in stdlib_files(seed + epoch):
      data = path.read_bytes()[:max_doc_len]
      if data:
        yield np.frombuffer(data, dtype=np.uint8)
    epoch += 1


def pad_multiple_for(strategy, cp_size: int) -> int:
  """Padded document lengths must be multiples of this: ``2*cp`` for
  DUAL_CHUNK_SWAP, 1 (no padding) for NO_LOAD_BALANCE."""
  strategy = CPLoadBalancingStrategy(strategy)
  if strategy is CPLoadBalancingStrategy.DUAL_CHUNK_SWAP:
    return 2 * cp_size
  return 1


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def pack_documents(docs: Iterable[np.ndarray], seq_len: int, num_rows: int,
                   pad_multiple: int = 1,
                   max_docs: int | None = None) -> PackedRows:
  """Packs documents into ``num_rows`` rows of ``seq_len`` tokens.

  Args:
    docs: documents (int arrays of token ids), consumed as needed.
    seq_len: tokens per row ``T``; a multiple of ``pad_multiple``.
    num_rows: rows to build.
    pad_multiple: every padded document length is a multiple of it.
    max_docs: document slots per row ``N`` (static); default: the most any
      row needs, rounded up to a multiple of 8.

  Returns:
    A :class:`PackedRows`.
  """
  if seq_len % pad_multiple:
    raise ValueError(f"seq_len={seq_len} must be a multiple of "
                     f"pad_multiple={pad_multiple}")
  docs = iter(docs)
  pending: np.ndarray | None = None
  rows = []          # per row: list of (valid tokens, padded length)
  for _ in range(num_rows):
    row, free = [], seq_len
    while free:
      if pending is None or not pending.size:
        pending = np.asarray(next(docs), np.int32)
        continue
      padded = _round_up(pending.size, pad_multiple)
      if padded <= free:
        row.append((pending, padded))
        free -= padded
        pending = None
      else:          # split: the head fills the row, the tail waits
        row.append((pending[:free], free))
        pending, free = pending[free:], 0
    rows.append(row)
  n = max(len(r) for r in rows)
  if max_docs is None:
    max_docs = _round_up(n, 8)
  elif max_docs < n:
    raise ValueError(f"max_docs={max_docs} < {n} documents in a row")
  out = {k: np.zeros((num_rows, seq_len), np.int32) for k in
         ("tokens", "labels", "position_ids")}
  mask = np.zeros((num_rows, seq_len), np.float32)
  cu = np.zeros((num_rows, max_docs + 1), np.int32)
  cu_p = np.zeros((num_rows, max_docs + 1), np.int32)
  for i, row in enumerate(rows):
    lens = [d.size for d, _ in row] + [0] * (max_docs - len(row))
    plens = [p for _, p in row] + [0] * (max_docs - len(row))
    cu[i, 1:], cu_p[i, 1:] = np.cumsum(lens), np.cumsum(plens)
    for b, (doc, _) in enumerate(row):
      s, n_tok = cu_p[i, b], doc.size
      out["tokens"][i, s:s + n_tok] = doc
      out["labels"][i, s:s + n_tok - 1] = doc[1:]
      mask[i, s:s + n_tok - 1] = 1.0
  out["position_ids"] = np.asarray(jax_cp.get_position_ids(cu_p), np.int32)
  return PackedRows(tokens=out["tokens"], labels=out["labels"],
                    loss_mask=mask, position_ids=out["position_ids"],
                    cu_seqlens=cu, cu_seqlens_padded=cu_p)


def load_stdlib_rows(num_rows: int, seq_len: int, *, cp_size: int = 1,
                     strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP,
                     seed: int = 0, max_doc_len: int | None = None,
                     max_docs: int | None = None,
                     balance: bool = False) -> PackedRows:
  """``num_rows`` packed rows of standard-library source, padded for
  ``strategy`` on ``cp_size`` ranks, and with ``balance`` reordered per
  row for it (:func:`balance_rows`). Row ``i`` does not depend on
  ``num_rows`` (the stream is deterministic), so a resumed run sees the
  same batches. ``max_doc_len`` defaults to ``seq_len // 2``."""
  if max_doc_len is None:
    max_doc_len = max(seq_len // 2, 1)
  rows = pack_documents(iter_documents(seed, max_doc_len), seq_len,
                        num_rows, pad_multiple_for(strategy, cp_size),
                        max_docs)
  return balance_rows(rows, cp_size, strategy) if balance else rows


def balance_rows(rows: PackedRows, cp_size: int, strategy,
                 window_size=None) -> PackedRows:
  """Every row with its documents reordered so that NO_LOAD_BALANCE's
  contiguous chunks of ``cp_size`` ranks hold near-equal attention work
  (:func:`jax_cp.balance_document_order`, then
  :func:`jax_cp.permute_documents` on the metadata and every per-token
  array). Documents move whole, so labels, loss mask and positions stay
  right. DUAL_CHUNK_SWAP (every rank holds a share of every document):
  the rows as they are."""
  order = jax_cp.balance_document_order(
      rows.cu_seqlens, rows.cu_seqlens_padded, cp_size, strategy,
      window_size=window_size)
  fields = rows.as_dict()
  out = jax_cp.permute_documents(
      order, rows.cu_seqlens, rows.cu_seqlens_padded,
      *(fields[k] for k in PackedRows.TOKEN_FIELDS), seq_dim=1)
  fields["cu_seqlens"], fields["cu_seqlens_padded"] = out[:2]
  fields.update(zip(PackedRows.TOKEN_FIELDS, out[2:]))
  return PackedRows(**fields)


def reorder_rows_for_cp(rows: PackedRows, cp_size: int,
                        strategy) -> PackedRows:
  """Global view: every per-token array in :func:`jax_cp.reorder_for_cp`
  layout (a contiguous split of ``T`` over the cp axis then gives each rank
  its tokens). The metadata stays as is."""
  fields = rows.as_dict()
  for k in PackedRows.TOKEN_FIELDS:
    fields[k] = np.asarray(jax_cp.reorder_for_cp(
        fields[k], rows.cu_seqlens_padded, cp_size, strategy, seq_dim=1))
  return PackedRows(**fields)


def rows_on_cp_rank(rows: PackedRows, cp_size: int, cp_rank: int,
                    strategy) -> PackedRows:
  """Per-rank view: the tokens rank ``cp_rank`` holds (``[R, T/cp]`` per
  token field, via :func:`jax_cp.get_batch_on_this_cp_rank`), with the
  global metadata. This is what a data loader feeding one device (or a
  ``shard_map`` body with a ``view="local"`` layout) uses."""
  fields = rows.as_dict()
  sliced = jax_cp.get_batch_on_this_cp_rank(
      rows.cu_seqlens_padded, *(fields[k] for k in PackedRows.TOKEN_FIELDS),
      cp_size=cp_size, cp_rank=cp_rank, load_balancing_strategy=strategy,
      seq_dim=1)
  fields.update(zip(PackedRows.TOKEN_FIELDS, map(np.asarray, sliced)))
  return PackedRows(**fields)
