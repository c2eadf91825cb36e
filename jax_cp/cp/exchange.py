"""How K/V travel between CP ranks, forward and backward (inside shard_map).

* ``all_gather``: every rank gets the whole row ``[T]``; DUAL_CHUNK_SWAP
  buffers are put back into sequence order with a gather. Gradients go back
  with the inverse gather and a reduce-scatter (``psum_scatter``).
* ``halo`` (NO_LOAD_BALANCE with a ``max_seqlen`` bound W or a sliding
  window ``(left, 0)``; docs/internals.md, Exchange): rank r needs only
  physical tokens ``[lo - halo, lo)``, ``halo = min(W-1, left)``, from its
  predecessors, ``ceil(halo/Tl)`` ``ppermute`` hops. The halo is all a call
  reads of it: the straddling document's keys before the chunk (its local
  keys are read from the local chunk). A halo of at most half a chunk is
  kept from the forward for the backward (:attr:`KVExchange.keeps_halo`).
  Gradients of the halo go back with the reverse permutes and are merged
  into the owners' rows in place (the backend's ``merge_rows``).
* ``ring`` (``CPLayout(comm_type="ring")``; docs/long_rows.md, Ring
  exchange): K|V chunks travel around the ring of ranks, one ``ppermute``
  hop per step, rank ``r`` holding at step ``s`` the chunk of rank ``(r -
  s) mod cp``; :mod:`jax_cp.cp.ring` attends each. DUAL_CHUNK_SWAP runs
  all ``cp`` steps; NO_LOAD_BALANCE with a bound W only ``1 + ceil((W-1)
  / Tl)`` (no query reaches further back). The backward sends a float32
  dK|dV accumulator along with each chunk and returns it to the chunk's
  owner with one last permute. Every buffer is one chunk.
* deterministic (:attr:`KVExchange.deterministic`): the all-gather's
  gradients go back with an all-to-all and are summed here, rank 0 first
  (:meth:`KVExchange.scatter`), instead of by the collective library in
  an order of its own; the halo and the ring sum in program order anyway
  (docs/determinism.md).
* ``none``: one rank (cp=1), the local chunk is the row; or NO_LOAD_BALANCE
  with a halo of 0 tokens (window ``(0, 0)``): the local chunk is all any
  query sees.

K and V travel together (concatenated on the head axis): one collective for
both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_cp.attention.decompose.merge import add, merge_rows_jnp
from jax_cp.cp.strategies import dual_chunk_swap


@dataclasses.dataclass(frozen=True)
class KVExchange:
  """Static description of the exchange (hashable).

  Attributes:
    kind: ``"none"``, ``"all_gather"``, ``"halo"`` or ``"ring"``.
    cp_axis: mesh axis name.
    cp_size: its size.
    total_tokens: T, tokens per row.
    restore_dual_chunk: all-gathered buffer is in DUAL_CHUNK_SWAP layout and
      must be put back into sequence order.
    halo_tokens: tokens received from predecessors (``kind == "halo"``).
    ring_steps: the ring's steps, the local one included (``kind ==
      "ring"``).
    deterministic: the deterministic mode: gradients are summed over the
      ranks in a fixed order (:meth:`_reduce_scatter`).
  """

  kind: str
  cp_axis: str | None
  cp_size: int
  total_tokens: int
  restore_dual_chunk: bool = False
  halo_tokens: int = 0
  ring_steps: int = 0
  deterministic: bool = False

  @property
  def local_tokens(self) -> int:
    return self.total_tokens // self.cp_size

  def buffer_start(self, rank):
    """Physical index of the first token of the exchanged buffer (the
    all-gathered row, or the received halo) on ``rank``."""
    if self.kind == "all_gather":
      return jnp.int32(0)
    lo = jnp.asarray(rank, jnp.int32) * self.local_tokens
    return lo - self.halo_tokens if self.kind == "halo" else lo

  def _hops(self):
    """(hop distance, tokens) from the farthest predecessor to the nearest."""
    tl, h = self.local_tokens, self.halo_tokens
    n = -(-h // tl)
    return [(j, tl if j < n else h - (n - 1) * tl) for j in range(n, 0, -1)]

  def _all_gather(self, x):
    """Tiled all-gather over the cp axis on the token axis (1)."""
    return jax.lax.all_gather(x, self.cp_axis, axis=1, tiled=True)

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

  def _permute(self, x, perm):
    return jax.lax.ppermute(x, self.cp_axis, perm)

  def _shift(self, x, hops: int):
    """``x`` of rank ``i`` to rank ``(i + hops) mod cp``."""
    cp = self.cp_size
    return self._permute(x, [(i, (i + hops) % cp) for i in range(cp)])

  # -------------------------------------------------------------------- ring

  def ring_next(self, x):
    """One ring step: rank ``i``'s buffer to rank ``i + 1`` (mod cp)."""
    assert self.kind == "ring", self.kind
    return self._shift(x, 1)

  def ring_home(self, x):
    """After the last step, the buffer rank ``r`` holds (the chunk of rank
    ``r - ring_steps + 1``, and its gradient) back to that rank."""
    assert self.kind == "ring", self.kind
    hops = (1 - self.ring_steps) % self.cp_size
    return x if hops == 0 else self._shift(x, hops)

  # ----------------------------------------------------------------- forward

  def gather(self, k, v, cu_seqlens_padded):
    """Local ``[B, Tl, Hkv, D]`` K and V -> exchanged buffers (all-gather;
    the halo exchange has :meth:`receive_halo` instead)."""
    assert self.kind != "halo", self.kind
    if self.kind == "none":
      return k, v
    hk = k.shape[2]
    kv = jnp.concatenate([k, v], axis=2)
    kv = self._all_gather(kv)
    if self.restore_dual_chunk:
      idx = dual_chunk_swap.gathered_to_sequence_index(
          cu_seqlens_padded, self.cp_size, self.total_tokens)
      kv = jnp.take_along_axis(kv, idx[:, :, None, None], axis=1)
    return kv[:, :, :hk], kv[:, :, hk:]

  def receive_halo(self, k, v):
    """Halo exchange: the ``halo_tokens`` K|V rows before this rank's chunk
    (``[B, halo, 2*Hkv, D]``, K heads first), from the predecessors."""
    assert self.kind == "halo", self.kind
    kv = jnp.concatenate([k, v], axis=2)
    tl = self.local_tokens
    pieces = []
    for hop, size in self._hops():
      perm = [(i, i + hop) for i in range(self.cp_size - hop)]
      pieces.append(self._permute(kv[:, tl - size:], perm))
    return jnp.concatenate(pieces, axis=1)

  @property
  def keeps_halo(self) -> bool:
    """Whether the forward keeps the received halo for the backward instead
    of exchanging it again: when it is at most half a chunk, so residual
    memory grows by at most half the local K/V. The backward then starts
    with the halo call and sends the halo's gradients back early."""
    return self.kind == "halo" and 0 < self.halo_tokens <= \
        self.local_tokens // 2

  # ----------------------------------------------------------------- backward

  def scatter(self, dk, dv, cu_seqlens_padded, into=(None, None),
              merge_rows=merge_rows_jnp):
    """Gradients w.r.t. the exchanged buffers -> gradients of the local
    chunk (summed over every rank that read it), added to ``into``.

    Args:
      dk, dv: ``[B, rows, Hkv, D]`` gradients of the exchanged K/V: the
        all-gathered row, or the received halo (``rows == halo_tokens``).
      into: local ``(dk, dv)`` gradients ``[B, Tl, Hkv, D]`` to add to (None:
        zeros).
      merge_rows: the backend's row merge; the halo's gradients come back
        as a few rows each and are merged in place.
    """
    into_k, into_v = into
    if self.kind == "none":
      return (dk if into_k is None else add(into_k, dk),
              dv if into_v is None else add(into_v, dv))
    hk = dk.shape[2]
    if self.kind == "all_gather":
      dkv = jnp.concatenate([dk, dv], axis=2)
      if self.restore_dual_chunk:
        pos = dual_chunk_swap.sequence_to_gathered_index(
            cu_seqlens_padded, self.cp_size, self.total_tokens)
        dkv = jnp.take_along_axis(dkv, pos[:, :, None, None], axis=1)
      dkv = self._reduce_scatter(dkv)
      back_k, back_v = dkv[:, :, :hk], dkv[:, :, hk:]
      return (back_k if into_k is None else add(into_k, back_k),
              back_v if into_v is None else add(into_v, back_v))
    tl = self.local_tokens
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


