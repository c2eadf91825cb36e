"""The data: the standard library's ``.py`` files as bytes (real text of
very different lengths, no download), streamed by one grain pipeline per
batch shard.

Each pipeline: the files shuffled per epoch (seed + epoch), every
``num_shards``-th taken for this shard, read and cut to ``max_doc_len``
bytes; grain's ``FirstFitPackIterDataset`` packs them into rows, every
document starting at a multiple of the layout's padding
(``pack_alignment_struct``); the rows of a step are batched and converted
to :class:`jax_cp.data.PackedRows` by
:func:`jax_cp.data.rows_from_segment_ids` (no token moves: the rows are
already aligned), balanced for NO_LOAD_BALANCE, and built ahead by grain's
thread prefetch. Nothing is read before it is needed beyond the prefetch
depth, and the iterators' state
(:meth:`Batches.get_state`) resumes the stream exactly.

The batch shards (``dp``) define the data, not the processes: a process
runs the pipelines of the batch shards its devices hold
(:func:`jax_cp.data.process_batch_rows`), so every process count reads the same
rows.
"""

from __future__ import annotations

import functools
import itertools
import pathlib
import sysconfig
from collections.abc import Iterator

import grain
import numpy as np
from grain import experimental as grain_exp

import jax_cp
from examples.packed_lm.config import Config

# Document slots per row (static); files shorter than seq_len / MAX_DOCS
# bytes are skipped, so that a row holds fewer than MAX_DOCS documents and
# one slot is left for its padding.
MAX_DOCS = 64


def stdlib_files() -> list[pathlib.Path]:
  """The stdlib's ``.py`` files (no site-packages), sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if not {
      "site-packages", "dist-packages"} & set(p.relative_to(root).parts))
  if not files:
    raise RuntimeError(f"no .py files found under {root}")
  return files


def _read(path: pathlib.Path, max_doc_len: int, min_doc_len: int):
  """A document ``{"tokens": uint8 bytes}``, or None (grain drops it)."""
  doc = path.read_bytes()[:max_doc_len]
  if len(doc) < min_doc_len:
    return None
  return {"tokens": np.frombuffer(doc, dtype=np.uint8)}


def documents(cfg: Config, shard: int = 0, num_shards: int = 1,
              files: list | None = None) -> grain.MapDataset:
  """Endless documents of one batch shard: the files shuffled with
  ``cfg.seed + epoch``, every ``num_shards``-th from ``shard`` on."""
  files = stdlib_files() if files is None else files
  ds = grain.MapDataset.source(files).shuffle(seed=cfg.seed).repeat()
  read = functools.partial(_read, max_doc_len=cfg.max_doc_len,
                           min_doc_len=cfg.seq_len // MAX_DOCS + 1)
  return ds[shard::num_shards].map(read)


def host_layout(cfg: Config, cp: int) -> jax_cp.CPLayout:
  """The layout of the rows for ``cp`` ranks, for the host-side packing
  (no mesh: the cp size and the strategy)."""
  return jax_cp.CPLayout(cp_size=cp, strategy=cfg.strategy)


def _to_rows(batch: dict, cfg: Config, cp: int, multiple: int
             ) -> jax_cp.data.PackedRows:
  rows = jax_cp.data.rows_from_segment_ids(
      batch["tokens_segment_ids"], batch["tokens"],
      positions=batch["tokens_positions"], pad_multiple=multiple,
      max_docs=MAX_DOCS, padding="between")
  if cfg.doc_order == "balanced":
    rows = jax_cp.data.balance_rows(rows, host_layout(cfg, cp))
  return rows


def shard_pipeline(cfg: Config, cp: int, rows: int, shard: int = 0,
                   num_shards: int = 1, workers: int = 0,
                   files: list | None = None) -> grain.IterDataset:
  """Batches of ``rows`` packed rows (:class:`jax_cp.data.PackedRows`) of one
  batch shard, padded for the strategy on ``cp`` ranks; ``workers > 0``
  packs in that many grain worker processes."""
  multiple = jax_cp.data.pad_multiple_for(host_layout(cfg, cp))
  docs = documents(cfg, shard, num_shards, files).to_iter_dataset(
      grain.ReadOptions(num_threads=4, prefetch_buffer_size=64))
  packed = grain_exp.FirstFitPackIterDataset(
      docs, length_struct={"tokens": cfg.seq_len},
      num_packing_bins=max(rows, 4), shuffle_bins=False,
      pack_alignment_struct={"tokens": multiple})
  ds = packed.batch(rows).map(functools.partial(
      _to_rows, cfg=cfg, cp=cp, multiple=multiple))
  if workers > 0:
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return grain_exp.ThreadPrefetchIterDataset(
      ds, prefetch_buffer_size=max(cfg.prefetch, 1))


class Batches:
  """This process's rows of each step: the rows of the batch shards its
  devices hold (``shards`` of ``num_shards``, ``cfg.batch / num_shards``
  rows each), in global row order; an iterator with a checkpointable
  state."""

  def __init__(self, cfg: Config, cp: int, shards, num_shards: int):
    if cfg.batch % num_shards:
      raise ValueError(f"batch={cfg.batch} is not divisible by the "
                       f"{num_shards} batch shards")
    self.shards = [int(s) for s in shards]
    self._iters = {s: iter(shard_pipeline(
        cfg, cp, cfg.batch // num_shards, s, num_shards))
                   for s in self.shards}

  def __iter__(self):
    return self

  def __next__(self) -> jax_cp.data.PackedRows:
    parts = [next(self._iters[s]) for s in self.shards]
    if len(parts) == 1:
      return parts[0]
    return jax_cp.data.PackedRows(**{
        k: np.concatenate([getattr(p, k) for p in parts])
        for k in ("tokens", "labels", "loss_mask", "position_ids",
                  "cu_seqlens", "cu_seqlens_padded")})

  def get_state(self) -> dict:
    """The state of each shard's iterator after the rows it returned."""
    return {str(s): it.get_state() for s, it in self._iters.items()}

  def set_state(self, state: dict) -> None:
    """Resumes every shard held here from ``state`` (of any process
    count: shards are keyed by index)."""
    for s, it in self._iters.items():
      it.set_state(state[str(s)])

  def close(self) -> None:
    for it in self._iters.values():
      it.close()


