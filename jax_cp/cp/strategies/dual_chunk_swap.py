"""DUAL_CHUNK_SWAP (docs/concepts.md, Strategies; docs/internals.md, Call
plans): document ``b`` of padded length ``P_b`` is cut into ``2*cp``
chunks of ``c_b = P_b / (2*cp)`` tokens; rank ``r`` holds chunks ``r`` and
``2*cp-1-r``, stored as ``[chunk r, chunk 2cp-1-r]`` from local offset
``cuP[b] / cp``. Two attention steps per rank, on the all-gathered row put
back into sequence order; with a sliding window the windowed plan
(:mod:`jax_cp.cp.strategies.dual_chunk_window`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.backend import Segments, row_segments
from jax_cp.attention.validation import concrete
from jax_cp.cp.strategies import calls
from jax_cp.cp.strategies import dual_chunk_window as window
from jax_cp.cp.strategies.base import (
  Strategy,
  contiguous_document_position,
  contiguous_index,
  drop_unseen,
)
from jax_cp.cp.strategies.calls import Block
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.cp.strategies.metadata import StepMetadata, lengths

# ------------------------------------------------------------ placement


def physical_index(xp, cu_seqlens_padded, cp_size: int, rank, t):
  """The physical index of local token ``t`` of ``rank``.

  ``cu_seqlens_padded`` is 1-D ``[N+1]``; ``t`` an int32 vector of local
  indices; ``rank`` a scalar or a vector like ``t`` (elementwise).
  """
  cuP = xp.asarray(cu_seqlens_padded).astype(xp.int32)
  cs = cuP // cp_size                                 # local doc starts
  # Last document whose local range starts at or before t. Empty documents
  # share their start with the next one, so "right" skips them.
  b = xp.searchsorted(cs, t, side="right").astype(xp.int32) - 1
  b = xp.clip(b, 0, cuP.shape[0] - 2)
  i = t - cs[b]
  chunk_len = xp.maximum((cs[b + 1] - cs[b]) // 2, 1)   # c_b
  chunk = xp.where(i < chunk_len, rank, 2 * cp_size - 1 - rank)
  return (cuP[b] + chunk * chunk_len + i % chunk_len).astype(xp.int32)


def gathered_index(cu_seqlens_padded, cp_size: int, total_tokens: int, p):
  """jnp, one row ``[N+1]``: for physical positions ``p``, the index of
  their tokens in the rank-ordered concatenation of the ranks' local
  buffers (rank ``g // Tl``, local token ``g % Tl``)."""
  local = total_tokens // cp_size
  cuP = cu_seqlens_padded.astype(jnp.int32)
  b = jnp.clip(jnp.searchsorted(cuP, p, side="right") - 1, 0,
               cuP.shape[0] - 2)
  j = p - cuP[b]
  c = jnp.maximum((cuP[b + 1] - cuP[b]) // (2 * cp_size), 1)
  chunk = j // c
  second = chunk >= cp_size
  owner = jnp.where(second, 2 * cp_size - 1 - chunk, chunk)
  t = cuP[b] // cp_size + jnp.where(second, c, 0) + j % c
  return (owner * local + t).astype(jnp.int32)


def gathered_to_sequence_index(cu_seqlens_padded, cp_size: int,
                               total_tokens: int):
  """jnp: for each physical position ``p`` of a row, the index into the
  rank-ordered all-gathered buffer that holds token ``p``.

  ``restored = gathered[idx]`` puts an all-gathered K/V back into sequence
  order; ``gathered_grad = restored_grad[perm]`` with ``perm`` the inverse
  goes the other way (see :func:`sequence_to_gathered_index`). Works on
  ``[N+1]`` or ``[B, N+1]`` metadata; traced values allowed.
  """
  p = jnp.arange(total_tokens, dtype=jnp.int32)
  one_row = lambda cuP: gathered_index(cuP, cp_size, total_tokens, p)
  cuP = jnp.asarray(cu_seqlens_padded)
  return one_row(cuP) if cuP.ndim == 1 else jax.vmap(one_row)(cuP)


def sequence_to_gathered_index(cu_seqlens_padded, cp_size: int,
                               total_tokens: int):
  """jnp: for each gathered index ``g`` (rank ``g // Tl``, local token
  ``g % Tl``), its physical position in the row (docs/internals.md,
  Exchange). ``[T]`` or ``[B, T]`` int32."""
  local = total_tokens // cp_size

  def one_row(cuP):
    g = jnp.arange(total_tokens, dtype=jnp.int32)
    return physical_index(jnp, cuP, cp_size, g // local, g % local)

  cuP = jnp.asarray(cu_seqlens_padded)
  return one_row(cuP) if cuP.ndim == 1 else jax.vmap(one_row)(cuP)


# ---------------------------------------------------------------- rules


def check_dual_chunk_divisible(cu_seqlens_padded, cp_size: int) -> None:
  """Every padded length divisible by ``2*cp`` (concrete metadata)."""
  cuP = concrete(cu_seqlens_padded)
  if cuP is None:
    return
  plens = np.diff(cuP.reshape(-1, cuP.shape[-1]), axis=-1)
  bad = np.argwhere(plens % (2 * cp_size) != 0)
  if bad.size:
    row, b = map(int, bad[0])
    raise ValueError(
        f"strategy=dual_chunk_swap needs every padded document "
        f"length divisible by 2*cp_size={2 * cp_size}; document {b} (row "
        f"{row}) has padded length {plens[row, b]}. Pad documents to a "
        f"multiple of {2 * cp_size}, or use NO_LOAD_BALANCE (any length).")


# ------------------------------------------------------------- metadata


def dual_chunk_swap_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank,
                         step: int, causal: bool = True) -> StepMetadata:
  """Step ``step`` (0: chunk ``r``, 1: chunk ``2cp-1-r``).

  ``q_len = clamp(L - k*c, 0, c)``, ``q_off = cuP/cp + step*c``,
  ``kv_len = min(L, (k+1)*c)`` (causal) or ``L`` (no mask),
  ``kv_off = cuP``.
  """
  if step not in (0, 1):
    raise ValueError(f"step must be 0 or 1, got {step}")
  lens, plens, starts = lengths(cu_seqlens, cu_seqlens_padded)
  rank = jnp.asarray(rank, jnp.int32)
  k = rank if step == 0 else 2 * cp_size - 1 - rank
  c = plens // (2 * cp_size)
  q_lens = jnp.clip(lens - k * c, 0, c)
  q_offsets = starts // cp_size + step * c
  kv_lens = jnp.minimum(lens, (k + 1) * c) if causal else lens
  return StepMetadata(q_lens, q_offsets, kv_lens, starts)


def ring_step(cu_seqlens, cu_seqlens_padded, cp_size: int, rank, step: int,
              causal: bool) -> tuple[StepMetadata, str]:
  """Ring step ``step`` (document chunks of ``c = L_padded / 2cp``
  tokens; this rank holds chunks ``r`` and ``2cp-1-r`` of each, ``qa``
  and ``qb`` valid rows, source ``src`` holds ``ka`` and ``kb``):

  * step 0: the local rows against themselves, top-left causal (the two
    chunks' positions rise with the local row);
  * ``src < r``: every row against chunk ``src`` (before both), unmasked;
  * ``src > r``: chunk ``2cp-1-r``'s rows against both of ``src``'s
    chunks (both before it), unmasked;
  * without a mask every step is all rows against all keys.

  ``q_len = kv_len = 0`` for a document that sees none of the chunk.
  """
  lens, plens, starts = lengths(cu_seqlens, cu_seqlens_padded)
  rank = jnp.asarray(rank, jnp.int32)
  cp = cp_size
  c = plens // (2 * cp)
  local = starts // cp
  src = rank if step == 0 else (rank - step) % cp
  held = lambda k: jnp.clip(lens - k * c, 0, c)
  qa, qb = held(rank), held(2 * cp - 1 - rank)
  ka, kb = held(src), held(2 * cp - 1 - src)
  if not causal:
    meta, mask = StepMetadata(qa + qb, local, ka + kb, local), "no_mask"
  elif step == 0:
    meta = StepMetadata(qa + qb, local, qa + qb, local)
    mask = "causal_top_left"
  else:
    earlier = src < rank
    meta = StepMetadata(jnp.where(earlier, qa + qb, qb),
                        jnp.where(earlier, local, local + c),
                        jnp.where(earlier, ka, ka + kb), local)
    mask = "no_mask"
  return drop_unseen(meta), mask


# ---------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class CompactCalls:
  """Windowed DUAL_CHUNK_SWAP's near and far calls over compact buffers.

  Attributes:
    rows: the index maps of the compact buffers.
    calls: ``(segments, mask)`` of each call over the compact Q and K/V
      buffers: the far part, top-left causal, and (with a window of 2 or
      more) the near part, unmasked.
  """

  rows: window.WindowRows
  calls: tuple[tuple[Segments, str], ...]


def _chunk_bound(cfg) -> int:
  """``c = ceil(W / 2cp)``, the longest chunk of a document."""
  return max(calls.ceil_div(cfg.max_seqlen, 2 * cfg.cp_size), 1)


def step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank) -> list[Block]:
  """One block per step, on the exchanged buffer: each Q chunk holds
  ``c = W / 2cp`` tokens of a document."""
  w, cp = cfg.max_seqlen, cfg.cp_size
  c = _chunk_bound(cfg)
  blocks = []
  for step in (0, 1):
    m = dual_chunk_swap_step(cu_seqlens, cu_seqlens_padded, cp, rank, step,
                             cfg.causal)
    if cfg.causal:
      # Step 0 sees at most chunks 0..r <= cp-1, step 1 the whole document.
      blocks.append(Block(m, "causal_bottom_right", c,
                          min(w, cp * c) if step == 0 else w, True))
    else:
      blocks.append(Block(m, "no_mask", c, w, True))
  return blocks


def window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank) -> list:
  """With a sliding window, the same calls each way, none bottom-right
  (:func:`window.split_windowed_block`; docs/internals.md, Call plans):

  * ``diag``: both steps' chunks against their own keys, the top-left
    band, on the exchanged buffer (the first call: it makes out/lse, dq);
  * ``near``: unmasked, each chunk's rows against its nearest ``b`` keys
    before it;
  * ``far``: top-left causal, its first ``min(q, left)`` rows in reverse
    order against the next ``f`` keys in reverse order.

  ``near`` and ``far`` run over compact buffers that hold, per (step,
  document), the rows and keys they need (:func:`window.window_compaction`),
  so no two segments share a KV row and each runs as one backward call;
  their results are merged by log-sum-exp (forward) or summed (backward)
  into the diagonal's. Bounds, with ``c = ceil(W / 2cp)`` the longest
  chunk: ``diag`` ``c x c``, ``near`` ``min(left, c)`` rows against at
  most ``left - 1`` keys, ``far`` ``min(left, c)`` each way. With a
  window of 0 the diagonals alone run; with 1 no key is near."""
  cp, left = cfg.cp_size, cfg.window_left
  c = _chunk_bound(cfg)
  steps = tuple(dual_chunk_swap_step(cu_seqlens, cu_seqlens_padded, cp,
                                     rank, step)
                for step in (0, 1))
  tl, t = cfg.local_tokens, cfg.total_tokens
  diag = calls.merge_blocks([
      Block(window.split_windowed_block(m, left, tl, t)[0],
            "causal_top_left", c, c, True) for m in steps])
  plan = [calls.rows_call(cfg, diag, into=False)]
  if left == 0:
    return plan
  sq, skv = window.window_compaction_sizes(
      cu_seqlens_padded.shape[-1] - 1, cp, left, c, tl, t)
  near, far, rows = window.window_compaction(
      steps, cu_seqlens_padded, cp, left, tl, t, sq, skv)
  rows_q = max(min(left, c), 1)

  def segments(m, max_kv):
    return row_segments(m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets, sq,
                        skv, rows_q, max_kv, rows_see_keys=True,
                        heaviest_first=True)

  compact = [(segments(far, rows_q), "causal_top_left")]
  if left > 1:
    compact.insert(0, (segments(near, max(min(left - 1, (2 * cp - 1) * c),
                                          1)), "no_mask"))
  return plan + [CompactCalls(rows, tuple(compact))]


