"""The framework-neutral runtime of the Flax modules: :mod:`jax_cp.flax`
(Linen) and :mod:`jax_cp.nnx` (NNX) both build on it.

* :mod:`jax_cp.modules.common`: layout and input checks, head and MLP
  settings, the attention call;
* :mod:`jax_cp.modules.rotary`: rotary position embeddings.
"""
