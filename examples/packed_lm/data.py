"""The data: the standard library's ``.py`` files as bytes (real text of
very different lengths, no download), packed by :func:`jax_cp.pack_documents`.
"""

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
  """Endless uint8 documents: the stdlib's ``.py`` files (no site-packages),
  shuffled with ``seed + epoch``, cut to ``max_doc_len`` bytes."""
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
  """``num_rows`` rows padded for the strategy on ``cp`` ranks, in
  ``cfg.doc_order``; row ``i`` does not depend on ``num_rows``."""
  rows = jax_cp.pack_documents(
      iter_documents(cfg.seed, cfg.max_doc_len), cfg.seq_len, num_rows,
      jax_cp.pad_multiple_for(cfg.strategy, cp))
  if cfg.doc_order == "balanced":
    rows = jax_cp.balance_rows(rows, cp, cfg.strategy)
  return rows


def place_batch(rows: jax_cp.PackedRows, layout: jax_cp.CPLayout,
                local=None) -> jax_cp.CPBatch:
  """The global batch of ``rows`` from this process's ``rows[local]``."""
  mine = rows if local is None else rows[local]
  return jax_cp.make_global_batch(
      mine.tensors, mine.cu_seqlens_padded, layout,
      cu_seqlens=mine.cu_seqlens, global_batch_size=rows.num_rows)


def prefetched(make: Callable[[int], object], steps: Iterable[int],
               depth: int) -> Iterator:
  """``make(step)`` of each step, ``depth`` built ahead on a thread."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    ahead = collections.deque()
    for step in steps:
      ahead.append(pool.submit(make, step))
      if len(ahead) > depth:
        yield ahead.popleft().result()
    while ahead:
      yield ahead.popleft().result()
