"""The load-balancing strategies as objects (docs/internals.md, Call
plans): each owns its token placement, its rules, its per-step metadata
and its call plans behind one interface (:class:`base.Strategy`).
:func:`strategy_for` is the one place a strategy is chosen by its
:class:`~jax_cp.cp.strategies.load_balancing.CPLoadBalancingStrategy` member."""

from __future__ import annotations

from jax_cp.cp.strategies.base import Strategy
from jax_cp.cp.strategies.dual_chunk_swap import DualChunkSwap
from jax_cp.cp.strategies.load_balancing import (
  CPLoadBalancingStrategy,
  as_strategy,
)
from jax_cp.cp.strategies.no_load_balance import NoLoadBalance

_STRATEGIES: dict[CPLoadBalancingStrategy, Strategy] = {
    s.member: s for s in (DualChunkSwap(), NoLoadBalance())}


def strategy_for(strategy: CPLoadBalancingStrategy | str) -> Strategy:
  """The strategy object of an enum member (or its string)."""
  return _STRATEGIES[as_strategy(strategy)]


__all__ = ("Strategy", "strategy_for")
