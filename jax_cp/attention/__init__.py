"""Varlen (THD) attention: the ``fused_attention`` primitive and its backends.

* :mod:`~jax_cp.attention.backend`: the backend contract (``Protocol``) and
  :class:`Segments`.
* :mod:`~jax_cp.attention.registry`: the table of backends, and choosing one.
* :mod:`~jax_cp.attention.xla`, :mod:`~jax_cp.attention.cudnn`: the backends.
* :mod:`~jax_cp.attention.merge`: row merges, portable versions.
* :mod:`~jax_cp.attention.cudnn_workspace`: the cuDNN backward's scratch
  memory, as a formula, and the bound on it.
* :mod:`~jax_cp.attention.head_groups`: a backward in sub-calls over whole
  GQA head groups (how the cuDNN backend keeps to that bound).
* :mod:`~jax_cp.attention.api`: ``fused_attention``.
"""

from jax_cp.attention.api import fused_attention
from jax_cp.attention.backend import (
    MASK_TYPES,
    AttentionBackend,
    Backend,
    InPlaceAttentionBackend,
    Segments,
)
from jax_cp.attention.registry import (
    register_backend,
    registered_backends,
    resolve_backend,
)

__all__ = ["fused_attention", "AttentionBackend", "Backend",
           "InPlaceAttentionBackend", "MASK_TYPES", "Segments",
           "register_backend", "registered_backends", "resolve_backend"]
