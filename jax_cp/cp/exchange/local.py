"""No exchange (``kind="none"``): one rank (cp = 1), or NO_LOAD_BALANCE
with a halo of 0 tokens (window ``(0, 0)``): the local chunk is all any
query sees."""

from __future__ import annotations

import dataclasses

from jax_cp.cp.exchange.base import KVExchange, added


@dataclasses.dataclass(frozen=True)
class Local(KVExchange):
  """The local chunk is the exchanged buffer."""

  kind = "none"
  moves_kv = False

  @property
  def buffer_rows(self) -> int:
    return self.local_tokens

  def received_tokens(self, rank):
    return 0

  def rows_before_chunk(self, window_left, max_seqlen):
    return 0

  def buffer_start(self, rank):
    return rank * self.local_tokens

  def receive(self, k, v, cu_seqlens_padded):
    return (k, v), None

  def scatter(self, dk, dv, cu_seqlens_padded, into=(None, None),
              merge_rows=None):
    return added(into, dk, dv)
