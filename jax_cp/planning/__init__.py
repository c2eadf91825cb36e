"""Planning on the host, before or beside a run: which strategy and which
exchange (docs/long_rows.md, Choosing an exchange), what each rank does,
the document order that balances NO_LOAD_BALANCE, and the FLOP counts of
MFU (docs/concepts.md, docs/data.md).

Everything here is numpy on the host: call it from the data loader or a
notebook, not inside ``jit``.
"""

from jax_cp.planning.cost_model import (
    CPCostEstimate,
    StrategyRecommendation,
    estimate_cp_imbalance,
    recommend_strategy,
)
from jax_cp.planning.document_order import (
    balance_document_order,
    permute_documents,
)
from jax_cp.planning.exchange_choice import (
    ExchangeRecommendation,
    recommend_exchange,
)
from jax_cp.planning.flops import attention_flops, causal_pairs, model_flops

__all__ = [
    "CPCostEstimate",
    "ExchangeRecommendation",
    "StrategyRecommendation",
    "attention_flops",
    "balance_document_order",
    "causal_pairs",
    "estimate_cp_imbalance",
    "model_flops",
    "permute_documents",
    "recommend_exchange",
    "recommend_strategy",
]
