"""The all-gather (``comm_type="all_gather"``): every rank gets the whole
row ``[T]``, put back into sequence order by the strategy's placement
(DUAL_CHUNK_SWAP: a gather; contiguous chunks are in order). Gradients go
back with the inverse gather and a reduce-scatter; in the deterministic
mode with an all-to-all and a sum in rank order (docs/determinism.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_cp.cp.exchange.base import KVExchange, added
from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy


@dataclasses.dataclass(frozen=True)
class AllGather(KVExchange):
  """Attributes (beyond :class:`KVExchange`'s):
    strategy: the token placement of the gathered chunks.
  """

  strategy: CPLoadBalancingStrategy = \
      CPLoadBalancingStrategy.NO_LOAD_BALANCE

  kind = "all_gather"
  gathers_row = True

  @classmethod
  def of_row(cls, strategy, steps, **common):
    return cls(strategy=strategy, **common)

  def _reorders(self) -> bool:
    return not strategy_for(self.strategy).contiguous_chunks

  def receive(self, k, v, cu_seqlens_padded):
    hk = k.shape[2]
    kv = jax.lax.all_gather(jnp.concatenate([k, v], axis=2), self.cp_axis,
                            axis=1, tiled=True)
    if self._reorders():
      idx = strategy_for(self.strategy).gathered_to_sequence_index(
          cu_seqlens_padded, self.cp_size, self.total_tokens)
      kv = jnp.take_along_axis(kv, idx[:, :, None, None], axis=1)
    return (kv[:, :, :hk], kv[:, :, hk:]), None

  def _reduce_scatter(self, x):
    """Tiled sum-scatter over the cp axis on the token axis (1). In the
    deterministic mode an all-to-all brings every rank's share of this
    rank's chunk here, and they are added rank 0 first, in float32: the
    same sum, in an order that is the program's, not the collective
    library's."""
    if not self.deterministic:
      return jax.lax.psum_scatter(x, self.cp_axis, scatter_dimension=1,
                                  tiled=True)
    cp, tl = self.cp_size, x.shape[1] // self.cp_size
    parts = x.reshape(x.shape[:1] + (cp, tl) + x.shape[2:])
    # parts[:, j] afterwards: rank j's gradient of this rank's chunk.
    parts = jax.lax.all_to_all(parts, self.cp_axis, split_axis=1,
                               concat_axis=1, tiled=True)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    total = parts[:, 0].astype(wide)
    for j in range(1, cp):
      total = total + parts[:, j].astype(wide)
    return total.astype(x.dtype)

  def scatter(self, dk, dv, cu_seqlens_padded, into=(None, None),
              merge_rows=None):
    hk = dk.shape[2]
    dkv = jnp.concatenate([dk, dv], axis=2)
    if self._reorders():
      pos = strategy_for(self.strategy).sequence_to_gathered_index(
          cu_seqlens_padded, self.cp_size, self.total_tokens)
      dkv = jnp.take_along_axis(dkv, pos[:, :, None, None], axis=1)
    dkv = self._reduce_scatter(dkv)
    return added(into, dkv[:, :, :hk], dkv[:, :, hk:])
