"""NO_LOAD_BALANCE (docs/concepts.md, Strategies; docs/internals.md, Call
plans): rank ``r`` holds physical tokens ``[r*T/cp, (r+1)*T/cp)``, and
documents may straddle ranks. One step per rank: the documents inside the
chunk need only local K/V, the one straddling document per row also its
keys before the chunk (the halo call,
:mod:`jax_cp.attention.decompose.straddle`).
Causal attention only."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cp.attention.decompose import straddle
from jax_cp.cp.strategies import calls
from jax_cp.cp.strategies.base import (
  Strategy,
  contiguous_document_position,
  contiguous_index,
  drop_unseen,
)
from jax_cp.cp.strategies.calls import Block
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.cp.strategies.metadata import (
  StepMetadata,
  contiguous_chunk,
  lengths,
)

# ------------------------------------------------------------- metadata


def no_load_balance_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                         total_tokens: int) -> StepMetadata:
  """The one step of rank ``r`` (causal only): the
  :func:`~jax_cp.cp.strategies.metadata.contiguous_chunk` of tokens
  ``[r*Tl, (r+1)*Tl)``."""
  local = total_tokens // cp_size
  return contiguous_chunk(cu_seqlens, cu_seqlens_padded,
                          jnp.asarray(rank, jnp.int32) * local, local)


def no_load_balance_split(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                          total_tokens: int, exchanged_start
                          ) -> tuple[StepMetadata, StepMetadata]:
  """The step of rank ``r``, cut by where K/V come from.

  With ``lo = r*Tl``, a document that starts at or after ``lo`` sees only
  K/V of this rank: its Q and KV lengths agree (top-left == bottom-right
  causal), and it needs nothing from other ranks. At most one document per
  row starts before ``lo`` and reaches into the chunk (it *straddles* the
  boundary); only it needs remote K/V.

  Returns ``(local, straddle)``:

  * ``local`` ``[..., N]``: Q and KV offsets both index the *local* chunk.
  * ``straddle`` ``[..., 1]``: the straddling document (lengths 0 if none),
    Q offset 0 in the local chunk, KV offset into an exchanged buffer that
    holds physical tokens from ``exchanged_start`` on (0 for an all-gather,
    ``lo - halo`` for a halo exchange), bottom-right causal. A KV range
    that would start before the buffer is cut to the buffer: with a halo
    bounded by a sliding window the cut rows lie outside every query's
    window (otherwise only a document longer than the ``max_seqlen`` bound
    the buffer was sized by reaches there).
  """
  full = no_load_balance_step(cu_seqlens, cu_seqlens_padded, cp_size, rank,
                              total_tokens)
  lo = jnp.asarray(rank, jnp.int32) * (total_tokens // cp_size)
  starts = full.kv_offsets
  inside = (starts >= lo) & (full.q_lens > 0)
  rel = jnp.where(inside, starts - lo, 0)
  q_local = jnp.where(inside, full.q_lens, 0)
  local = StepMetadata(q_local, rel, q_local, rel)

  crossing = (starts < lo) & (full.q_lens > 0)
  has = crossing.any(axis=-1, keepdims=True)
  idx = jnp.argmax(crossing, axis=-1)[..., None]
  pick = lambda x: jnp.where(has, jnp.take_along_axis(x, idx, axis=-1), 0)
  q_len, kv_len, start = pick(full.q_lens), pick(full.kv_lens), pick(starts)
  kv_off = start - jnp.asarray(exchanged_start, jnp.int32)
  cut = jnp.maximum(-kv_off, 0)            # before the buffer (see above)
  straddle = StepMetadata(q_len, jnp.zeros_like(q_len),
                          jnp.where(has, kv_len - cut, 0),
                          jnp.maximum(kv_off, 0))
  return local, straddle


def ring_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank, step: int,
              total_tokens: int) -> tuple[StepMetadata, str]:
  """Ring step ``step`` (causal): step 0 is the chunk's local call (each
  document's rows against its own rows in the chunk, top-left); a later
  step serves only the document that straddles into the chunk from
  before it (``[B, 1]``), its rows against its keys in chunk ``src = r -
  step`` (none when that wraps past rank 0), unmasked, with ``q_len =
  kv_len = 0`` where it sees none of them."""
  lens, _, starts = lengths(cu_seqlens, cu_seqlens_padded)
  rank = jnp.asarray(rank, jnp.int32)
  tl = total_tokens // cp_size
  lo = rank * tl
  chunk = contiguous_chunk(cu_seqlens, cu_seqlens_padded, lo, tl)
  if step == 0:
    return StepMetadata(chunk.q_lens, chunk.q_offsets, chunk.q_lens,
                        chunk.q_offsets), "causal_top_left"
  crossing = (starts < lo) & (chunk.q_lens > 0)
  has = crossing.any(axis=-1, keepdims=True)
  idx = jnp.argmax(crossing, axis=-1)[..., None]
  pick = lambda x: jnp.where(has, jnp.take_along_axis(x, idx, axis=-1), 0)
  q, start, n = pick(chunk.q_lens), pick(starts), pick(lens)
  src_lo = (rank - step) * tl
  first = jnp.maximum(start, src_lo)
  kv = jnp.where(has & (rank >= step),
                 jnp.maximum(jnp.minimum(start + n, src_lo + tl) - first,
                             0), 0)
  meta = StepMetadata(q, jnp.zeros_like(q), kv, first - src_lo)
  return drop_unseen(meta), "no_mask"


# ---------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class HaloCall:
  """NO_LOAD_BALANCE's halo call (:mod:`jax_cp.attention.decompose.straddle`).

  Attributes:
    call: the halo call.
    before_chunk: None: K/V are the exchanged buffer as it is (the
      received halo, or the all-gathered row with the segments' offsets
      into it); else the ``before_chunk`` rows right before the chunk (the
      received halo, or those rows cut from the all-gathered row), which a
      reversed call needs.
  """

  call: straddle.HaloCall
  before_chunk: int | None


def rows_before_chunk(cfg) -> int:
  """``H``, the rows before the chunk that a windowed query can see: the
  received halo, or with an all-gather the last ``min(left, max_seqlen -
  1, rows before the last chunk)`` of them."""
  return cfg.exchange.rows_before_chunk(cfg.window_left, cfg.max_seqlen)


def split_straddle(cfg, block: Block) -> tuple[Block, HaloCall | None]:
  """The straddle block (bottom-right, cut to the window if there is
  one) split where the chunk starts (docs/internals.md, Call plans): its
  local keys as a top-left block on the document's local rows, which
  becomes a segment of the chunk's local call, and its keys before the
  chunk as the halo call (:mod:`jax_cp.attention.decompose.straddle`):

  - a rectangle when every one of the document's rows sees all of them
    (no window, or ``left - Tl >= H - 1``), on the exchanged buffer (the
    received halo alone when there is one);
  - else reversed: halo row ``m`` is at chunk position ``m - H`` and Q
    row ``i`` sees it when ``m >= i + H - left``; over the first ``left``
    local rows with both axes reversed that is plain top-left causal.

  Returns ``(local block, halo call)``; no halo call when nothing lies
  before the chunk."""
  tl, left = cfg.local_tokens, cfg.window_left
  m = block.meta
  q_doc = m.q_lens                                  # [B, 1]
  zero = jnp.zeros_like(q_doc)
  local = Block(StepMetadata(q_doc, zero, q_doc, zero),
                "causal_top_left", block.max_q, block.max_q, False)
  if not cfg.exchange.moves_kv:
    return local, None
  halo = rows_before_chunk(cfg)
  keys = jnp.where(q_doc > 0, m.kv_lens - q_doc, 0)[..., 0]
  if left < 0 or left - tl >= halo - 1:
    rows = min(block.q_rows if block.q_rows is not None else tl, tl)
    call = straddle.halo_call(
        q_doc[..., 0], keys, m.kv_offsets[..., 0], rows=rows,
        kv_tokens=calls.kv_tokens(cfg, True), max_kv=block.max_kv,
        reversed=False)
    return local, HaloCall(call, None)
  call = straddle.halo_call(q_doc[..., 0], keys, None, rows=left,
                            kv_tokens=halo, max_kv=halo, reversed=True)
  return local, HaloCall(call, halo)


def step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank) -> list[Block]:
  """The step as two blocks, before the window cut: the documents inside
  the chunk need only local K/V (and can run while the exchange is in
  flight), one top-left block; the one straddling document per row needs
  the exchanged buffer, one bottom-right block (:func:`split_straddle`
  splits it further). It reaches at most W-1 tokens into the chunk, so it
  only needs the first W-1 Q rows: small calls for short documents."""
  w, tl = cfg.max_seqlen, cfg.local_tokens
  local, straddling = no_load_balance_split(
      cu_seqlens, cu_seqlens_padded, cfg.cp_size, rank, cfg.total_tokens,
      cfg.exchange.buffer_start(rank))
  bound = min(w, tl)
  q_rows = min(max(w - 1, 1), tl)
  return [Block(local, "causal_top_left", bound, bound, False),
          Block(straddling, "causal_bottom_right", q_rows, w, True,
                q_rows=q_rows if q_rows < tl else None)]


def _plan_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank
                 ) -> tuple[list[Block], HaloCall | None]:
  """The local block, its straddling document's local part the first of
  its segments (same mask and K/V, other rows), and the halo call (None
  when nothing lies before the chunk); cut to the sliding window."""
  local, straddling = [
      calls.cut_to_window(b, cfg.window_left)
      for b in step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)]
  straddle_local, halo = split_straddle(cfg, straddling)
  # A chunk inside one document (its local rows that document's alone) is
  # a tiled call over the local K/V: the device tells (Tiled calls).
  merged = calls.merge_blocks([straddle_local, local])
  return [dataclasses.replace(merged, may_tile=cfg.causal)], halo


class NoLoadBalance(Strategy):
  """NO_LOAD_BALANCE: one contiguous chunk per rank, any document length,
  causal only; a bound or a window exchanges only the halo."""

  member = CPLoadBalancingStrategy.NO_LOAD_BALANCE
  contiguous_chunks = True

  def physical_index(self, xp, cu_seqlens_padded, cp_size, rank, t,
                     local_tokens):
    return contiguous_index(xp, rank, t, local_tokens)

  def document_position(self, cu_seqlens_padded, cp_size, rank, t,
                        local_tokens):
    return contiguous_document_position(cu_seqlens_padded, rank, t,
                                        local_tokens)

  def holds_row_in_order(self, cp_size):
    return True

  def gathered_to_sequence_index(self, cu_seqlens_padded, cp_size,
                                 total_tokens):
    return _identity(cu_seqlens_padded, total_tokens)

  def sequence_to_gathered_index(self, cu_seqlens_padded, cp_size,
                                 total_tokens):
    return _identity(cu_seqlens_padded, total_tokens)

  def pad_multiple(self, cp_size):
    return 1

  def check_padded_lengths(self, cu_seqlens_padded, cp_size):
    return None

  def spans_padded_slots(self, cp_size):
    # A query reads back only over its document's valid tokens.
    return False

  def check_mask(self, attn_mask_type):
    if attn_mask_type != "causal":
      raise ValueError(
          f"strategy=no_load_balance needs causal attention, got "
          f"attn_mask_type={attn_mask_type!r}")

  def check_ring_window(self, window_left, cp_size, total_tokens):
    reach = (cp_size - 1) * (total_tokens // cp_size)
    if window_left >= reach:
      raise ValueError(
          f"comm_type='ring' with window_size=({window_left}, 0) under "
          f"strategy=no_load_balance needs a left window below (cp-1) * "
          f"T/cp = {reach} tokens (a window that reaches the whole row "
          "exchanges all of it: use comm_type='all_gather')")

  def window_within_bound(self, window_left, max_seqlen):
    return window_left

  def program_sized_by_bound(self, cfg, unbounded):
    # The halo call reads the first min(W-1, Tl) rows.
    return cfg.max_seqlen - 1 < cfg.local_tokens

  def forward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank):
    """The chunk's local call, then the halo call, so the local call
    hides the exchange; the halo call's rows are merged into the local
    call's by log-sum-exp."""
    blocks, halo = _plan_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)
    return calls.in_order(cfg, blocks) + ([] if halo is None else [halo])

  def backward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank):
    """The halo call first, so the halo's gradients travel back while the
    local call runs."""
    blocks, halo = _plan_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)
    return (([] if halo is None else [halo])
            + calls.backward_calls(cfg, blocks))

  def ring_step(self, cu_seqlens, cu_seqlens_padded, cp_size, rank, step,
                *, causal, total_tokens):
    return ring_step(cu_seqlens, cu_seqlens_padded, cp_size, rank, step,
                     total_tokens)

  def ring_bound(self, cfg, step):
    # The local call at most min(W, Tl) rows, a later step's straddling
    # document at most min(W - 1, Tl).
    w, tl = cfg.max_seqlen, cfg.local_tokens
    return min(w, tl) if step == 0 else max(min(w - 1, tl), 1)


def _identity(cu_seqlens_padded, total_tokens: int):
  """The row order itself, ``[T]`` or ``[B, T]``."""
  idx = jnp.arange(total_tokens, dtype=jnp.int32)
  shape = jnp.shape(cu_seqlens_padded)[:-1] + (total_tokens,)
  return jnp.broadcast_to(idx, shape)
