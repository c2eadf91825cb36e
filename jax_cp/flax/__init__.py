"""Flax linen modules for context-parallel attention over packed rows.

``DotProductAttention`` -> ``MultiHeadAttention`` -> ``TransformerLayer``;
each holds one static ``layout`` field (a :class:`jax_cp.CPLayout`) and
hands it to its children. The same modules for Flax NNX are in
:mod:`jax_cp.nnx`.
"""

from jax_cp.flax.attention import DotProductAttention, MultiHeadAttention
from jax_cp.flax.rotary import apply_rotary
from jax_cp.flax.settings import STRATEGY_CODES, strategy_from_code
from jax_cp.flax.transformer import MlpBlock, TransformerLayer

__all__ = [
    "DotProductAttention",
    "MlpBlock",
    "MultiHeadAttention",
    "STRATEGY_CODES",
    "TransformerLayer",
    "apply_rotary",
    "strategy_from_code",
]
