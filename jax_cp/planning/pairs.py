"""The (query, key) pairs of causal attention inside one document.

A query at document position ``j`` sees keys ``0..j`` (``j + 1`` pairs);
under a causal sliding window ``(left, 0)`` it sees ``min(j + 1, left + 1)``.
:func:`range_pairs` sums them over a range of query positions: the work
counts of :mod:`jax_cp.planning.cost_model`,
:mod:`jax_cp.planning.document_order` and :mod:`jax_cp.planning.flops`
(numpy, int64, elementwise over arrays of ranges).
"""

from __future__ import annotations

import numpy as np


def _triangle(a, b):
  """Sum of ``j+1`` for ``j`` in ``[a, b)``, for ``b >= a``."""
  return (b * (b + 1) - a * (a + 1)) // 2


def range_pairs(a, b, left: int = -1):
  """The keys queries ``a..b-1`` of a document see, summed (0 where
  ``b <= a``), int64: ``sum j+1`` without a window (``left < 0``),
  ``sum min(j+1, left+1)`` under a causal window ``(left, 0)``."""
  a = np.asarray(a, np.int64)
  b = np.maximum(np.asarray(b, np.int64), a)
  if left < 0:
    return _triangle(a, b)
  m = left + 1              # from position m on, every query sees m keys
  ramp = _triangle(np.minimum(a, m), np.minimum(b, m))
  return ramp + m * (b - np.maximum(a, np.minimum(b, m)))


__all__ = ("range_pairs",)
