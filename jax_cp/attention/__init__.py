"""Varlen (THD) attention: the ``fused_attention`` primitive and its backends."""

from jax_cp.attention.api import fused_attention
from jax_cp.attention.registry import (AttentionBackend, MASK_TYPES, Segments,
                                       register_backend, registered_backends,
                                       resolve_backend)

__all__ = ["fused_attention", "AttentionBackend", "MASK_TYPES", "Segments",
           "register_backend", "registered_backends", "resolve_backend"]
