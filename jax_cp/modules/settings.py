"""The settings of the modules' layers that Linen and NNX validate alike:
MLP activations and norms, head counts, and the int codes of the
strategies a module records. Framework-neutral: no Flax import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_cp import checkpoint_names as names
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy

# The MLP activations: plain, and gated (``act(gate(x)) * up(x)``).
ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu,
               "silu": jax.nn.silu}
GATED = {"swiglu": jax.nn.silu, "geglu": jax.nn.gelu}
NORMS = ("rmsnorm", "layernorm")

# Int codes ``DotProductAttention`` sows into "intermediates" (strings cannot
# be sown): the position of the strategy in the enum.
STRATEGY_CODES: dict[CPLoadBalancingStrategy, int] = {
    s: i for i, s in enumerate(CPLoadBalancingStrategy)}


def strategy_from_code(code: Any) -> CPLoadBalancingStrategy:
  """Inverse of :data:`STRATEGY_CODES` (accepts a sown array)."""
  return list(CPLoadBalancingStrategy)[int(np.asarray(code).reshape(-1)[0])]


def num_kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
  """The number of key/value heads (default ``num_heads``).

  Raises:
    ValueError: it does not divide ``num_heads``.
  """
  kv = num_heads if num_kv_heads is None else num_kv_heads
  if kv < 1 or num_heads % kv:
    raise ValueError(f"num_kv_heads={kv} must divide num_heads={num_heads}")
  return kv


def head_features(features: int, num_heads: int,
                  head_dim: int | None) -> int:
  """``head_dim``, default ``features // num_heads``.

  Raises:
    ValueError: the result is not positive.
  """
  d = head_dim or features // num_heads
  if d < 1:
    raise ValueError(f"head_dim must be positive; got E={features} with "
                     f"num_heads={num_heads}")
  return d


def check_activation(activation: str) -> None:
  """Raises ValueError unless ``activation`` is an MLP activation."""
  if activation not in (*ACTIVATIONS, *GATED):
    raise ValueError(f"activation={activation!r} is not one of "
                     f"{[*ACTIVATIONS, *GATED]}")


def check_norm_type(norm_type: str) -> None:
  """Raises ValueError unless ``norm_type`` is one of :data:`NORMS`."""
  if norm_type not in NORMS:
    raise ValueError(f"norm_type={norm_type!r} is not one of {list(NORMS)}")


def mlp_hidden(activation: str, up: Callable, gate: Callable, pin: Callable):
  """An MLP block's hidden activations from its projections of the input,
  ``up()`` (and ``gate()`` for a gated activation, called only then), each
  passed through ``pin`` (:meth:`jax_cp.CPLayout.shard_tokens`) and named
  ``mlpwi`` (gated: ``mlpwi_0`` the gate, ``mlpwi_1`` the linear half)."""
  if activation in GATED:
    return (GATED[activation](checkpoint_name(pin(gate()), names.MLPWI_0))
            * checkpoint_name(pin(up()), names.MLPWI_1))
  return ACTIVATIONS[activation](checkpoint_name(pin(up()), names.MLPWI))
