"""Document order inside a packed row, chosen to balance NO_LOAD_BALANCE.

NO_LOAD_BALANCE cuts a row into ``cp`` contiguous chunks of ``T/cp``
tokens, so a rank's attention work depends on which documents land in its
chunk. With a sliding window, or with short documents, no document is much
heavier per token than another, yet a row of a few dozen documents drawn
at random still leaves one chunk with a few percent more (query, key)
pairs than the mean, and the step waits for that rank. The order of
documents in a packed row is free (they do not attend to each other), so
the data loader can pick an order whose chunks hold near-equal work:

* :func:`balance_document_order` searches that order, per row, on the
  host: pairwise swaps of documents, each round taking the swap that
  lowers the busiest rank's pairs most, until no swap helps (work counted
  as :func:`jax_cp.planning.estimate_cp_imbalance` counts it, window
  included);
* :func:`permute_documents` applies an order to the metadata and to every
  per-token array of the row (tokens, labels, loss mask, positions), so a
  document's tokens stay together and in order.

DUAL_CHUNK_SWAP cuts every document into ``2*cp`` chunks and gives each
rank its share of every document, so the order changes no rank's work:
:func:`balance_document_order` returns the identity for it.

Everything here is numpy on the host, for the data loader.
"""

from __future__ import annotations

import numpy as np

from jax_cp.attention.validation import check_window_size
from jax_cp.cp import validation
from jax_cp.cp.layout import CPLayout
from jax_cp.cp.strategies import strategy_for
from jax_cp.planning.host import as_int_rows, host_metadata, resolve_layout
from jax_cp.planning.pairs import range_pairs
from jax_cp.typing import ArrayLike, WindowSize

# Swaps scored in one round are capped at this many boundary evaluations
# (``swaps * (cp + 1)``); a row with more swaps scores a seeded sample,
# drawn by index (host memory O(N), not O(N^2)). The cap bounds a round's
# host time on rows of many documents; a row with fewer swaps scores them
# all.
_SCORE_POINTS = 1 << 17


class _Prefix:
  """The work before each token boundary of a row in one order.

  ``work(x)`` is the number of (query, key) pairs of the valid tokens in
  ``[0, x)``: the whole documents that end at or before ``x`` plus the
  first ``x - start`` tokens of the one ``x`` falls in. A rank's pairs are
  ``work(hi) - work(lo)`` of its chunk.
  """

  def __init__(self, lens, plens, left: int):
    self.lens, self.plens, self.left = lens, plens, left
    self.ends = np.cumsum(plens)
    self.starts = self.ends - plens
    self.full = range_pairs(0, lens, left)
    self.before = np.concatenate([[0], np.cumsum(self.full)])  # [N+1]

  def part(self, lens, t):
    """Pairs of the first ``t`` tokens of documents of ``lens``."""
    return range_pairs(0, np.clip(t, 0, lens), self.left)

  def work(self, x):
    x = np.asarray(x, np.int64)
    k = np.searchsorted(self.ends, x, side="right")   # the slot x is in
    inside = k < len(self.ends)
    kk = np.minimum(k, len(self.ends) - 1)
    partial = np.where(inside, self.part(self.lens[kk],
                                         x - self.starts[kk]), 0)
    return self.before[k] + partial


