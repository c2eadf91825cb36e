"""The context-parallel load-balancing strategy enum."""

from __future__ import annotations

import enum


class CPLoadBalancingStrategy(str, enum.Enum):
  """How a packed THD row is cut over the context-parallel (cp) mesh axis.

  Members:
    DUAL_CHUNK_SWAP: the default. Every document is cut into ``2*cp`` equal
      chunks; rank ``r`` holds chunks ``r`` and ``2*cp-1-r`` of every document,
      which balances causal work exactly. Two attention steps per rank. Needs
      every padded document length divisible by ``2*cp``.
    NO_LOAD_BALANCE: the whole physical buffer is cut into ``cp``
      contiguous chunks; documents may straddle ranks. One attention step
      per rank and any document length, at the price of causal imbalance
      on long documents (with one long document the last rank does
      ``(2cp-1)/cp`` times the mean work); with ``max_seqlen`` or a sliding
      window ``(left, 0)`` a rank receives only the halo of keys before its
      chunk. Needs causal self-attention. docs/concepts.md says which to
      choose.

  Neither strategy takes FP8 inputs (CP attention refuses them whatever
  the strategy).

  Members compare equal to their string values and can be built from them,
  ``CPLoadBalancingStrategy("no_load_balance")``; they are hashable and can
  be static arguments of ``jax.jit``.
  """

  DUAL_CHUNK_SWAP = "dual_chunk_swap"
  NO_LOAD_BALANCE = "no_load_balance"

  def __str__(self) -> str:  # "dual_chunk_swap", not the class path
    return self.value

  @classmethod
  def _missing_(cls, value):
    if isinstance(value, str):
      for member in cls:
        if member.value == value.lower() or member.name == value.upper():
          return member
    return None


DEFAULT_STRATEGY = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP


def as_strategy(value, argname: str = "strategy"
                ) -> CPLoadBalancingStrategy:
  """Converts a strategy or its string to the enum, or raises ValueError."""
  if value is None:
    return DEFAULT_STRATEGY
  try:
    return CPLoadBalancingStrategy(value)
  except ValueError:
    raise ValueError(
        f"{argname}={value!r} is not a CPLoadBalancingStrategy; expected one "
        f"of {[m.value for m in CPLoadBalancingStrategy]}") from None
