"""Data for CP: packed rows, their metadata, and where each token lives
(docs/data.md).

* Rows: :class:`PackedRows` from documents (:func:`pack_documents`, or
  batch after batch with :class:`DocumentPacker`; :func:`default_max_docs`
  slots per row) or from a segment-id batch (:func:`rows_from_segment_ids`,
  MaxText's and grain's convention), padded for a layout
  (:func:`pad_multiple_for`), their documents reordered for
  NO_LOAD_BALANCE (:func:`balance_rows`).
* Global batches: :func:`make_global_batch` (this process's rows into
  global arrays in the layout, a :class:`jax_cp.CPBatch`),
  :func:`process_batch_rows`, :func:`make_global_metadata`; several
  processes: :func:`init_distributed`, :func:`make_cp_mesh` (each cp group
  inside a host).
* The layout's token order: :func:`get_batch_on_this_cp_rank`,
  :func:`get_partition_indices`, :func:`reorder_for_cp`,
  :func:`restore_from_cp`, :func:`get_position_ids`,
  :func:`longest_padded_document`.
* Back and forth with the segment-id layout: :func:`to_segment_layout`,
  :func:`from_segment_layout`, :func:`segment_index`, and
  :func:`cu_seqlens_from_segment_ids` for aligned rows on the device.
"""

from jax_cp.cp.partition import (
    get_batch_on_this_cp_rank,
    get_partition_indices,
    get_position_ids,
    longest_padded_document,
    reorder_for_cp,
    restore_from_cp,
)
from jax_cp.data.batch import (
    make_global_batch,
    make_global_metadata,
    process_batch_rows,
)
from jax_cp.data.multihost import init_distributed, make_cp_mesh
from jax_cp.data.packing import (
    DocumentPacker,
    PackedRows,
    balance_rows,
    default_max_docs,
    pack_documents,
    pad_multiple_for,
)
from jax_cp.data.segment_ids import (
    cu_seqlens_from_segment_ids,
    from_segment_layout,
    rows_from_segment_ids,
    segment_index,
    to_segment_layout,
)

__all__ = [
    "DocumentPacker",
    "PackedRows",
    "balance_rows",
    "cu_seqlens_from_segment_ids",
    "default_max_docs",
    "from_segment_layout",
    "get_batch_on_this_cp_rank",
    "get_partition_indices",
    "get_position_ids",
    "init_distributed",
    "longest_padded_document",
    "make_global_batch",
    "make_cp_mesh",
    "make_global_metadata",
    "pack_documents",
    "pad_multiple_for",
    "process_batch_rows",
    "reorder_for_cp",
    "restore_from_cp",
    "rows_from_segment_ids",
    "segment_index",
    "to_segment_layout",
]
