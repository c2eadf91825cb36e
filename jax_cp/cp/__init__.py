"""Context parallelism over packed rows: the layout, its partition of the
tokens, and CP attention (docs/concepts.md, docs/internals.md).

* :mod:`~jax_cp.cp.strategy`: ``CPLoadBalancingStrategy``.
* :mod:`~jax_cp.cp.layout`: ``CPLayout`` and ``CPBatch``.
* :mod:`~jax_cp.cp.validation`: the ``check_*`` functions of metadata,
  cp sizes, mesh axes and the ``max_seqlen`` bound.
* :mod:`~jax_cp.cp.partition`: which tokens each rank holds.
* :mod:`~jax_cp.cp.metadata`: per-step Q/KV lengths and offsets.
* :mod:`~jax_cp.cp.config`: ``CPConfig``, one call's static settings.
* :mod:`~jax_cp.cp.call_plan`: the calls a rank runs, by kind.
* :mod:`~jax_cp.cp.exchange`: how K/V and dK/dV travel between ranks.
* :mod:`~jax_cp.cp.guard`: the in-graph guard of ``max_seqlen``.
* :mod:`~jax_cp.cp.vjp`: the per-rank forward and backward
  (``custom_vjp``), the executor of the plans.
* :mod:`~jax_cp.cp.api`: ``cp_attention``.
"""