class DualChunkSwap(Strategy):
  """DUAL_CHUNK_SWAP: two chunks per document per rank, balanced causal
  work; every padded length a multiple of ``2*cp``."""

  member = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP
  contiguous_chunks = False

  def physical_index(self, xp, cu_seqlens_padded, cp_size, rank, t,
                     local_tokens):
    if cp_size == 1:      # one rank holds the row in order
      return contiguous_index(xp, rank, t, local_tokens)
    return physical_index(xp, cu_seqlens_padded, cp_size, rank, t)

  def document_position(self, cu_seqlens_padded, cp_size, rank, t,
                        local_tokens):
    if cp_size == 1:
      return contiguous_document_position(cu_seqlens_padded, rank, t,
                                          local_tokens)
    # The document's local range, as physical_index finds it.
    cuP = cu_seqlens_padded
    cs = cuP // cp_size
    b = jnp.clip(jnp.searchsorted(cs, t, side="right") - 1, 0,
                 cuP.shape[0] - 2)
    i = t - cs[b]
    c = jnp.maximum((cs[b + 1] - cs[b]) // 2, 1)
    chunk = jnp.where(i < c, rank, 2 * cp_size - 1 - rank)
    return b, chunk * c + i % c

  def holds_row_in_order(self, cp_size):
    return cp_size == 1

  def gathered_to_sequence_index(self, cu_seqlens_padded, cp_size,
                                 total_tokens):
    return gathered_to_sequence_index(cu_seqlens_padded, cp_size,
                                      total_tokens)

  def gathered_index(self, cu_seqlens_padded, cp_size, total_tokens, p):
    return gathered_index(cu_seqlens_padded, cp_size, total_tokens, p)

  def sequence_to_gathered_index(self, cu_seqlens_padded, cp_size,
                                 total_tokens):
    return sequence_to_gathered_index(cu_seqlens_padded, cp_size,
                                      total_tokens)

  def pad_multiple(self, cp_size):
    return 2 * int(cp_size)

  def check_padded_lengths(self, cu_seqlens_padded, cp_size):
    if cp_size > 1:
      check_dual_chunk_divisible(cu_seqlens_padded, cp_size)

  def spans_padded_slots(self, cp_size):
    # Every slot is cut into 2*cp chunks of its padded length, so the
    # kernels' bounds hold padded lengths.
    return cp_size > 1

  def check_mask(self, attn_mask_type):
    return None

  def check_ring_window(self, window_left, cp_size, total_tokens):
    raise ValueError(
        "comm_type='ring' takes no window_size under strategy="
        "dual_chunk_swap; with a sliding window use strategy="
        "no_load_balance, whose halo exchange moves only the window's keys")

  def window_within_bound(self, window_left, max_seqlen):
    # No document is longer than the window: plain causal.
    return -1 if window_left >= max_seqlen - 1 else window_left

  def program_sized_by_bound(self, cfg, unbounded):
    # The windowed plan's compact buffers are sized by the chunk bound.
    return unbounded.window_left >= 0

  def forward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank):
    """Both steps as one call: their Q rows are disjoint and a forward
    may read the same KV rows from several segments; with a window the
    windowed plan (:func:`window_calls`)."""
    if cfg.window_left >= 0:
      return window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
    blocks = step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank)
    return calls.in_order(cfg, [calls.merge_blocks(blocks)])

  def backward_plan(self, cfg, cu_seqlens, cu_seqlens_padded, rank):
    """One call per step (the steps read overlapping KV rows, chunks
    ``0..r`` of every document), bottom-right blocks split where the
    backend prefers it (:func:`jax_cp.cp.strategies.calls.backward_calls`; the
    triangles, chunk ``r`` against chunk ``2cp-1-r``, do not overlap);
    with a window the windowed plan."""
    if cfg.window_left >= 0:
      return window_calls(cfg, cu_seqlens, cu_seqlens_padded, rank)
    return calls.backward_calls(
        cfg, step_blocks(cfg, cu_seqlens, cu_seqlens_padded, rank))

  def ring_step(self, cu_seqlens, cu_seqlens_padded, cp_size, rank, step,
                *, causal, total_tokens):
    return ring_step(cu_seqlens, cu_seqlens_padded, cp_size, rank, step,
                     causal)

  def ring_bound(self, cfg, step):
    # A document puts at most 2c rows of either side in the call.
    return 2 * _chunk_bound(cfg)
