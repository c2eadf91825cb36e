"""The data: the Python standard library's own ``.py`` files as bytes (real
text of very different lengths that every installation has; nothing is
downloaded), packed into rows by :func:`jax_cp.pack_documents`, and the
batches built ahead on a host thread."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import pathlib
import sysconfig
from collections.abc import Callable, Iterable, Iterator

import numpy as np

import jax_cp
from examples.packed_lm.config import Config


def iter_documents(seed: int = 0, max_doc_len: int | None = None
                   ) -> Iterator[np.ndarray]:
  """Endless stream of documents (uint8): the stdlib's ``.py`` files (not
  site-packages) in an order shuffled with ``seed + epoch``, each cut to
  ``max_doc_len`` bytes, empty ones skipped: every run sees the same data.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if not {
      "site-packages", "dist-packages"} & set(p.relative_to(root).parts))
  if not files:
    raise RuntimeError(f"no .py files found under {root}")
  for epoch in itertools.count():
    for i in np.random.default_rng(seed + epoch).permutation(len(files)):
      if doc := files[i].read_bytes()[:max_doc_len]:
        yield np.frombuffer(doc, dtype=np.uint8)


def load_rows(cfg: Config, num_rows: int, cp: int) -> jax_cp.PackedRows:
  """``num_rows`` rows of ``cfg.seq_len`` bytes padded for the strategy on
  ``cp`` ranks, in ``cfg.doc_order`` (:func:`jax_cp.balance_rows`). Row
  ``i`` does not depend on ``num_rows``: a resumed run sees the batches it
  has not seen. Byte 0 (the padding) never occurs in Python source."""
  rows = jax_cp.pack_documents(
      iter_documents(cfg.seed, cfg.max_doc_len), cfg.seq_len, num_rows,
      jax_cp.pad_multiple_for(cfg.strategy, cp))
  if cfg.doc_order == "balanced":
    rows = jax_cp.balance_rows(rows, cp, cfg.strategy)
  return rows


def place_batch(rows: jax_cp.PackedRows, layout: jax_cp.CPLayout,
                local=None) -> jax_cp.CPBatch:
  """The global batch of ``rows`` in ``layout`` from this process's rows
  ``rows[local]`` (:func:`jax_cp.process_batch_rows`; ``None``: all). Each
  device gets only its tokens; the metadata are global arrays too."""
  mine = rows if local is None else rows[local]
  return jax_cp.make_global_batch(
      mine.tensors, mine.cu_seqlens_padded, layout,
      cu_seqlens=mine.cu_seqlens, global_batch_size=rows.num_rows)


def prefetched(make: Callable[[int], object], steps: Iterable[int],
               depth: int) -> Iterator:
  """``make(step)`` for each of ``steps`` in order, up to ``depth`` of them
  built ahead on a host thread (``0``: in the loop); the same batches."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    ahead = collections.deque()
    for step in steps:
      ahead.append(pool.submit(make, step))
      if len(ahead) > depth:
        yield ahead.popleft().result()
    while ahead:
      yield ahead.popleft().result()
