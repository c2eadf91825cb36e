"""The model's loss with its head run chunk by chunk
(:func:`jax_cp.chunked_cross_entropy`): the final
norm, the logits and the cross entropy of a few thousand tokens at a time,
so the step never holds the ``[B, T, 256]`` float32 logits of a row."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import jax_cp
from examples.packed_lm.model import VOCAB_SIZE, PackedLM


def token_losses(model: PackedLM, batch: jax_cp.CPBatch,
                 chunk_size="auto"):
  """float32 ``[B, T]`` next-byte cross entropy of every token, the head
  (final norm and logits) run over ``chunk_size`` tokens of each rank's
  at a time."""
  graphdef, state = nnx.split((model.final_norm, model.logits))

  def head(x):
    norm, logits = nnx.merge(graphdef, state)
    return logits(norm(x)).astype(jnp.float32)

  return jax_cp.chunked_cross_entropy(
      head, model.hidden_states(batch), batch.tensors["labels"],
      vocab=VOCAB_SIZE, chunk_size=chunk_size, layout=model.layout)
