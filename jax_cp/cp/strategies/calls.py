"""The calls of a CP call plan and the blocks they are built from, shared
by every strategy (docs/internals.md, Call plans).

A plan is built from :class:`Block` s (per-document metadata with a mask,
static bounds and a K/V source) and turned into calls, each with its
backend segments ready. :class:`RowsCall` is the call every plan runs;
each strategy adds its own kinds (:mod:`jax_cp.cp.strategies`). The
functions here take the call's :class:`jax_cp.cp.config.CPConfig` as
``cfg`` and read only its static fields. :func:`whole_row_plan` is the
plan of one rank (cp = 1), where every strategy holds the row in order.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_cp.attention.backend import Segments, row_segments
from jax_cp.attention.mask import AttentionMask
from jax_cp.cp.strategies.metadata import (
  StepMetadata,
  contiguous_chunk,
  split_bottom_right,
)


@dataclasses.dataclass(frozen=True)
class RowsCall:
  """A call on this rank's local Q rows.

  Attributes:
    segments: the backend's segments over the ``B * Tl`` local Q rows and
      the K/V buffer's rows.
    mask: the backend mask.
    window_left: the band the call runs with (-1: none).
    exchanged: K/V are the exchanged buffer (else the local chunk).
    into: the call writes its rows into the outputs of the calls before it
      (forward: ``out``/``lse``; backward: ``dq``), in place, by the
      backend's in-place writes; otherwise its outputs are added (``lse``
      by maximum). The first call of a plan makes the outputs.
  """

  segments: Segments
  mask: str
  window_left: int
  exchanged: bool
  into: bool = False


@dataclasses.dataclass(frozen=True)
class Block:
  """A call while the plan is built: per-document metadata ``[B, n]``, the
  mask, the static bounds, the K/V source, ``q_rows`` (the block's
  segments lie in the first ``q_rows`` local rows; None: anywhere), and
  whether its segments tile the rows (``tiled``) or may, by the traced
  metadata (``may_tile``: docs/internals.md, Tiled calls)."""

  meta: StepMetadata
  mask: str
  max_q: int
  max_kv: int
  exchanged: bool
  q_rows: int | None = None
  tiled: bool = False
  may_tile: bool = False


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def kv_tokens(cfg, exchanged: bool) -> int:
  """The rows of a call's K/V buffer: the local chunk, the received halo,
  or the all-gathered row."""
  return cfg.exchange.buffer_rows if exchanged else cfg.local_tokens


def _window_left(cfg, block: Block) -> int:
  """The band a block runs with: the config's window on a causal block,
  none on an unmasked one."""
  return cfg.window_left if AttentionMask(block.mask).causal else -1


def rows_call(cfg, block: Block, into: bool) -> RowsCall:
  """The call of ``block``."""
  m = block.meta
  seg = row_segments(m.q_lens, m.kv_lens, m.q_offsets, m.kv_offsets,
                     cfg.local_tokens, kv_tokens(cfg, block.exchanged),
                     block.max_q, block.max_kv, rows_see_keys=True,
                     tiled=block.tiled, heaviest_first=True,
                     may_tile=block.may_tile and not into)
  return RowsCall(seg, block.mask, _window_left(cfg, block), block.exchanged,
                  into)


def in_order(cfg, blocks: list[Block]) -> list[RowsCall]:
  """Blocks of disjoint Q rows as calls: the first makes the outputs,
  each later one writes into them where the backend writes in place."""
  in_place = cfg.backend.supports_in_place
  return [rows_call(cfg, b, into=in_place and i > 0)
          for i, b in enumerate(blocks)]


def _bounded_max_kv(max_q: int, max_kv: int, window_left: int) -> int:
  """The KV bound of a bottom-right block cut to its window
  (:func:`cut_to_window`): at most ``q_len + window_left`` KV rows."""
  return max_kv if window_left < 0 else min(max_kv, max_q + window_left)


def cut_to_window(block: Block, window_left: int) -> Block:
  """A bottom-right block without the KV rows before the window of its
  first Q row: Q row 0 sees KV rows from ``kv_len - q_len - window_left``
  on, and later rows from further on, so nothing before that is read. The
  cut keeps the bottom-right alignment (the last Q row still meets the
  last KV row) and leaves ``kv_len >= q_len``; it shrinks the kernel's KV
  range to ``q_len + window_left`` rows."""
  if window_left < 0 or not AttentionMask(block.mask).bottom_right:
    return block
  m = block.meta
  skip = jnp.where(m.q_lens > 0,
                   jnp.maximum(m.kv_lens - m.q_lens - window_left, 0), 0)
  meta = m._replace(kv_lens=m.kv_lens - skip, kv_offsets=m.kv_offsets + skip)
  return dataclasses.replace(
      block, meta=meta,
      max_kv=_bounded_max_kv(block.max_q, block.max_kv, window_left))


def merge_blocks(blocks: list[Block]) -> Block:
  """One block running the segments of several blocks of the same mask.

  Their Q rows must be disjoint (those of any two CP blocks are, except a
  split block's rectangle and its triangle). For a backward call their KV
  rows must be disjoint too: a fused kernel writes dK/dV per segment, it
  does not accumulate them. The bounds are the largest of the blocks'."""
  first = blocks[0]
  if len(blocks) == 1:
    return first
  for b in blocks:
    if ((b.mask, b.exchanged) != (first.mask, first.exchanged)
        or b.q_rows is not None):
      raise ValueError(
          "cannot merge blocks: they must share the mask and the K/V source "
          "and have no row limit; got masks "
          f"{[x.mask for x in blocks]}, exchanged "
          f"{[x.exchanged for x in blocks]}")
  meta = StepMetadata(*(
      jnp.concatenate([getattr(b.meta, f) for b in blocks], axis=-1)
      for f in StepMetadata._fields))
  return dataclasses.replace(first, meta=meta,
                             max_q=max(b.max_q for b in blocks),
                             max_kv=max(b.max_kv for b in blocks))


def backward_calls(cfg, blocks: list[Block]) -> list[RowsCall]:
  """The calls of a backward over ``blocks`` (in forward order): in
  reverse order, bottom-right blocks split into an unmasked rectangle
  followed by a top-left triangle where the backend prefers it
  (:attr:`CPConfig.split_bottom_right_backward`). The triangles of
  several blocks run as one call after all the rectangles, adding their
  dq (their rows are the rectangles'): they must read disjoint KV rows."""
  rows, triangles = [], []
  for block in reversed(blocks):
    if (not AttentionMask(block.mask).bottom_right
        or not cfg.split_bottom_right_backward):
      rows.append(block)
      continue
    rect, diag = split_bottom_right(block.meta)
    rows.append(dataclasses.replace(block, meta=rect, mask="no_mask"))
    triangles.append(dataclasses.replace(
        block, meta=diag, mask="causal_top_left", max_kv=block.max_q))
  calls = in_order(cfg, rows)
  if triangles:
    calls.append(rows_call(cfg, merge_blocks(triangles), into=False))
  return calls


def whole_row_plan(cfg, cu_seqlens, cu_seqlens_padded) -> list[RowsCall]:
  """The plan of one rank (cp = 1), the same both ways: one call on the
  whole row. Q and KV lengths agree per document: top-left ==
  bottom-right, and top-left is the faster cuDNN backward. One document
  slot per row, starting at 0 (cu_seqlens_padded starts at 0) and bounded
  by the row: the rows tile the buffer (docs/internals.md, Tiled calls).
  More slots may still hold one document per row: the device tells."""
  w = cfg.max_seqlen
  m = contiguous_chunk(cu_seqlens, cu_seqlens_padded, 0, cfg.total_tokens)
  whole_rows = cfg.causal and w >= cfg.total_tokens
  tiled = whole_rows and cu_seqlens.shape[-1] == 2
  block = Block(m, "causal_top_left" if cfg.causal else "no_mask", w, w,
                False, tiled=tiled, may_tile=whole_rows and not tiled)
  return in_order(cfg, [block])


def ring_call(cfg, meta: StepMetadata, mask: str, bound: int, step: int
              ) -> RowsCall:
  """The call of a ring step: this rank's Q rows against the K/V chunk
  it holds then (the local chunk at step 0), by the step's metadata,
  mask and bound on either side."""
  tl = cfg.local_tokens
  seg = row_segments(meta.q_lens, meta.kv_lens, meta.q_offsets,
                     meta.kv_offsets, tl, tl, bound, bound,
                     rows_see_keys=True, heaviest_first=True)
  return RowsCall(seg, mask, -1, exchanged=step > 0)