def _swap_rank_pairs(pre: _Prefix, i, j, bounds) -> np.ndarray:
  """Pairs per rank ``[K, cp]`` after swapping the documents in slots
  ``i[k] < j[k]`` (``bounds``: the ``cp + 1`` chunk boundaries).

  After the swap, ``[0, S_i)`` and ``[E_j, T)`` hold what they held, slot
  ``i`` holds document ``B`` (was at ``j``), the slots between shift by
  ``pB - pA`` and ``A`` ends at ``E_j``. So ``work`` at a boundary ``x`` is
  the old one outside ``[S_i, E_j)``; inside it is ``before[i]`` plus, in
  turn, part of ``B``, all of ``B`` and the old work of the shifted slots
  (read at ``x - shift``), or all of those and part of ``A``.
  """
  x = bounds[None, :]                                        # [1, cp+1]
  i, j = i[:, None], j[:, None]                              # [K, 1]
  si, ej = pre.starts[i], pre.ends[j]
  pa, pb = pre.plens[i], pre.plens[j]
  b_end, a_start = si + pb, ej - pa
  base = pre.before[i]
  mid = pre.before[j] - pre.before[i + 1]                    # slots i+1..j-1
  in_b = base + pre.part(pre.lens[j], x - si)
  in_mid = base + pre.full[j] + pre.work(x - (pb - pa)) - pre.before[i + 1]
  in_a = base + pre.full[j] + mid + pre.part(pre.lens[i], x - a_start)
  w = np.where(x <= b_end, in_b, np.where(x <= a_start, in_mid, in_a))
  w = np.where((x <= si) | (x >= ej), pre.work(x), w)
  return np.diff(w, axis=1)


def _best(pairs: np.ndarray) -> tuple[int, tuple[int, float]]:
  """The best of ``K`` candidates ``[K, cp]``: the lowest busiest rank,
  then the lowest sum of squares over ranks (so a swap that evens out the
  other ranks still counts at ``cp > 2``). Returns its index and key."""
  mx = pairs.max(axis=1)
  spread = (pairs.astype(np.float64) ** 2).sum(axis=1)
  k = int(np.lexsort((spread, mx))[0])
  return k, (int(mx[k]), float(spread[k]))


class _Pairs:
  """The pairs ``i < j`` of ``m`` items in ``np.triu_indices(m, k=1)``
  order, by index, without building them: pair ``k`` is in row ``i`` with
  ``first[i] <= k < first[i + 1]`` (``first``: ``O(m)``)."""

  def __init__(self, m: int):
    self.m = m
    self.first = np.concatenate(
        [[0], np.cumsum(np.arange(m - 1, 0, -1, dtype=np.int64))])
    self.count = int(self.first[-1])

  def __getitem__(self, k):
    k = np.asarray(k, np.int64)
    i = np.searchsorted(self.first, k, side="right") - 1
    return i, k - self.first[i] + i + 1

  def all(self):
    return self[np.arange(self.count, dtype=np.int64)]


