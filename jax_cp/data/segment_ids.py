"""Rows in the segment-id convention <-> jax_cp's packed rows.

The JAX ecosystem describes a packed row by a segment id per token (MaxText's
``inputs_segmentation``, grain's ``<feature>_segment_ids``, TE JAX): every
document is one contiguous run of one non-zero id, and 0 marks padding.
jax_cp describes it by cumulative lengths (``cu_seqlens``,
``cu_seqlens_padded``) with every document's valid tokens at the start of
its padded slot.

* :func:`rows_from_segment_ids` (host, numpy): a batch ``[B, T]`` in the
  segment-id convention to :class:`jax_cp.data.PackedRows` for a strategy's
  padding. Rows whose documents already start at multiples of the padding
  (grain's ``pack_alignment_struct``) keep every token where it is; other
  rows are re-laid, each document padded to the multiple.
* :func:`to_segment_layout`: per-token outputs of the packed rows (logits,
  losses) back in the caller's segment-id layout, and
  :func:`from_segment_layout` the other way (per-token features of the
  caller's batch into the packed rows).
* :func:`cu_seqlens_from_segment_ids` (jittable): the metadata of aligned
  rows already on the device, for a static number of document slots.

Padding sits either at the end of a row only (``padding="trailing"``,
MaxText's packing) or after any document (``padding="between"``, grain's
aligned packing). The padding after a document, up to the next document
(or the next multiple of the padding for the last one), belongs to its
padded slot; the rest of a row after its last document is one more slot,
empty (valid length 0): an empty slot never counts against ``max_seqlen``
(:func:`jax_cp.cp.validation.document_spans`; pass the rows'
``cu_seqlens`` on to :func:`jax_cp.data.make_global_batch`), and it keeps
the last document's chunks balanced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.validation import concrete
from jax_cp.cp.partition import get_position_ids
from jax_cp.data.packing import PackedRows

PADDING = ("trailing", "between")
OVERFLOW = ("raise", "truncate")


# ------------------------------------------------------------- validation


def check_segment_arrays(segment_ids, **arrays) -> dict[str, np.ndarray]:
  """``segment_ids`` and the other per-token arrays as numpy, checked.

  Raises:
    ValueError: ``segment_ids`` is not a ``[B, T]`` array of integers (a
      float or bool dtype included), holds a negative id, or another array
      has another shape.
  """
  seg = np.asarray(segment_ids)
  if seg.ndim != 2:
    raise ValueError(f"segment_ids must be [B, T], got shape {seg.shape}")
  if not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"segment_ids must hold integers, got dtype {seg.dtype}"
                     " (0 for padding, one non-zero id per document)")
  if seg.size and seg.min() < 0:
    r, p = map(int, np.argwhere(seg < 0)[0])
    raise ValueError(f"segment_ids[{r}, {p}] = {seg[r, p]} is negative: ids "
                     "are 0 (padding) or positive (a document)")
  out = {"segment_ids": seg}
  for name, x in arrays.items():
    if x is None:
      continue
    x = np.asarray(x)
    if x.shape != seg.shape:
      raise ValueError(f"{name} has shape {x.shape}, segment_ids {seg.shape}:"
                       " every per-token array must have the same [B, T]")
    out[name] = x
  return out


def _runs(seg_row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(starts, ends, ids)`` of the maximal runs of equal ids of one row."""
  change = np.flatnonzero(seg_row[1:] != seg_row[:-1]) + 1
  starts = np.concatenate([[0], change])
  ends = np.concatenate([change, [seg_row.size]])
  return starts, ends, seg_row[starts]


def check_row_documents(row: int, starts, ends, ids, padding: str) -> None:
  """Every document of row ``row`` is one run of its id; with
  ``padding="trailing"`` no document follows padding.

  Raises:
    ValueError: naming the row, the position and the rule broken.
  """
  docs = np.flatnonzero(ids != 0)
  seen: dict[int, int] = {}
  for k in docs:
    d = int(ids[k])
    if d in seen:
      raise ValueError(
          f"row {row}: segment id {d} starts again at position {starts[k]} "
          f"after its run ended at position {seen[d]}; a document must be one"
          " contiguous run of its id")
    seen[d] = int(ends[k])
  if padding == "trailing":
    pads = np.flatnonzero(ids == 0)
    if pads.size and docs.size and docs[-1] > pads[0]:
      k = int(docs[docs > pads[0]][0])
      raise ValueError(
          f"row {row}, position {starts[k]}: segment id {ids[k]} after "
          f"padding started at position {starts[pads[0]]}; with "
          "padding='trailing' padding only ends a row (rows padded after "
          "each document, as grain's pack_alignment_struct makes them: "
          "padding='between')")


