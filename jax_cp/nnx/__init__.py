"""Flax NNX modules for context-parallel attention over packed rows.

``DotProductAttention`` -> ``MultiHeadAttention`` -> ``TransformerLayer``
(and ``MlpBlock``), the NNX counterparts of :mod:`jax_cp.flax`: same math
(the runtime of :mod:`jax_cp.modules`), same names, same parameter names
and shapes (:func:`load_linen_params`, :func:`linen_params` convert). Each
holds its :class:`jax_cp.CPLayout` as static configuration and hands it
to its children.
"""

from jax_cp.nnx.attention import DotProductAttention, MultiHeadAttention
from jax_cp.nnx.convert import linen_params, load_linen_params
from jax_cp.nnx.transformer import MlpBlock, TransformerLayer

__all__ = [
    "DotProductAttention",
    "MlpBlock",
    "MultiHeadAttention",
    "TransformerLayer",
    "linen_params",
    "load_linen_params",
]
