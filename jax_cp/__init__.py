"""jax_cp: context-parallel attention over packed variable-length sequences.

Public API::

    from jax_cp import CPLayout, CPBatch, CPLoadBalancingStrategy
    jax_cp.get_partition_indices / get_batch_on_this_cp_rank
    jax_cp.reorder_for_cp / restore_from_cp / get_position_ids
    jax_cp.balance_document_order / permute_documents (the data loader's
        document order that balances NO_LOAD_BALANCE)
    jax_cp.cp_attention (global view) / cp_attention_local (inside shard_map)
    jax_cp.fused_attention (the varlen primitive, no CP)
    jax_cp.PackedRows / pack_documents / pad_multiple_for / balance_rows
        (documents packed into rows with a strategy's padding)
    jax_cp.rows_from_segment_ids / to_segment_layout / segment_index /
        cu_seqlens_from_segment_ids (batches in the segment-id convention:
        MaxText, grain, TE JAX)
    jax_cp.model_flops / attention_flops / causal_pairs (the one FLOP
        count: MFU convention, or hardware FLOPs with recompute=True)
    jax_cp.cp_attention_fn (attention_fn of Flax's own attention modules)
    jax_cp.remat_policy (the jax.checkpoint policy of a module's remat preset)
    from jax_cp.nnx import (DotProductAttention, MultiHeadAttention,
                            TransformerLayer)                  # Flax NNX
    from jax_cp.flax import (DotProductAttention, MultiHeadAttention,
                             TransformerLayer)                 # Flax Linen
"""

from jax_cp.attention.api import fused_attention
from jax_cp.attention_fn import cp_attention_fn
from jax_cp.context_parallel import cp_attention, cp_attention_local
from jax_cp.cost_model import (
                               CPCostEstimate,
                               StrategyRecommendation,
                               estimate_cp_imbalance,
                               recommend_strategy,
)
from jax_cp.data import (
                               make_global_batch,
                               make_global_metadata,
                               process_batch_rows,
)
from jax_cp.document_order import balance_document_order, permute_documents
from jax_cp.flops import attention_flops, causal_pairs, model_flops
from jax_cp.layout import CPBatch, CPLayout
from jax_cp.modules.remat import remat_policy
from jax_cp.packing import (
                               PackedRows,
                               balance_rows,
                               pack_documents,
                               pad_multiple_for,
)
from jax_cp.partition import (
                               get_batch_on_this_cp_rank,
                               get_partition_indices,
                               get_position_ids,
                               longest_padded_document,
                               reorder_for_cp,
                               restore_from_cp,
)
from jax_cp.segment_ids import (
                               cu_seqlens_from_segment_ids,
                               rows_from_segment_ids,
                               segment_index,
                               to_segment_layout,
)
from jax_cp.strategy import CPLoadBalancingStrategy

__version__ = "0.1.0"

__all__ = [
    "CPBatch",
    "CPLayout",
    "CPCostEstimate",
    "CPLoadBalancingStrategy",
    "PackedRows",
    "StrategyRecommendation",
    "attention_flops",
    "balance_document_order",
    "balance_rows",
    "causal_pairs",
    "cp_attention",
    "cp_attention_fn",
    "cp_attention_local",
    "cu_seqlens_from_segment_ids",
    "estimate_cp_imbalance",
    "fused_attention",
    "get_batch_on_this_cp_rank",
    "get_partition_indices",
    "get_position_ids",
    "longest_padded_document",
    "make_global_batch",
    "make_global_metadata",
    "model_flops",
    "pack_documents",
    "pad_multiple_for",
    "permute_documents",
    "process_batch_rows",
    "recommend_strategy",
    "remat_policy",
    "reorder_for_cp",
    "restore_from_cp",
    "rows_from_segment_ids",
    "segment_index",
    "to_segment_layout",
]