def check_positions(seg: np.ndarray, positions: np.ndarray) -> None:
  """Positions restart at 0 where a document starts and step by 1 inside
  it (padding positions are not checked).

  Raises:
    ValueError: naming the row, the position, the value and the rule.
  """
  t = np.arange(seg.shape[1])
  starts = np.ones(seg.shape, bool)
  starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
  first = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
  bad = (seg != 0) & (positions != t - first)
  if bad.any():
    r, p = map(int, np.argwhere(bad)[0])
    s = int(first[r, p])
    rule = (f"a document restarts at 0 (segment id {seg[r, p]} starts at "
            f"position {p})" if p == s else
            f"positions step by 1 inside a document (positions[{r}, {p - 1}]"
            f" = {positions[r, p - 1]}; segment id {seg[r, p]} starts at "
            f"position {s})")
    raise ValueError(f"positions[{r}, {p}] = {positions[r, p]} disagrees with"
                     f" segment_ids: {rule}")


def _check_choice(value, name: str, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _check_positive_int(value, name: str) -> int:
  if isinstance(value, bool) or not isinstance(
      value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


# ------------------------------------------------------------ conversion


def _next_token_labels(seg, tokens, pad_id: int):
  """Labels (the next token of the same document, else ``pad_id``) and
  their mask."""
  mask = np.zeros(seg.shape, np.float32)
  mask[:, :-1] = (seg[:, :-1] != 0) & (seg[:, :-1] == seg[:, 1:])
  labels = np.full(tokens.shape, pad_id, tokens.dtype)
  labels[:, :-1] = np.where(mask[:, :-1] > 0, tokens[:, 1:], pad_id)
  return labels, mask


def _layout_row(row: int, starts, ends, ids, seq_len: int, multiple: int,
                overflow: str):
  """One row's documents placed in ``seq_len`` tokens: ``(src, lens,
  slot_starts)`` with ``src`` the input position of every output token (-1:
  padding), or ``None`` for ``src`` when no token moves."""
  doc = ids != 0
  s, e = starts[doc], ends[doc]
  lens = e - s
  t_in = int(ends[-1]) if ends.size else 0
  if (not s.size or s[0] == 0) and not (s % multiple).any() \
      and seq_len == t_in:
    return None, lens, s
  slots = -(-lens // multiple) * multiple
  dest = np.concatenate([[0], np.cumsum(slots)])
  if dest[-1] > seq_len:
    fits = int(np.searchsorted(dest, seq_len, side="right")) - 1
    if overflow == "raise":
      raise ValueError(
          f"row {row} does not fit in seq_len={seq_len} tokens once each "
          f"document is padded to a multiple of {multiple}: its "
          f"{s.size} documents (lengths {lens.tolist()}) need {dest[-1]} "
          f"tokens, {dest[-1] - seq_len} more. Pass overflow='truncate' to "
          "cut the row at seq_len, or a larger seq_len")
    # The first document that does not fit is cut where the row ends (its
    # slot: what is left, a multiple too); the documents after it are
    # dropped.
    keep = fits + (dest[fits] < seq_len)
    s, e, lens, dest = s[:keep], e[:keep], lens[:keep].copy(), dest[:keep + 1]
    lens[-1] = min(lens[-1], seq_len - dest[keep - 1])
    dest[-1] = seq_len
  src = np.full(seq_len, -1, np.int64)
  for a, n, d in zip(s, lens, dest[:-1]):
    src[d:d + n] = np.arange(a, a + n)
  return src, lens, dest[:-1]


def _with_tail_slot(lens, slots, seq_len: int, multiple: int):
  """A row's ``(lens, slot starts)`` with the padding after its last
  document's slot as one more, empty slot (a row without documents: one
  empty slot)."""
  end = int(slots[-1] + -(-lens[-1] // multiple) * multiple) if len(
      lens) else 0
  if end < seq_len:
    lens = np.append(lens, 0)
    slots = np.append(slots, end)
  return lens, slots


def rows_from_segment_ids(segment_ids, tokens, labels=None, *,
                          positions=None, loss_mask=None,
                          pad_multiple: int = 1,
                          seq_len: int | None = None,
                          max_docs: int | None = None,
                          padding: str = "trailing",
                          overflow: str = "raise",
                          pad_id: int = 0) -> PackedRows:
  """Packed rows in the segment-id convention as :class:`PackedRows`.

  Every document (one contiguous run of a non-zero id) becomes a slot of
  the metadata, in the order of the row; its padded slot is a multiple of
  ``pad_multiple`` and holds its valid tokens first. A row whose documents
  all start at multiples of ``pad_multiple``, the first at 0 (grain's
  ``pack_alignment_struct``, or documents whose lengths are multiples), is
  kept as it is, only its metadata built; the padding after a document
  belongs to its slot. Any other row is re-laid: each document is copied to
  the next multiple. Padding tokens and labels get ``pad_id``, loss mask 0.

  Args:
    segment_ids: int ``[B, T]``: 0 for padding, one non-zero id per
      document (MaxText's ``inputs_segmentation``, grain's
      ``<feature>_segment_ids``).
    tokens: ``[B, T]`` input tokens.
    labels: optional ``[B, T]`` targets at each token (MaxText's
      ``targets``), moved with their tokens; default: the next token of the
      same document, with the loss mask 0 on each document's last token (a
      document cut at the row's end by ``overflow="truncate"`` keeps its
      next token as the label of its last kept token, mask 1).
    positions: optional ``[B, T]`` positions (MaxText's
      ``inputs_position``, grain's ``<feature>_positions``): checked to
      restart at 0 at each document and step by 1.
    loss_mask: optional ``[B, T]`` 1 where ``labels`` is a target (e.g.
      ``targets_segmentation != 0``); default with ``labels``: the
      documents' tokens.
    pad_multiple: every padded slot is a multiple of it
      (:func:`jax_cp.data.pad_multiple_for` of the layout the rows are
      for).
    seq_len: tokens per output row (default ``T``), a multiple of
      ``pad_multiple``.
    max_docs: slots per row ``N`` (static), at least each row's documents
      and its empty tail slot; default: the most any row needs, rounded up
      to a multiple of 8 (as :func:`jax_cp.data.pack_documents`).
    padding: ``"trailing"``: padding only ends a row (MaxText); ``"between"``:
      padding may follow any document (grain with
      ``pack_alignment_struct``).
    overflow: what a re-laid row that does not fit in ``seq_len`` does:
      ``"raise"`` a ``ValueError`` naming the row and the shortfall, or
      ``"truncate"``: the first document that does not fit is cut where the
      row ends and the documents after it are dropped.
    pad_id: the token (and label) of padding positions of re-laid rows.

  Returns:
    A :class:`jax_cp.data.PackedRows` of ``seq_len`` tokens per row: int32
    ``tokens``, ``labels``, ``position_ids``, float32 ``loss_mask``, and
    the metadata: one slot per document, in the row's order, then one empty
    slot for the padding after the last document's slot, if any (a row
    without documents: one empty slot).

  Raises:
    ValueError: arrays of other shapes, ids not integers, a document split
      into two runs, a document after padding with ``padding="trailing"``,
      positions that do not restart at 0 or step by 1 (each naming the row
      and position), a row that does not fit (``overflow="raise"``), a row
      with more than ``max_docs`` documents, or a bad argument.
  """
  _check_choice(padding, "padding", PADDING)
  _check_choice(overflow, "overflow", OVERFLOW)
  multiple = _check_positive_int(pad_multiple, "pad_multiple")
  arrays = check_segment_arrays(segment_ids, tokens=tokens, labels=labels,
                                positions=positions, loss_mask=loss_mask)
  seg, tok = arrays["segment_ids"], arrays["tokens"]
  b, t_in = seg.shape
  seq_len = t_in if seq_len is None else _check_positive_int(seq_len,
                                                             "seq_len")
  if seq_len % multiple:
    raise ValueError(f"seq_len={seq_len} must be a multiple of "
                     f"pad_multiple={multiple}")
  runs = [_runs(row) for row in seg]
  for r, (starts, ends, ids) in enumerate(runs):
    check_row_documents(r, starts, ends, ids, padding)
  if positions is not None:
    check_positions(seg, arrays["positions"])
  if labels is None:
    lab, mask = _next_token_labels(seg, tok, pad_id)
    if loss_mask is not None:
      mask = mask * arrays["loss_mask"]
  else:
    lab = arrays["labels"]
    mask = (seg != 0) if loss_mask is None else arrays["loss_mask"]
  per_token = {"tokens": tok, "labels": lab, "loss_mask": mask}
  out = {"tokens": np.full((b, seq_len), pad_id, np.int32),
         "labels": np.full((b, seq_len), pad_id, np.int32),
         "loss_mask": np.zeros((b, seq_len), np.float32)}
  placed = []
  for r, (starts, ends, ids) in enumerate(runs):
    src, lens, slots = _layout_row(r, starts, ends, ids, seq_len, multiple,
                                   overflow)
    for name, x in per_token.items():
      if src is None:
        out[name][r] = x[r]
      else:
        valid = src >= 0
        out[name][r, valid] = x[r, src[valid]]
    if src is None:   # kept in place: padding as in re-laid rows
      pad = seg[r] == 0
      out["tokens"][r, pad] = out["labels"][r, pad] = pad_id
      out["loss_mask"][r, pad] = 0.0
    placed.append(_with_tail_slot(lens, slots, seq_len, multiple))
  n = max(len(lens) for lens, _ in placed)
  if max_docs is None:
    max_docs = -(-n // 8) * 8
  elif _check_positive_int(max_docs, "max_docs") < n:
    r = next(i for i, (lens, _) in enumerate(placed) if len(lens) == n)
    raise ValueError(f"max_docs={max_docs} < {n} slots in row {r} (its "
                     "documents, and its padding after them)")
  cu = np.zeros((b, max_docs + 1), np.int32)
  cu_p = np.full((b, max_docs + 1), seq_len, np.int32)
  cu_p[:, 0] = 0
  for r, (lens, slots) in enumerate(placed):
    k = len(lens)
    cu[r, 1:k + 1] = np.cumsum(lens)
    cu[r, k + 1:] = cu[r, k]
    cu_p[r, 1:k] = slots[1:]
  return PackedRows(tokens=out["tokens"], labels=out["labels"],
                    loss_mask=out["loss_mask"],
                    position_ids=np.asarray(get_position_ids(cu_p), np.int32),
                    cu_seqlens=cu, cu_seqlens_padded=cu_p)


# --------------------------------------------------------------- inverse


def segment_index(segment_ids, cu_seqlens, cu_seqlens_padded) -> np.ndarray:
  """Where each token of the segment-id rows is in the packed rows.

  Args:
    segment_ids: the int ``[B, T]`` given to :func:`rows_from_segment_ids`.
    cu_seqlens, cu_seqlens_padded: the ``[B, N+1]`` metadata it returned.

  Returns:
    int32 ``[B, T]``: the packed row's token index of each document token,
    -1 on padding and on tokens a ``"truncate"`` overflow dropped.
  """
  seg = check_segment_arrays(segment_ids)["segment_ids"]
  cu, cu_p = np.asarray(cu_seqlens), np.asarray(cu_seqlens_padded)
  if cu.shape != cu_p.shape or cu.ndim != 2 or cu.shape[0] != seg.shape[0]:
    raise ValueError(f"cu_seqlens {cu.shape} and cu_seqlens_padded "
                     f"{cu_p.shape} must both be [B, N+1] with B = "
                     f"{seg.shape[0]} rows of segment_ids")
  index = np.full(seg.shape, -1, np.int32)
  for r in range(seg.shape[0]):
    starts, ends, ids = _runs(seg[r])
    doc = np.flatnonzero(ids != 0)
    kept = np.diff(cu[r])
    for k, run in enumerate(doc[:kept.size]):
      n = int(min(kept[k], ends[run] - starts[run]))
      index[r, starts[run]:starts[run] + n] = cu_p[r, k] + np.arange(n)
  return index


def to_segment_layout(x, segment_ids, rows: PackedRows | tuple, *,
                      fill: Any = 0):
  """Per-token values of the packed rows back in the segment-id layout.

  Args:
    x: ``[B, T_rows, ...]`` values of the rows of ``rows`` (logits, per-token
      losses), numpy or JAX, in physical order (outputs in a CP layout go
      through :func:`jax_cp.data.restore_from_cp` first).
    segment_ids: the int ``[B, T]`` the rows were built from.
    rows: the :class:`PackedRows` :func:`rows_from_segment_ids` returned, or
      its ``(cu_seqlens, cu_seqlens_padded)``.
    fill: the value at padding positions (and at tokens a ``"truncate"``
      overflow dropped).

  Returns:
    ``[B, T, ...]``, numpy for numpy ``x``, JAX otherwise (the index is
    built on the host, so this also runs inside ``jit`` for concrete
    ``segment_ids`` and metadata).
  """
  cu, cu_p = ((rows.cu_seqlens, rows.cu_seqlens_padded)
              if isinstance(rows, PackedRows) else rows)
  index = segment_index(segment_ids, cu, cu_p)
  if np.shape(x)[:1] != index.shape[:1] or np.ndim(x) < 2:
    raise ValueError(f"x has shape {np.shape(x)}: it needs the "
                     f"{index.shape[0]} rows [B, T_rows, ...] of the packed "
                     "rows")
  xp = np if isinstance(x, np.ndarray) else jnp
  valid = index >= 0
  idx = np.where(valid, index, 0).reshape(index.shape + (1,) * (x.ndim - 2))
  got = xp.take_along_axis(x, xp.asarray(idx), axis=1)
  mask = valid.reshape(idx.shape)
  return xp.where(xp.asarray(mask), got, xp.asarray(fill, dtype=got.dtype))


def from_segment_layout(x, segment_ids, rows: PackedRows | tuple, *,
                        seq_len: int | None = None, fill: Any = 0):
  """Per-token values of a segment-id batch in the packed rows' layout: the
  inverse of :func:`to_segment_layout`, for the features
  :func:`rows_from_segment_ids` does not carry itself (per-token floats,
  embeddings, weights).

  Args:
    x: ``[B, T, ...]`` values at each token of the segment-id rows, numpy
      or JAX.
    segment_ids: the int ``[B, T]`` the rows were built from.
    rows: the :class:`PackedRows` :func:`rows_from_segment_ids` returned, or
      its ``(cu_seqlens, cu_seqlens_padded)``.
    seq_len: the packed rows' tokens (default: ``rows.seq_len``, or the
      metadata's ``cu_seqlens_padded[..., -1]``).
    fill: the value at the packed rows' padding positions.

  Returns:
    ``[B, seq_len, ...]`` in physical order (put it in a CP layout with
    :func:`jax_cp.data.make_global_batch` or
    :func:`jax_cp.data.reorder_for_cp`), numpy for numpy ``x``, JAX
    otherwise (the index is built on the host).
  """
  cu, cu_p = ((rows.cu_seqlens, rows.cu_seqlens_padded)
              if isinstance(rows, PackedRows) else rows)
  index = segment_index(segment_ids, cu, cu_p)
  if tuple(np.shape(x)[:2]) != index.shape:
    raise ValueError(f"x has shape {np.shape(x)}: it needs the tokens of "
                     f"segment_ids, [B, T, ...] = {index.shape} + ...")
  if seq_len is None:
    seq_len = int(np.asarray(cu_p).reshape(-1, np.shape(cu_p)[-1])[0, -1])
  xp = np if isinstance(x, np.ndarray) else jnp
  # The packed position of every token that has one; the others go to a
  # scratch column past the row, dropped afterwards.
  dest = np.where(index >= 0, index, seq_len)
  shape = (index.shape[0], seq_len + 1) + tuple(np.shape(x)[2:])
  rows_idx = np.broadcast_to(np.arange(index.shape[0])[:, None], index.shape)
  if xp is np:
    out = np.full(shape, fill, dtype=np.asarray(x).dtype)
    out[rows_idx, dest] = x
  else:
    out = jnp.full(shape, fill, dtype=x.dtype).at[rows_idx, dest].set(x)
  return out[:, :seq_len]


# ------------------------------------------------------------- on device


def _check_aligned_rows(seg: np.ndarray, max_docs: int, multiple: int):
  """The preconditions of :func:`cu_seqlens_from_segment_ids` on concrete
  ids: contiguous runs, every document starting at a multiple of
  ``multiple``, and at most ``max_docs`` slots per row.

  Raises:
    ValueError: naming the row, the position and the rule broken.
  """
  for r, row in enumerate(seg):
    starts, ends, ids = _runs(row)
    check_row_documents(r, starts, ends, ids, "between")
    doc = ids != 0
    bad = starts[doc][starts[doc] % multiple != 0]
    if bad.size:
      raise ValueError(
          f"row {r}: a document starts at position {int(bad[0])}, not a "
          f"multiple of pad_multiple={multiple}; cu_seqlens_from_segment_ids"
          " takes aligned rows (grain's pack_alignment_struct), "
          "rows_from_segment_ids re-lays any other")
    slots = int(doc.sum()) + int(not doc[:1].all())
    end = int(ends[doc][-1]) if doc.any() else 0
    slots += int(-(-end // multiple) * multiple < row.size and doc.any())
    if slots > max_docs:
      raise ValueError(
          f"row {r} needs {slots} slots (its {int(doc.sum())} documents, "
          f"its leading and trailing padding), more than max_docs="
          f"{max_docs}")


def cu_seqlens_from_segment_ids(segment_ids, max_docs: int,
                                pad_multiple: int = 1):
  """``(cu_seqlens, cu_seqlens_padded)`` of aligned rows, jittable.

  For rows already on the device whose documents each start at a multiple
  of ``pad_multiple`` (grain's ``pack_alignment_struct``): the metadata
  that keep their tokens in place. Document ``d``'s padded slot runs from
  its start to the next document's; the last one's to the next multiple
  of ``pad_multiple``, and the rest of the row is an empty slot; padding
  before a row's first document is an empty slot too. Rows whose first
  document starts at 0 get the metadata :func:`rows_from_segment_ids`
  builds for them.

  Concrete ids (numpy, or JAX arrays outside a trace) are checked:
  contiguous runs, aligned documents, at most ``max_docs`` slots, each
  broken rule a ``ValueError``. Traced ids cannot be: a row with more
  documents than ``max_docs`` slots (grain's ``max_sequences_per_bin``,
  plus one each for the leading and trailing padding) counts the
  documents past them as padding of its last slot.

  Args:
    segment_ids: int ``[B, T]`` (or ``[T]``), 0 for padding.
    max_docs: slots per row ``N`` (static).
    pad_multiple: the alignment of the documents (static; as
      :func:`jax_cp.data.pad_multiple_for`).

  Returns:
    int32 ``[B, N+1]`` (or ``[N+1]``) ``cu_seqlens`` and
    ``cu_seqlens_padded``.
  """
  max_docs = _check_positive_int(max_docs, "max_docs")
  multiple = _check_positive_int(pad_multiple, "pad_multiple")
  seg = jnp.asarray(segment_ids)
  if not jnp.issubdtype(seg.dtype, jnp.integer):
    raise ValueError(f"segment_ids must hold integers, got dtype {seg.dtype}")
  if seg.ndim == 1:
    cu, cu_p = cu_seqlens_from_segment_ids(seg[None], max_docs, multiple)
    return cu[0], cu_p[0]
  if seg.ndim != 2:
    raise ValueError(f"segment_ids must be [B, T] or [T], got {seg.shape}")
  host = concrete(segment_ids)
  if host is not None:
    _check_aligned_rows(host.reshape(seg.shape), max_docs, multiple)
  t = seg.shape[1]
  pos = jnp.arange(t)
  valid = seg != 0
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
  last_end = jnp.max(jnp.where(valid, pos + 1, 0), axis=1, keepdims=True)
  tail = -(-last_end // multiple) * multiple   # the empty slot's start
  # A slot starts with each document, at the trailing padding, and at 0
  # (padding before the first document is an empty slot of its own).
  start = (valid & (seg != prev)) | (pos == tail) | (pos == 0)
  slot = jnp.cumsum(start, axis=1) - 1

  def one_row(start_r, slot_r, valid_r):
    starts = jnp.nonzero(start_r, size=max_docs, fill_value=t)[0]
    lens = jax.ops.segment_sum(valid_r.astype(jnp.int32),
                               jnp.where(valid_r, slot_r, max_docs),
                               num_segments=max_docs + 1)[:max_docs]
    cu_p = jnp.concatenate([starts, jnp.full(1, t, starts.dtype)])
    cu = jnp.concatenate([jnp.zeros(1, lens.dtype), jnp.cumsum(lens)])
    return cu.astype(jnp.int32), cu_p.astype(jnp.int32)

  return jax.vmap(one_row)(start, slot, valid)


__all__ = ("check_positions", "check_row_documents", "check_segment_arrays",
           "cu_seqlens_from_segment_ids", "from_segment_layout",
           "rows_from_segment_ids", "segment_index", "to_segment_layout")
