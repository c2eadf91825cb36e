"""jax_cp: context-parallel attention over packed variable-length sequences.

The concepts and the attention (docs/concepts.md)::

    jax_cp.CPLayout, jax_cp.CPBatch, jax_cp.CPLoadBalancingStrategy
    jax_cp.cp_attention(q, k, v, batch, layout=...)
    jax_cp.cp_attention_fn(layout)   # attention_fn of Flax's own modules
    jax_cp.fused_attention(...)      # the varlen primitive, no CP

The modules: :mod:`jax_cp.nnx` (Flax NNX) and :mod:`jax_cp.flax` (Linen),
with :func:`remat_policy` and :func:`chunked_cross_entropy` beside them.
Data and planning helpers live in :mod:`jax_cp.data` (packed rows, global
batches, the layout's token order) and :mod:`jax_cp.planning` (strategy,
document order, FLOPs).
"""

from jax_cp import data, planning
from jax_cp.attention.api import fused_attention
from jax_cp.cp.api import cp_attention
from jax_cp.cp.layout import CPBatch, CPLayout
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.modules.attention_fn import cp_attention_fn
from jax_cp.modules.chunked_loss import chunked_cross_entropy
from jax_cp.modules.remat import remat_policy

__version__ = "0.1.0"

__all__ = [
    "CPBatch",
    "CPLayout",
    "CPLoadBalancingStrategy",
    "chunked_cross_entropy",
    "cp_attention",
    "cp_attention_fn",
    "data",
    "fused_attention",
    "planning",
    "remat_policy",
]
