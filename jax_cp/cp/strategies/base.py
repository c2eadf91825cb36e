"""The interface of a load-balancing strategy (docs/internals.md, Call
plans): where a rank's tokens lie in the row, the rules the row metadata
must follow, the per-step metadata and the calls a rank runs.

A :class:`Strategy` is a stateless object, one per
:class:`~jax_cp.cp.strategies.load_balancing.CPLoadBalancingStrategy` member
(:func:`jax_cp.cp.strategies.strategy_for`). Its placement and rules
hold at any cp size; its plans are those of cp > 1 (one rank runs
:func:`jax_cp.cp.strategies.calls.whole_row_plan`, whatever the strategy).

Names at the method boundaries: ``cu_seqlens``/``cu_seqlens_padded`` are
the row metadata (``[B, N+1]`` where batched), ``rank`` this rank's index
on the cp axis (int32, possibly traced), ``t`` local token indices,
``local_tokens`` ``Tl = T / cp``, ``cfg`` the call's
:class:`jax_cp.cp.config.CPConfig`.
"""

from __future__ import annotations

import abc

import jax.numpy as jnp

from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.cp.strategies.metadata import StepMetadata


def contiguous_index(xp, rank, t, local_tokens: int):
  """The physical index of local token ``t`` when rank ``r`` holds tokens
  ``[r*Tl, (r+1)*Tl)`` (every strategy at cp = 1)."""
  return (rank * local_tokens + t).astype(xp.int32)


def contiguous_document_position(cu_seqlens_padded, rank, t,
                                 local_tokens: int):
  """jnp, one row ``[N+1]``: ``(document, position in it)`` of local token
  ``t`` of rank ``r`` holding tokens ``[r*Tl, (r+1)*Tl)``."""
  cuP = cu_seqlens_padded
  p = rank * local_tokens + t
  b = jnp.clip(jnp.searchsorted(cuP, p, side="right") - 1, 0,
               cuP.shape[0] - 2)
  return b, p - cuP[b]


def drop_unseen(meta: StepMetadata) -> StepMetadata:
  """A ring step's metadata with ``q_len = kv_len = 0`` (and a KV offset
  of 0) for a document that sees none of the held chunk."""
  q_lens = jnp.where(meta.kv_lens > 0, meta.q_lens, 0)
  kv_lens = jnp.where(q_lens > 0, meta.kv_lens, 0)
  return StepMetadata(q_lens, meta.q_offsets, kv_lens,
                      jnp.where(kv_lens > 0, meta.kv_offsets, 0))


class Strategy(abc.ABC):
  """A load-balancing strategy: its token placement, rules and plans.

  Attributes:
    member: the user-facing enum member.
    contiguous_chunks: each rank holds one contiguous piece of the row, so
      the keys a chunk's queries see before it are the tokens right
      before the chunk (a halo), and the all-gathered row is in sequence
      order.
  """

  member: CPLoadBalancingStrategy
  contiguous_chunks: bool

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"

  # ---------------------------------------------------------- placement

  @abc.abstractmethod
  def physical_index(self, xp, cu_seqlens_padded, cp_size: int, rank, t,
                     local_tokens: int):
    """numpy or jnp (``xp``), one row ``[N+1]``: the physical index of
    local token ``t`` of ``rank`` (``rank`` a scalar or a vector like
    ``t``, elementwise)."""

  @abc.abstractmethod
  def document_position(self, cu_seqlens_padded, cp_size: int, rank, t,
                        local_tokens: int):
    """jnp, one row ``[N+1]``: ``(document, position in its padded
    slot)`` of local token ``t`` of ``rank``."""

  @abc.abstractmethod
  def holds_row_in_order(self, cp_size: int) -> bool:
    """Whether the ranks' chunks, one after the other, are the row in
    order (:func:`jax_cp.cp.partition.reorder_for_cp` is the identity)."""

  @abc.abstractmethod
  def gathered_to_sequence_index(self, cu_seqlens_padded, cp_size: int,
                                 total_tokens: int):
    """jnp, ``[T]`` or ``[B, T]``: for each physical position, the index
    of its token in the rank-ordered all-gathered row."""

  def gathered_index(self, cu_seqlens_padded, cp_size: int,
                     total_tokens: int, p):
    """jnp, one row ``[N+1]``: for physical positions ``p``, the index of
    their tokens in the rank-ordered concatenation of the ranks' local
    buffers. Contiguous chunks: ``p`` itself."""
    del cu_seqlens_padded, cp_size, total_tokens
    return p

  @abc.abstractmethod
  def sequence_to_gathered_index(self, cu_seqlens_padded, cp_size: int,
                                 total_tokens: int):
    """jnp, ``[T]`` or ``[B, T]``: for each index of the all-gathered row,
    the physical position of its token."""

  # -------------------------------------------------------------- rules

  @abc.abstractmethod
  def pad_multiple(self, cp_size: int) -> int:
    """Padded document lengths must be multiples of this."""

  @abc.abstractmethod
  def check_padded_lengths(self, cu_seqlens_padded, cp_size: int) -> None:
    """Raises ``ValueError`` where concrete metadata break the padding
    rule at this cp size."""

  @abc.abstractmethod
  def spans_padded_slots(self, cp_size: int) -> bool:
    """Whether a document's whole padded slot counts against
    ``max_seqlen`` (:func:`jax_cp.cp.validation.document_spans`), else
    its valid tokens."""

  @abc.abstractmethod
  def check_mask(self, attn_mask_type: str) -> None:
    """Raises ``ValueError`` for a CP mask the strategy cannot run."""

  @abc.abstractmethod
  def check_ring_window(self, window_left: int, cp_size: int,
                        total_tokens: int) -> None:
    """Raises ``ValueError`` unless the ring exchange can run a sliding
    window ``(window_left, 0)`` at cp > 1."""

  @abc.abstractmethod
  def window_within_bound(self, window_left: int, max_seqlen: int) -> int:
    """The window a config runs with under the bound ``max_seqlen`` (-1:
    none)."""

  @abc.abstractmethod
  def program_sized_by_bound(self, cfg, unbounded) -> bool:
    """Whether the program of ``cfg`` at cp > 1 has calls sized by the
    bound that ``unbounded`` (the same call at ``max_seqlen = T``) does
    not size so (:func:`jax_cp.cp.guard.bounded_program_is_exact`)."""

  # -------------------------------------------------------------- plans

  @abc.abstractmethod
  def forward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank) -> list:
    """The calls of this rank's forward, in order (cp > 1)."""

  @abc.abstractmethod
  def backward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank
                    ) -> list:
    """The calls of this rank's backward, in order (cp > 1)."""

  @abc.abstractmethod
  def ring_step(self, cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                step: int, *, causal: bool, total_tokens: int
                ) -> tuple[StepMetadata, str]:
    """Step ``step`` of the ring exchange on rank ``r``: this rank's Q
    chunk against the K/V chunk of rank ``(r - step) mod cp``, the one it
    holds then (docs/long_rows.md, Ring exchange). Offsets index the
    local Q rows and the held chunk's rows; returns the metadata and its
    mask."""

  @abc.abstractmethod
  def ring_bound(self, cfg, step: int) -> int:
    """The static bound on either side of a ring step's segments
    (:func:`jax_cp.cp.strategies.call_plan.ring_plan` runs the step's call)."""
