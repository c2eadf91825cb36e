"""The framework-neutral runtime of the Flax modules: :mod:`jax_cp.flax`
(Linen) and :mod:`jax_cp.nnx` (NNX) both build on it, and nothing here
imports Flax.

* :mod:`~jax_cp.modules.inputs`: the layout, metadata, token and position
  checks of a module call, rotary embedding of q and k, the attention
  call;
* :mod:`~jax_cp.modules.settings`: activations, norms, head counts;
* :mod:`~jax_cp.modules.rotary`: rotary position embeddings;
* :mod:`~jax_cp.modules.remat`: the presets of the modules' ``remat``
  field (the names are :mod:`jax_cp.checkpoint_names`);
* :mod:`~jax_cp.modules.token_chunks`: position-wise work over chunks of
  each rank's tokens (``mlp_chunk_size``);
* :mod:`~jax_cp.modules.layer_chunks`: a whole layer over chunks of a row
  with a halo (``layer_chunk_size``);
* :mod:`~jax_cp.modules.chunked_loss`: cross entropy over the tokens in
  chunks, never the whole ``[B, T, vocab]`` logits at once;
* :mod:`~jax_cp.modules.attention_fn`: ``cp_attention_fn``, an
  ``attention_fn`` for Flax's own attention modules.
"""
