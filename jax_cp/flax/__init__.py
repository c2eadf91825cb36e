"""Flax linen modules for context-parallel attention over packed rows.

``DotProductAttention`` -> ``MultiHeadAttention`` -> ``TransformerLayer``;
each carries the same static CP fields (``cp_axis``, ``cp_strategy``,
``cp_comm_type``, ``attn_backend``, ``max_seqlen``, ``mesh``, ``batch_axis``,
``local_view``) and hands all of them to its children.
"""

from jax_cp.flax.attention import DotProductAttention, MultiHeadAttention
from jax_cp.flax.rotary import apply_rotary
from jax_cp.flax.settings import CP_FIELDS, STRATEGY_CODES, strategy_from_code
from jax_cp.flax.transformer import MlpBlock, TransformerLayer

__all__ = [
    "CP_FIELDS",
    "DotProductAttention",
    "MlpBlock",
    "MultiHeadAttention",
    "STRATEGY_CODES",
    "TransformerLayer",
    "apply_rotary",
    "strategy_from_code",
]
