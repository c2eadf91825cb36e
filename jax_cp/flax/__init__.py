"""Flax Linen modules for context-parallel attention over packed rows.

``DotProductAttention`` -> ``MultiHeadAttention`` -> ``TransformerLayer``
(and ``MlpBlock``); each holds one static ``layout`` field (a
:class:`jax_cp.CPLayout`) and hands it to its children. The same modules
for Flax NNX are in :mod:`jax_cp.nnx`, with the same names and parameters
(:func:`jax_cp.nnx.linen_params`, :func:`jax_cp.nnx.load_linen_params`
convert); both build on :mod:`jax_cp.modules`.
"""

from jax_cp.flax.attention import DotProductAttention, MultiHeadAttention
from jax_cp.flax.transformer import MlpBlock, TransformerLayer

__all__ = [
    "DotProductAttention",
    "MlpBlock",
    "MultiHeadAttention",
    "TransformerLayer",
]
