"""One document's attention in parts, and the merges that join them.

* :mod:`~jax_cp.attention.decompose.merge`: row merges and log-sum-exp
  merges of partial results, and the running sum of a gradient over
  calls.
* :mod:`~jax_cp.attention.decompose.straddle`: the halo call of a
  straddling document (NO_LOAD_BALANCE and layer chunks).
* :mod:`~jax_cp.attention.decompose.chunk_attention`: a layer chunk's
  attention.
"""
