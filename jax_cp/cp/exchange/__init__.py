"""How K/V travel between CP ranks (docs/internals.md, Exchange): one
module per exchange, chosen here and nowhere else.

* :class:`~jax_cp.cp.exchange.local.Local` (``"none"``): one rank, or a
  halo of 0 tokens.
* :class:`~jax_cp.cp.exchange.all_gather.AllGather`: the whole row.
* :class:`~jax_cp.cp.exchange.halo.Halo`: the ``min(W-1, left)`` tokens
  before the chunk (NO_LOAD_BALANCE with a bound or a window).
* :class:`~jax_cp.cp.exchange.ring.Ring`: one chunk per hop, steps of its
  own.
* :class:`~jax_cp.cp.exchange.all_to_all.HeadScatter`: heads scattered
  around a program of its own (``"all_to_all"``, ``"all_to_all+ring"``).

Adding an exchange: a module with its class, and a line in
:data:`KV_EXCHANGES` (an exchange the plan's calls read, or that runs its
own steps) or :data:`HEAD_SCATTERS` (one that wraps the per-rank
program).
"""

from __future__ import annotations

from jax_cp.cp.exchange import all_to_all
from jax_cp.cp.exchange.all_gather import AllGather
from jax_cp.cp.exchange.all_to_all import HeadScatter, Split
from jax_cp.cp.exchange.base import KVExchange
from jax_cp.cp.exchange.halo import Halo
from jax_cp.cp.exchange.local import Local
from jax_cp.cp.exchange.ring import Ring
from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy

#: ``comm_type`` -> the exchange of the whole row's K/V: its class and
#: whether a halo of more than one chunk is run by it (the ring) or by the
#: halo exchange (a gather reaches no further than it must anyway).
KV_EXCHANGES: dict[str, tuple[type[KVExchange], bool]] = {
    "all_gather": (AllGather, False),
    "ring": (Ring, True),
}
#: ``comm_type`` -> where its all-to-all runs and what runs after it.
HEAD_SCATTERS = {
    "all_to_all": all_to_all.whole_rows,
    "all_to_all+ring": all_to_all.inner_then_ring,
}

__all__ = ["KVExchange", "Local", "AllGather", "Halo", "Ring",
           "HeadScatter", "Split", "KV_EXCHANGES", "HEAD_SCATTERS",
           "choose_exchange", "head_scatter_split"]


def head_scatter_split(comm_type: str, cp_axis,
                       axis_sizes: tuple[int, ...]) -> Split | None:
  """Where ``comm_type``'s all-to-all runs, or None for an exchange of the
  row's K/V."""
  split = HEAD_SCATTERS.get(comm_type)
  return None if split is None else split(cp_axis, axis_sizes)


def choose_exchange(strategy, cp_axis, cp_size: int, total_tokens: int,
                    max_seqlen: int | None, window_left: int = -1,
                    comm_type: str = "all_gather",
                    deterministic: bool = False) -> KVExchange:
  """The cheapest correct exchange of the row's K/V, chosen statically.

  ``strategy``: a :class:`~jax_cp.CPLoadBalancingStrategy`, or a bool
  saying whether its chunks are contiguous (NO_LOAD_BALANCE).

  ``comm_type="ring"`` replaces the all-gather by the ring, and a halo of
  more than one chunk by the ring's steps that reach as far (a halo of
  one chunk or less is a single hop, which the ring cannot beat). With a
  sliding window NO_LOAD_BALANCE keeps the halo
  (:meth:`~jax_cp.cp.strategies.base.Strategy.check_ring_window` rejects
  a window that reaches the whole row).

  Contiguous chunks with a bound W move ``W-1`` tokens per rank through
  ``ceil((W-1)/Tl)`` hops instead of ``(cp-1)*Tl``; when that reaches rank
  0 anyway (``W-1 >= (cp-1)*Tl``) the row's exchange runs. A causal
  sliding window bounds the halo further, to ``min(W-1, window_left)``.

  DUAL_CHUNK_SWAP gathers with or without a window: a windowed query chunk
  needs only the ``window_left`` tokens before it, but they are
  per-document tails of chunks spread over (up to) two other ranks, of
  traced sizes; an exchange of static shape would send both neighbours'
  whole chunks (``2*Tl`` tokens per rank), which only beats the
  all-gather's ``(cp-1)*Tl`` at cp > 3.

  ``deterministic`` (the mode) sums the gradients in a fixed order; the
  choice is the same.
  """
  if isinstance(strategy, bool):
    strategy = (CPLoadBalancingStrategy.NO_LOAD_BALANCE if strategy else
                CPLoadBalancingStrategy.DUAL_CHUNK_SWAP)
  contiguous = strategy_for(strategy).contiguous_chunks
  common = dict(cp_axis=cp_axis, cp_size=cp_size, total_tokens=total_tokens,
                deterministic=deterministic)
  if cp_size == 1:
    return Local(**common)
  cls, reaches_far = KV_EXCHANGES[comm_type]
  tl = total_tokens // cp_size
  steps = cp_size
  if contiguous and max_seqlen is not None:
    halo = max(int(max_seqlen) - 1, 0)
    if window_left >= 0:
      halo = min(halo, window_left)
    if halo == 0:       # no query looks before its own token's chunk
      return Local(**common)
    if halo < (cp_size - 1) * tl and (
        not reaches_far or halo <= tl or window_left >= 0):
      return Halo(halo_tokens=halo, **common)
    steps = min(cp_size, 1 + -(-halo // tl))
  return cls.of_row(strategy, steps, **common)
