"""The (query, key) pairs of causal attention inside one document.

A query at document position ``j`` sees keys ``0..j`` (``j + 1`` pairs);
under a causal sliding window ``(left, 0)`` it sees ``min(j + 1, left + 1)``.
These sums, over a range of query positions, are the work counts of
:mod:`jax_cp.cost_model` and :mod:`jax_cp.document_order` (numpy, int64,
elementwise over arrays of ranges).
"""

from __future__ import annotations

import numpy as np


def causal_pairs(a, b):
  """Sum of ``j+1`` for ``j`` in ``[a, b)`` (0 where ``b <= a``), int64."""
  a = np.asarray(a, np.int64)
  b = np.maximum(np.asarray(b, np.int64), a)
  return (b * (b + 1) - a * (a + 1)) // 2


def window_pairs(a, b, left: int):
  """Sum of ``min(j+1, left+1)`` for ``j`` in ``[a, b)``: the keys queries
  ``a..b-1`` of a document see under a causal window (``left < 0``: no
  window, :func:`causal_pairs`)."""
  if left < 0:
    return causal_pairs(a, b)
  a = np.asarray(a, np.int64)
  b = np.maximum(np.asarray(b, np.int64), a)
  m = left + 1              # from position m on, every query sees m keys
  ramp = causal_pairs(np.minimum(a, m), np.minimum(b, m))
  return ramp + m * (b - np.maximum(a, np.minimum(b, m)))


__all__ = ("causal_pairs", "window_pairs")
