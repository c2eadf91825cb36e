"""The halo (NO_LOAD_BALANCE with a ``max_seqlen`` bound W or a sliding
window ``(left, 0)``; docs/internals.md, Exchange): rank r needs only the
physical tokens ``[lo - halo, lo)``, ``halo = min(W-1, left)``, from its
predecessors, in ``ceil(halo/Tl)`` ``ppermute`` hops. The halo is all a
call reads of it: the straddling document's keys before the chunk. A halo
of at most half a chunk is kept from the forward for the backward
(:attr:`Halo.keeps_halo`). Gradients of the halo go back with the
reverse permutes and are merged into the owners' rows in place (the
backend's ``merge_rows``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cp.attention.decompose.merge import merge_rows_jnp
from jax_cp.cp.exchange.base import KVExchange


@dataclasses.dataclass(frozen=True)
class Halo(KVExchange):
  """Attributes (beyond :class:`KVExchange`'s):
    halo_tokens: the tokens received from the predecessors.
  """

  halo_tokens: int = 0

  kind = "halo"

  @property
  def buffer_rows(self) -> int:
    return self.halo_tokens

  def received_tokens(self, rank):
    # The hops bring the predecessors' last tokens; rank r has r * Tl.
    return min(self.halo_tokens, int(rank) * self.local_tokens)

  def rows_before_chunk(self, window_left, max_seqlen):
    return self.halo_tokens

  def buffer_start(self, rank):
    return jnp.asarray(rank, jnp.int32) * self.local_tokens - \
        self.halo_tokens

  @property
  def keeps_halo(self) -> bool:
    """When the halo is at most half a chunk, so residual memory grows by
    at most half the local K/V: the backward then starts with the halo
    call and sends the halo's gradients back early."""
    return 0 < self.halo_tokens <= self.local_tokens // 2

  def _hops(self):
    """(hop distance, tokens) from the farthest predecessor to the nearest."""
    tl, h = self.local_tokens, self.halo_tokens
    n = -(-h // tl)
    return [(j, tl if j < n else h - (n - 1) * tl) for j in range(n, 0, -1)]

  def receive(self, k, v, cu_seqlens_padded):
    kv = jnp.concatenate([k, v], axis=2)
    tl = self.local_tokens
    pieces = []
    for hop, size in self._hops():
      perm = [(i, i + hop) for i in range(self.cp_size - hop)]
      pieces.append(self._permute(kv[:, tl - size:], perm))
    return None, jnp.concatenate(pieces, axis=1)

  def scatter(self, dk, dv, cu_seqlens_padded, into=(None, None),
              merge_rows=merge_rows_jnp):
    into_k, into_v = into
    hk, tl = dk.shape[2], self.local_tokens
    assert dk.shape[1] == self.halo_tokens, (dk.shape, self.halo_tokens)
    shape = dk.shape[:1] + (tl,) + dk.shape[2:]
    out_k = jnp.zeros(shape, dk.dtype) if into_k is None else into_k
    out_v = jnp.zeros(shape, dv.dtype) if into_v is None else into_v
    start = 0
    for hop, size in self._hops():
      piece = jnp.concatenate([dk[:, start:start + size],
                               dv[:, start:start + size]], axis=2)
      start += size
      perm = [(i + hop, i) for i in range(self.cp_size - hop)]
      back = self._permute(piece, perm)
      # The last `size` rows of this rank's chunk, read by a successor.
      out_k = merge_rows(out_k, back[:, :, :hk], tl - size, "add")
      out_v = merge_rows(out_v, back[:, :, hk:], tl - size, "add")
    return out_k, out_v
