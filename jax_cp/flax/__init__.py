"""Flax linen modules for context-parallel attention over packed rows.

``DotProductAttention`` -> ``MultiHeadAttention`` -> ``TransformerLayer``;
each holds one static ``layout`` field (a :class:`jax_cp.CPLayout`) and
hands it to its children. The same modules for Flax NNX are in
:mod:`jax_cp.nnx`, with the same public names: the runtime both use is
:mod:`jax_cp.modules`, and the parameter converters :func:`linen_params` /
:func:`load_linen_params` (which need ``flax.nnx``, imported when first
used) are those of :mod:`jax_cp.nnx.convert`.
"""

from jax_cp.flax.attention import DotProductAttention, MultiHeadAttention
from jax_cp.flax.transformer import MlpBlock, TransformerLayer
from jax_cp.modules.common import STRATEGY_CODES, strategy_from_code
from jax_cp.modules.rotary import apply_rotary

_CONVERTERS = ("linen_params", "load_linen_params")

__all__ = [
    "DotProductAttention",
    "MlpBlock",
    "MultiHeadAttention",
    "STRATEGY_CODES",
    "TransformerLayer",
    "apply_rotary",
    "linen_params",
    "load_linen_params",
    "strategy_from_code",
]


def __getattr__(name: str):
  if name in _CONVERTERS:
    from jax_cp.nnx import convert
    return getattr(convert, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
