"""Context parallelism over packed rows: the layout, its partition of the
tokens, and CP attention (docs/concepts.md, docs/internals.md).

From the bottom floor up (each imports only those below it):

1. :mod:`~jax_cp.cp.strategies`: how a strategy cuts the row and which
   calls a rank runs (``CPLoadBalancingStrategy``, the strategy objects,
   their per-step metadata, calls and call plans).
2. :mod:`~jax_cp.cp.validation`: the ``check_*`` functions of metadata,
   cp sizes, mesh axes and the ``max_seqlen`` bound;
   :mod:`~jax_cp.cp.executor`: runs a plan's calls.
3. :mod:`~jax_cp.cp.layout`: ``CPLayout`` and ``CPBatch``;
   :mod:`~jax_cp.cp.guard`: the in-graph guard of ``max_seqlen``;
   :mod:`~jax_cp.cp.exchange`: how K/V and dK/dV travel between ranks.
4. :mod:`~jax_cp.cp.partition`: which tokens each rank holds;
   :mod:`~jax_cp.cp.config`: ``CPConfig``, one call's static settings.
5. :mod:`~jax_cp.cp.vjp`: the per-rank forward and backward
   (``custom_vjp``).
6. :mod:`~jax_cp.cp.api`: ``cp_attention``.
"""