def held_shards(local_rows: np.ndarray, batch: int, num_shards: int):
  """The batch shards of :func:`jax_cp.process_batch_rows`'s rows."""
  return sorted({int(r) // (batch // num_shards) for r in local_rows})


def place_batch(rows: jax_cp.data.PackedRows, layout: jax_cp.CPLayout,
                local=None, *, global_batch: int | None = None
                ) -> jax_cp.CPBatch:
  """The global batch from this process's rows: ``rows[local]`` of all
  the rows, or ``rows`` themselves (``local=None``) of a batch of
  ``global_batch`` rows (default: ``rows.num_rows``)."""
  mine = rows if local is None else rows[local]
  return jax_cp.data.make_global_batch(
      mine.tensors, mine.cu_seqlens_padded, layout,
      cu_seqlens=mine.cu_seqlens,
      global_batch_size=global_batch or rows.num_rows)


# ------------------------------------------- rows built at once (no grain)


def iter_documents(seed: int = 0, max_doc_len: int | None = None
                   ) -> Iterator[np.ndarray]:
  """Endless uint8 documents: the stdlib's ``.py`` files, shuffled with
  ``seed + epoch``, cut to ``max_doc_len`` bytes (the benchmarks' data)."""
  files = stdlib_files()
  for epoch in itertools.count():
    for i in np.random.default_rng(seed + epoch).permutation(len(files)):
      if doc := files[i].read_bytes()[:max_doc_len]:
        yield np.frombuffer(doc, dtype=np.uint8)


def load_rows(cfg: Config, num_rows: int, cp: int) -> jax_cp.data.PackedRows:
  """``num_rows`` rows of :func:`iter_documents` packed by
  :func:`jax_cp.data.pack_documents` for the strategy on ``cp`` ranks, in
  ``cfg.doc_order``, all at once: the fixed batch of the benchmarks (the
  training run streams with :class:`Batches`), with the fewest document
  slots its rows need (``max_docs="fit"``)."""
  rows = jax_cp.data.pack_documents(
      iter_documents(cfg.seed, cfg.max_doc_len), cfg.seq_len, num_rows,
      jax_cp.data.pad_multiple_for(host_layout(cfg, cp)), max_docs="fit")
  if cfg.doc_order == "balanced":
    rows = jax_cp.data.balance_rows(rows, host_layout(cfg, cp))
  return rows