def _balance_row(lens, plens, cp: int, left: int, max_rounds: int,
                 tolerance: float, rng: np.random.Generator) -> np.ndarray:
  n = lens.shape[0]
  order = np.arange(n)
  movable = np.flatnonzero(plens > 0)     # empty slots stay where they are
  if movable.size < 2:
    return order
  swaps = _Pairs(movable.size)
  cap = max(1, _SCORE_POINTS // (cp + 1))
  exhaustive = swaps.count <= cap
  if exhaustive:
    i_all, j_all = (movable[x] for x in swaps.all())
  bounds = np.arange(cp + 1, dtype=np.int64) * (int(plens.sum()) // cp)
  pre = _Prefix(lens, plens, left)
  pairs = np.diff(pre.work(bounds))
  mean = pairs.sum() / cp
  _, best = _best(pairs[None])
  for _ in range(max_rounds):
    if best[0] <= mean * (1.0 + tolerance):
      break                               # balanced enough
    if exhaustive:
      i, j = i_all, j_all
    else:   # a sample of the swaps, drawn by index: O(cap) memory
      i, j = (movable[x] for x in swaps[np.sort(
          rng.choice(swaps.count, cap, replace=False))])
    k, key = _best(_swap_rank_pairs(pre, i, j, bounds))
    if key >= best:
      if exhaustive:
        break                             # no swap helps: a local optimum
      continue
    order[[i[k], j[k]]] = order[[j[k], i[k]]]
    best = key
    pre = _Prefix(lens[order], plens[order], left)
  return order


def balance_document_order(cu_seqlens: ArrayLike,
                           cu_seqlens_padded: ArrayLike, layout: CPLayout,
                           *, window_size: WindowSize = None,
                           max_rounds: int = 64,
                           tolerance: float = 1e-3,
                           seed: int = 0) -> np.ndarray:
  """An order of each row's documents that balances NO_LOAD_BALANCE's work.

  The work of a rank is the (query, key) pairs of the valid tokens in its
  contiguous chunk, counted per document and causal (with a sliding window
  ``(left, 0)`` a query sees at most ``left + 1`` keys), exactly as
  :func:`jax_cp.planning.estimate_cp_imbalance` counts it. Starting from the
  row's own order, each round scores every swap of two documents (a
  seeded sample of them when a row has too many documents to score all at
  once) and applies the one that lowers the busiest rank's pairs most
  (ties: the one that evens out all ranks most). It stops when the
  busiest rank is within ``tolerance`` of the mean, when no swap helps,
  or after ``max_rounds`` rounds, so the result is never worse than the
  row's own order. Empty document slots (padded length 0) stay where
  they are.

  Args:
    cu_seqlens: int ``[N+1]`` or ``[B, N+1]`` cumulative valid lengths.
    cu_seqlens_padded: int, same shape, cumulative padded lengths.
    layout: the :class:`jax_cp.CPLayout` the rows are for, with a known
      cp size; for DUAL_CHUNK_SWAP the order changes no rank's work and
      the identity is returned.
    window_size: ``None`` or the causal sliding window ``(left, 0)`` the
      model's attention uses (a model mixing windowed and global layers:
      the global one, whose work dominates).
    max_rounds: at most this many swaps are applied per row.
    tolerance: a row whose busiest rank has at most ``1 + tolerance``
      times the mean work is left as it is (0.1 % by default: below what a
      step time resolves).
    seed: seeds the sample of swaps scored per round (only rows with more
      swaps than one round scores use it), so the order is reproducible.

  Returns:
    int ``[N]`` or ``[B, N]`` (as the metadata): ``order[i]`` is the
    document that goes to slot ``i``. Apply it with
    :func:`permute_documents`.

  Raises:
    ValueError: malformed metadata, ``T % cp_size != 0``, a bad window, or
      a ``max_rounds`` that is not a non-negative int, or a negative
      ``tolerance``.
  """
  cp, strategy, _ = resolve_layout(layout, "balance_document_order")
  left = check_window_size(window_size, "causal")
  if isinstance(max_rounds, bool) or not isinstance(
      max_rounds, (int, np.integer)) or max_rounds < 0:
    raise ValueError(f"max_rounds must be a non-negative int, got "
                     f"{max_rounds!r}")
  if isinstance(tolerance, bool) or not isinstance(
      tolerance, (int, float, np.integer, np.floating)) or not tolerance >= 0:
    raise ValueError(f"tolerance must be a non-negative number, got "
                     f"{tolerance!r}")
  cu, cuP = host_metadata(cu_seqlens, cu_seqlens_padded)
  validation.check_divisible_tokens(int(cuP[0, -1]), cp)
  lens, plens = np.diff(cu, axis=-1), np.diff(cuP, axis=-1)
  orders = np.tile(np.arange(lens.shape[1]), (lens.shape[0], 1))
  # Contiguous chunks are balanced by the order of the documents.
  if strategy_for(strategy).contiguous_chunks and cp > 1:
    rng = np.random.default_rng(seed)
    for r in range(lens.shape[0]):
      orders[r] = _balance_row(lens[r], plens[r], cp, left, int(max_rounds),
                               float(tolerance), rng)
  return orders.reshape(np.shape(cu_seqlens)[:-1] + (lens.shape[1],))


def permute_documents(order: ArrayLike, cu_seqlens: ArrayLike,
                      cu_seqlens_padded: ArrayLike, *arrays: ArrayLike,
                      seq_dim: int = -1) -> tuple[np.ndarray, ...]:
  """Puts a packed row's documents in ``order``.

  Every document moves whole, with its padding: its tokens stay together
  and in order, so per-document values (positions, next-token labels, the
  loss mask) stay right.

  Args:
    order: int ``[N]`` or ``[B, N]``, each row a permutation of
      ``range(N)``: slot ``i`` gets document ``order[i]``
      (:func:`balance_document_order`).
    cu_seqlens: int ``[N+1]`` or ``[B, N+1]`` cumulative valid lengths.
    cu_seqlens_padded: int, same shape, cumulative padded lengths.
    *arrays: per-token arrays of the row(s): the token axis ``seq_dim``
      has ``T`` entries; with ``[B, N+1]`` metadata axis 0 is the batch.
    seq_dim: the token axis of ``arrays``.

  Returns:
    ``(cu_seqlens, cu_seqlens_padded, *arrays)`` in the new order (numpy,
    dtypes and shapes kept).

  Raises:
    ValueError: an ``order`` that is not a permutation per row, or arrays
      whose token axis or batch does not match the metadata.
  """
  cu, cuP = host_metadata(cu_seqlens, cu_seqlens_padded)
  b, n = cu.shape[0], cu.shape[1] - 1
  total = int(cuP[0, -1])
  order_arr = as_int_rows(order, "order")
  if np.shape(order) != np.shape(cu_seqlens)[:-1] + (n,):
    raise ValueError(f"order must have shape "
                     f"{np.shape(cu_seqlens)[:-1] + (n,)} (one slot per "
                     f"document of cu_seqlens), got {np.shape(order)}")
  if (np.sort(order_arr, axis=1) != np.arange(n)).any():
    raise ValueError("order must be a permutation of range(N) in every row")
  lens, plens = np.diff(cu, axis=-1), np.diff(cuP, axis=-1)
  new_lens = np.take_along_axis(lens, order_arr, axis=1)
  new_plens = np.take_along_axis(plens, order_arr, axis=1)
  zero = np.zeros((b, 1), np.int64)
  new_cu = np.concatenate([zero, np.cumsum(new_lens, axis=1)], axis=1)
  new_cuP = np.concatenate([zero, np.cumsum(new_plens, axis=1)], axis=1)
  # The token gather: slot i's tokens are document order[i]'s padded span.
  gather = np.empty((b, total), np.int64)
  for r in range(b):
    gather[r] = np.concatenate(
        [np.arange(cuP[r, d], cuP[r, d + 1]) for d in order_arr[r]]
        + [np.zeros(0, np.int64)])
  out = [new_cu.astype(np.asarray(cu_seqlens).dtype).reshape(
             np.shape(cu_seqlens)),
         new_cuP.astype(np.asarray(cu_seqlens_padded).dtype).reshape(
             np.shape(cu_seqlens_padded))]
  batched = np.ndim(cu_seqlens) == 2
  for k, x in enumerate(arrays):
    x = np.asarray(x)
    axis = seq_dim % x.ndim if x.ndim else 0
    if x.ndim == 0 or x.shape[axis] != total:
      raise ValueError(f"arrays[{k}] must have {total} tokens on axis "
                       f"seq_dim={seq_dim}, got shape {x.shape}")
    if batched:
      if axis == 0 or x.shape[0] != b:
        raise ValueError(f"arrays[{k}] must have the batch of {b} rows on "
                         f"axis 0 and tokens on another axis (seq_dim="
                         f"{seq_dim}), got shape {x.shape}")
      out.append(np.stack([np.take(x[r], gather[r], axis=axis - 1)
                           for r in range(b)]))
    else:
      out.append(np.take(x, gather[0], axis=axis))
  return tuple(out)


__all__ = ("balance_document_order", "permute_documents")