def choose_exchange(contiguous_chunks: bool, cp_axis, cp_size: int,
                    total_tokens: int, max_seqlen: int | None,
                    window_left: int = -1,
                    comm_type: str = "all_gather",
                    deterministic: bool = False) -> KVExchange:
  """The cheapest correct exchange for the layout, chosen statically.

  ``comm_type="ring"`` replaces the all-gather by the ring, and a halo of
  more than one chunk by the ring's steps that reach as far (a halo of
  one chunk or less is a single hop, which the ring cannot beat). With a
  sliding window NO_LOAD_BALANCE keeps the halo (the window bounds it;
  :func:`jax_cp.cp.validation.check_comm_type` rejects a window that
  reaches the whole row).

  NO_LOAD_BALANCE with a bound W moves ``W-1`` tokens per rank through
  ``ceil((W-1)/Tl)`` hops instead of ``(cp-1)*Tl``; when that reaches rank 0
  anyway (``W-1 >= (cp-1)*Tl``) the all-gather is used. A causal sliding
  window bounds the halo further, to ``min(W-1, window_left)``: no query
  looks further back.

  DUAL_CHUNK_SWAP all-gathers with or without a window. A windowed query
  chunk needs only the ``window_left`` tokens before it, but they are
  per-document tails of chunks spread over (up to) two other ranks, with
  sizes that depend on traced metadata; an exchange of static shape would
  send both neighbours' whole chunks (``2*Tl`` tokens per rank), which only
  beats the all-gather's ``(cp-1)*Tl`` at cp > 3. With a window,
  NO_LOAD_BALANCE is balanced by construction and needs only the halo, so
  it is the strategy to use (:func:`jax_cp.planning.recommend_strategy`
  says so).

  ``deterministic`` (the mode) sums the all-gather's gradients in a fixed
  order (:attr:`KVExchange.deterministic`); the choice is the same.
  """
  exchange = _choose(contiguous_chunks, cp_axis, cp_size, total_tokens,
                     max_seqlen, window_left, comm_type)
  if deterministic:
    exchange = dataclasses.replace(exchange, deterministic=True)
  return exchange


def _choose(contiguous_chunks: bool, cp_axis, cp_size: int, total_tokens: int,
            max_seqlen: int | None, window_left: int,
            comm_type: str) -> KVExchange:
  """:func:`choose_exchange` before the deterministic mode."""
  if cp_size == 1:
    return KVExchange("none", cp_axis, 1, total_tokens)
  tl = total_tokens // cp_size
  ring = comm_type == "ring"
  steps = cp_size
  if contiguous_chunks and max_seqlen is not None:
    halo = max(int(max_seqlen) - 1, 0)
    if window_left >= 0:
      halo = min(halo, window_left)
    if halo == 0:       # no query looks before its own token's chunk
      return KVExchange("none", cp_axis, cp_size, total_tokens)
    if halo < (cp_size - 1) * tl and (
        not ring or halo <= tl or window_left >= 0):
      return KVExchange("halo", cp_axis, cp_size, total_tokens,
                        halo_tokens=halo)
    steps = min(cp_size, 1 + -(-halo // tl))
  if ring:
    return KVExchange("ring", cp_axis, cp_size, total_tokens,
                      ring_steps=steps)
  return KVExchange("all_gather", cp_axis, cp_size, total_tokens,
                    restore_dual_chunk=not contiguous_chunks)
