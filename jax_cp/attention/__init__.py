"""Varlen (THD) attention without CP: the ``fused_attention`` primitive, its
backends, and the pieces the CP layer and the layer chunks build on.

* :mod:`~jax_cp.attention.api`: ``fused_attention``.
* :mod:`~jax_cp.attention.validation`: the ``check_*`` functions of an
  attention call's arguments.
* :mod:`~jax_cp.attention.backend`: the backend contract (``Protocol``),
  :class:`Segments`, :func:`row_segments`.
* :mod:`~jax_cp.attention.registry`: the table of backends, and choosing
  one.
* :mod:`~jax_cp.attention.xla`: the portable backend.
* :mod:`~jax_cp.attention.cudnn`: the cuDNN backend and what it is made
  of (its scratch formula, the backward within its scratch bound, K/V
  slices); no module outside it imports it.
* :mod:`~jax_cp.attention.decompose`: one document's attention in parts
  (the halo call of a straddling document, a layer chunk's attention)
  and the merges that join partial results.
* :mod:`~jax_cp.attention.head_groups`: a backward in sub-calls over whole
  GQA head groups (how a backend or the CP ring keeps to a scratch
  bound).
* :mod:`~jax_cp.attention.determinism`: the deterministic mode and how
  XLA's request for it is read.
"""

from jax_cp.attention.api import fused_attention
from jax_cp.attention.backend import (
    AttentionBackend,
    Backend,
    InPlaceAttentionBackend,
    Segments,
)
from jax_cp.attention.determinism import xla_requests_determinism
from jax_cp.attention.registry import (
    register_backend,
    registered_backends,
    resolve_backend,
)
from jax_cp.attention.validation import MASK_TYPES

__all__ = ["fused_attention", "AttentionBackend", "Backend",
           "InPlaceAttentionBackend", "MASK_TYPES", "Segments",
           "register_backend", "registered_backends", "resolve_backend",
           "xla_requests_determinism"]
