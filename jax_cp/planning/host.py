"""Row metadata made concrete and checked on the host, for the planning
functions.

The host-side functions (:mod:`jax_cp.planning.cost_model`,
:mod:`jax_cp.planning.document_order`) take ``cu_seqlens``/
``cu_seqlens_padded`` as numpy or non-traced JAX arrays, ``[N+1]`` or
``[B, N+1]``, and a :class:`jax_cp.CPLayout`; the functions here turn
those into int64 rows and ``(cp, strategy, max_seqlen)``, raising
``ValueError`` on what they cannot use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cp.attention.validation import concrete
from jax_cp.cp import validation
from jax_cp.cp.layout import CPLayout, check_layout
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy


def as_int_rows(x: Any, name: str) -> np.ndarray:
  """``x`` as int64 rows ``[B, N]`` (``B = 1`` for a 1-D ``x``); ``name``
  names it in errors. Raises ``ValueError`` for a traced array or a
  non-integer dtype."""
  arr = concrete(x)
  if arr is None:
    raise ValueError(f"{name} must be a concrete host array (numpy or a "
                     "non-traced JAX array): this runs on the host, in the "
                     "data loader")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
  return arr.astype(np.int64).reshape(-1, arr.shape[-1])


def resolve_layout(layout: CPLayout, caller: str
                   ) -> tuple[int, CPLoadBalancingStrategy, int | None]:
  """``(cp, strategy, max_seqlen)`` of a :class:`CPLayout` whose cp size
  is known: set, read from its mesh, or from the context mesh.
  ``caller`` names the function in errors."""
  layout = check_layout(layout, caller)
  cp = layout.cp_size
  if cp is None:
    try:
      cp = layout.resolve_cp_size()
    except ValueError:
      raise ValueError(f"{caller} needs the layout's cp size: build the "
                       "CPLayout with mesh=... or cp_size=...") from None
  return int(cp), layout.strategy, layout.max_seqlen


def host_metadata(cu_seqlens, cu_seqlens_padded
                  ) -> tuple[np.ndarray, np.ndarray]:
  """Concrete, checked metadata as int64 rows ``[B, N+1]`` (``B = 1`` for
  ``[N+1]``): ``(cu_seqlens, cu_seqlens_padded)``."""
  cuP = as_int_rows(cu_seqlens_padded, "cu_seqlens_padded")
  cu = as_int_rows(cu_seqlens, "cu_seqlens")
  validation.check_cu_seqlens_padded(np.asarray(cu_seqlens_padded))
  validation.check_cu_seqlens(np.asarray(cu_seqlens),
                          np.asarray(cu_seqlens_padded))
  return cu, cuP


__all__ = ("as_int_rows", "host_metadata", "resolve_layout")
