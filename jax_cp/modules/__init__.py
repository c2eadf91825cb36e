"""The framework-neutral runtime of the Flax modules: :mod:`jax_cp.flax`
(Linen) and :mod:`jax_cp.nnx` (NNX) both build on it, and nothing here
imports Flax.

* :mod:`jax_cp.modules.common`: layout and input checks, head and MLP
  settings, the attention call;
* :mod:`jax_cp.modules.rotary`: rotary position embeddings;
* :mod:`jax_cp.modules.remat`: the checkpoint names and the presets of the
  modules' ``remat`` field;
* :mod:`jax_cp.modules.chunked_loss`: cross entropy over the tokens in
  chunks, never the whole ``[B, T, vocab]`` logits at once.
"""
