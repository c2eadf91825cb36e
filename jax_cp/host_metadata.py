"""Row metadata made concrete and checked on the host, for the data loader.

The host-side functions (:mod:`jax_cp.cost_model`,
:mod:`jax_cp.document_order`) take ``cu_seqlens``/``cu_seqlens_padded`` as
numpy or non-traced JAX arrays, ``[N+1]`` or ``[B, N+1]``, and a CP size
given as an int or a :class:`jax_cp.CPLayout`; the functions here turn those
into int64 rows and ``(cp, strategy, max_seqlen)``, raising ``ValueError``
on what they cannot use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cp import checks
from jax_cp.layout import CPLayout
from jax_cp.strategy import CPLoadBalancingStrategy, as_strategy


def as_int_rows(x: Any, name: str) -> np.ndarray:
  """``x`` as int64 rows ``[B, N]`` (``B = 1`` for a 1-D ``x``); ``name``
  names it in errors. Raises ``ValueError`` for a traced array or a
  non-integer dtype."""
  arr = checks.concrete(x)
  if arr is None:
    raise ValueError(f"{name} must be a concrete host array (numpy or a "
                     "non-traced JAX array): this runs on the host, in the "
                     "data loader")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
  return arr.astype(np.int64).reshape(-1, arr.shape[-1])


def resolve_cp(cp_size: int | CPLayout, strategy, caller: str,
               max_seqlen: int | None = None
               ) -> tuple[int, CPLoadBalancingStrategy, int | None]:
  """``(cp, strategy, max_seqlen)`` from an int ``cp_size`` and a
  strategy, or from a :class:`CPLayout` with a known ``cp_size`` (its
  strategy and ``max_seqlen`` then, unless given here too, which
  ``CPLayout.build`` refuses). ``caller`` names the function in errors."""
  if isinstance(cp_size, CPLayout):
    layout = CPLayout.build(cp_size, caller, **{
        k: v for k, v in dict(strategy=strategy,
                              max_seqlen=max_seqlen).items()
        if v is not None})
    if layout.cp_size is None:
      raise ValueError(f"{caller} needs the layout's cp size: build the "
                       "CPLayout with mesh=... or cp_size=...")
    cp_size, strategy, max_seqlen = (layout.cp_size, layout.strategy,
                                     layout.max_seqlen)
  strategy = as_strategy(strategy, "strategy")
  checks.check_cp_size(cp_size)
  return int(cp_size), strategy, max_seqlen


def host_metadata(cu_seqlens, cu_seqlens_padded
                  ) -> tuple[np.ndarray, np.ndarray]:
  """Concrete, checked metadata as int64 rows ``[B, N+1]`` (``B = 1`` for
  ``[N+1]``): ``(cu_seqlens, cu_seqlens_padded)``."""
  cuP = as_int_rows(cu_seqlens_padded, "cu_seqlens_padded")
  cu = as_int_rows(cu_seqlens, "cu_seqlens")
  checks.check_cu_seqlens_padded(np.asarray(cu_seqlens_padded))
  checks.check_cu_seqlens(np.asarray(cu_seqlens),
                          np.asarray(cu_seqlens_padded))
  return cu, cuP


__all__ = ("as_int_rows", "host_metadata", "resolve_cp")
