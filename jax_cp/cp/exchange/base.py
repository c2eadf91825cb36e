"""The interface of a K/V exchange, and what every exchange shares
(docs/internals.md, Exchange).

An exchange is a small frozen (hashable) class, one module each, chosen
in one place (:func:`jax_cp.cp.exchange.choose_exchange`). It owns what
travels and how, forward and backward, what the forward keeps for the
backward, and how a rank's steps run: :class:`KVExchange`'s
:meth:`~KVExchange.forward` and :meth:`~KVExchange.backward` run the plan
executor (:mod:`jax_cp.cp.executor`) over the buffers :meth:`receive`
gives, and send the gradients of those buffers back with :meth:`scatter`;
an exchange with steps of its own (the ring) overrides both.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jax_cp.attention.decompose.merge import add, merge_rows_jnp
from jax_cp.cp import executor


@dataclasses.dataclass(frozen=True)
class KVExchange:
  """How K/V reach one rank's calls (static, hashable).

  Attributes:
    cp_axis: the mesh axis (or axes) of the ranks.
    cp_size: their number.
    total_tokens: T, tokens per row.
    deterministic: the deterministic mode: gradients summed over the
      ranks in a fixed order (docs/determinism.md).
    kind: the exchange's name (reports and plans; never compared to
      decide).
  """

  cp_axis: str | tuple[str, ...] | None
  cp_size: int
  total_tokens: int
  deterministic: bool = False

  kind: ClassVar[str] = ""
  #: The exchanged buffer is the whole row in sequence order.
  gathers_row: ClassVar[bool] = False
  #: Anything travels between ranks (not so for one rank's own chunk).
  moves_kv: ClassVar[bool] = True

  @classmethod
  def of_row(cls, strategy, steps: int, **common) -> KVExchange:
    """The exchange of a row's K/V under ``strategy`` whose queries reach
    back over ``steps`` chunks (their own included)."""
    del strategy, steps
    return cls(**common)

  @property
  def local_tokens(self) -> int:
    return self.total_tokens // self.cp_size

  @property
  def buffer_rows(self) -> int:
    """Rows of the exchanged K/V buffer a call reads."""
    return self.total_tokens

  @property
  def keeps_halo(self) -> bool:
    """Whether the forward keeps what it received for the backward."""
    return False

  def received_tokens(self, rank: int) -> int:
    """Tokens of K/V rank ``rank`` receives from the others in a forward
    (the planner's bytes): the all-gather's ``(cp - 1) * Tl``."""
    del rank
    return (self.cp_size - 1) * self.local_tokens

  def rows_before_chunk(self, window_left: int, max_seqlen: int) -> int:
    """``H``, the rows before a rank's chunk that a NO_LOAD_BALANCE query
    with the window ``window_left`` can see in the exchanged buffer."""
    return max(min(window_left, max_seqlen - 1,
                   (self.cp_size - 1) * self.local_tokens), 0)

  def buffer_start(self, rank):
    """Physical index of the exchanged buffer's first token on ``rank``."""
    del rank
    return jnp.int32(0)

  # ---------------------------------------------------------- collectives

  def _permute(self, x, perm):
    return jax.lax.ppermute(x, self.cp_axis, perm)

  def _shift(self, x, hops: int):
    """``x`` of rank ``i`` to rank ``(i + hops) mod cp``."""
    cp = self.cp_size
    return self._permute(x, [(i, (i + hops) % cp) for i in range(cp)])

  # ----------------------------------------------------- the plan's buffers

  def receive(self, k, v, cu_seqlens_padded):
    """Local ``[B, Tl, Hkv, D]`` K and V -> ``(gathered, halo)``: the
    exchanged ``(k, v)`` buffers, or the received ``[B, H, 2*Hkv, D]``
    halo (K heads first); the other None."""
    raise NotImplementedError(f"{type(self).__name__} feeds no plan")

  def scatter(self, dk, dv, cu_seqlens_padded, into=(None, None),
              merge_rows=merge_rows_jnp):
    """Gradients w.r.t. the exchanged buffers -> gradients of the local
    chunk (summed over every rank that read it), added to ``into``
    (local ``(dk, dv)`` ``[B, Tl, Hkv, D]``, None: zeros); ``merge_rows``
    the backend's row merge."""
    raise NotImplementedError(f"{type(self).__name__} feeds no plan")

  # ---------------------------------------------------------------- steps

  def forward(self, cfg, q, k, v, cu_seqlens, cu_seqlens_padded,
              need_lse: bool = True):
    """``(out, lse, saved)`` of a rank (:func:`jax_cp.cp.executor.
    forward`)."""
    return executor.forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded,
                            need_lse)

  def backward(self, cfg, residuals, dout):
    """``(dq, dk, dv)`` of a rank (:func:`jax_cp.cp.executor.backward`)."""
    return executor.backward(cfg, residuals, dout)


def added(into, dk, dv):
  """``(dk, dv)`` added to ``into``'s (None: themselves)."""
  into_k, into_v = into
  return (dk if into_k is None else add(into_k, dk),
          dv if into_v is None else add(into_v, dv))
