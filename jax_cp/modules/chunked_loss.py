"""Softmax cross entropy of a language-model head over chunks of tokens:
the ``[B, T, vocab]`` float32 logits never exist at once, forward or
backward (Mini-Sequence Transformer's chunked LM head).

Framework-neutral: the head is any function of a chunk of hidden states
(a closure over a Flax module's parameters works; see
``examples/packed_lm/train.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_cp.cp.layout import CPLayout
from jax_cp.modules import token_chunks
from jax_cp.modules.inputs import module_layout
from jax_cp.typing import Array, ArrayLike

# "auto": chunks of about this many logits, or float32 values of the
# hidden states the head normalizes (64 MiB), and of at least
# AUTO_MIN_TOKENS tokens.
AUTO_LOGITS = 1 << 24
AUTO_MIN_TOKENS = 1024


def loss_chunk_tokens(chunk_size: Any, vocab: int, local_tokens: int,
                      features: int = 0) -> int | None:
  """Tokens per chunk (None: whole rows) of :func:`chunked_cross_entropy`:
  a positive int, None, or ``"auto"`` (``AUTO_LOGITS // max(vocab,
  features)`` tokens, at least ``AUTO_MIN_TOKENS``; ``features``: the
  hidden states' size)."""
  token_chunks.check_chunk_size(chunk_size, "chunk_size")
  if chunk_size is None:
    return None
  if chunk_size == "auto":
    chunk_size = max(AUTO_LOGITS // max(int(vocab), int(features), 1),
                     AUTO_MIN_TOKENS)
  return None if chunk_size >= local_tokens else int(chunk_size)


def _cross_entropy(logits_fn, x, labels):
  logits = logits_fn(x).astype(jnp.float32)                  # [.., c, V]
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


def chunked_cross_entropy(logits_fn: Callable[[Array], Array], x: ArrayLike,
                          labels: ArrayLike, *, vocab: int,
                          chunk_size: int | str | None = "auto",
                          layout: CPLayout | None = None) -> Array:
  """Per-token softmax cross entropy, float32 ``[.., T]``, of the logits
  ``logits_fn(x)`` against integer ``labels [.., T]``, chunk by chunk.

  See docs/long_rows.md.

  The chunks of each rank's tokens (in the global view with CP, ``c``
  tokens of every rank at a time: no token moves between ranks) run in
  :func:`jax_cp.modules.token_chunks.map_token_chunks`' loop, so at most one
  chunk's logits (and softmax) are live, forward and backward: the
  backward re-runs ``logits_fn`` one chunk at a time and writes each
  chunk's cotangent of ``x`` over that chunk of ``x``. A shorter last
  chunk takes the rest of the tokens.

  Args:
    logits_fn: the head, ``[.., c, E] -> [.., c, vocab]`` (computed in
      float32 from whatever dtype it returns), position-wise.
    x: ``[.., T, E]`` hidden states (``[B, T, E]`` rows of the layout).
    labels: int ``[.., T]``, each in ``[0, vocab)``.
    vocab: the number of classes (sizes ``"auto"`` chunks).
    chunk_size: tokens per chunk of each rank's: a positive int, None (the
      whole row at once) or ``"auto"`` (about 2^24 logits, or values of
      ``x``, per chunk, at least 1024 tokens).
    layout: the :class:`jax_cp.CPLayout` of ``x`` (None: no CP).

  Returns:
    ``[.., T]`` float32 cross entropy per token; weigh it with the loss
    mask and sum.

  Raises:
    ValueError: a ``chunk_size`` that is not None, ``"auto"`` or a
      positive int; ``labels`` not of ``x``'s shape without its features.
  """
  layout = module_layout(layout)
  if tuple(labels.shape) != tuple(x.shape[:-1]):
    raise ValueError(f"labels must have the shape of x without its feature "
                     f"dim, {tuple(x.shape[:-1])}; got {tuple(labels.shape)}")
  cp = layout.resolve_cp_size()
  groups = token_chunks.token_groups(layout, cp)
  chunk = loss_chunk_tokens(chunk_size, vocab, x.shape[-2] // groups,
                            x.shape[-1])
  if chunk is None:
    return _cross_entropy(logits_fn, x, labels)
  ce = token_chunks.map_token_chunks(
      lambda xc, lc, pin: _cross_entropy(logits_fn, xc, lc)[..., None], x,
      chunk, layout, cp, aux=labels)
  return ce.reshape(labels.shape)
