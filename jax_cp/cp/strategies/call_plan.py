"""The call plan of CP attention: which varlen attention calls a rank runs.

Pure functions of the static config and the row metadata, with no
communication and no backend call: :func:`forward_plan` and
:func:`backward_plan` return the calls of a rank in order, each of one of
three kinds, with its segments ready for the backend, so the executor
(:mod:`jax_cp.cp.vjp`) runs them without deriving anything:

* :class:`RowsCall`: a call on this rank's Q rows (local or exchanged
  K/V) whose rows no other :class:`RowsCall` of the forward covers; it
  writes them into the earlier calls' outputs (``into``, in place with a
  backend that supports it) or its outputs are added.
* :class:`HaloCall`: NO_LOAD_BALANCE's halo call, the straddling
  document's first rows against its keys before the chunk
  (:mod:`jax_cp.attention.decompose.straddle`), merged by log-sum-exp.
* :class:`CompactCalls`: windowed DUAL_CHUNK_SWAP's near and far parts,
  over compact buffers of the rows and keys they need
  (:func:`jax_cp.cp.strategies.dual_chunk_window.window_compaction`),
  merged by log-sum-exp.

The ring exchange has a plan of its own, one :class:`RowsCall` per step
(:func:`ring_plan`), which :mod:`jax_cp.cp.exchange.ring` runs.

One rank (cp = 1) runs
:func:`jax_cp.cp.strategies.calls.whole_row_plan`; at cp > 1 the layout's
strategy builds the plan (:mod:`jax_cp.cp.strategies`).
docs/internals.md, Call plans, describes the plans.

Names at the function boundaries: ``cfg`` is the call's
:class:`jax_cp.cp.config.CPConfig`, ``cu_seqlens``/``cu_seqlens_padded``
the row metadata ``[B, N+1]`` (valid and padded document boundaries),
``rank`` this rank's int32 index on the cp axis.
"""

from __future__ import annotations

import dataclasses

from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.calls import RowsCall, ring_call, whole_row_plan
from jax_cp.cp.strategies.dual_chunk_swap import CompactCalls
from jax_cp.cp.strategies.no_load_balance import HaloCall


def forward_plan(cfg, cu_seqlens, cu_seqlens_padded, rank) -> list:
  """The varlen attention calls of this rank's forward, in order
  (the strategy's ``forward_plan``)."""
  if cfg.cp_size == 1:
    return whole_row_plan(cfg, cu_seqlens, cu_seqlens_padded)
  return strategy_for(cfg.strategy).forward_plan(cfg, cu_seqlens,
                                                 cu_seqlens_padded, rank)


def backward_plan(cfg, cu_seqlens, cu_seqlens_padded, rank) -> list:
  """The calls of this rank's backward, in order (the strategy's
  ``backward_plan``): the forward's in reverse order, bottom-right blocks
  split where the backend prefers it."""
  if cfg.cp_size == 1:
    return whole_row_plan(cfg, cu_seqlens, cu_seqlens_padded)
  return strategy_for(cfg.strategy).backward_plan(cfg, cu_seqlens,
                                                  cu_seqlens_padded, rank)


def ring_plan(cfg, cu_seqlens, cu_seqlens_padded, rank, step: int
              ) -> RowsCall:
  """The call of ring step ``step`` (the strategy's ``ring_step`` and
  ``ring_bound``): this rank's Q rows against the K/V chunk it holds then
  (the local chunk at step 0), the same call in the forward and the
  backward."""
  # A window keeps the halo exchange (exchange.choose_exchange).
  assert cfg.window_left < 0, cfg
  strategy = strategy_for(cfg.strategy)
  meta, mask = strategy.ring_step(cu_seqlens, cu_seqlens_padded, cfg.cp_size,
                                  rank, step, causal=cfg.causal,
                                  total_tokens=cfg.total_tokens)
  return ring_call(cfg, meta, mask, strategy.ring_bound(cfg, step), step)


__all__ = ("CompactCalls", "HaloCall", "RowsCall", "backward_plan",
           "forward_plan", "ring_plan")


def poisoned(plan: list, poison) -> list:
  """``plan`` (calls of :func:`forward_plan`, :func:`backward_plan` or
  :func:`ring_plan`) with ``poison`` (:attr:`CPConfig.poison`, an int32
  scalar) in every call's segments (:attr:`Segments.poison`); unchanged
  for None."""
  if poison is None:
    return plan
  put = lambda seg: dataclasses.replace(seg, poison=poison)
  out = []
  for call in plan:
    if isinstance(call, RowsCall):
      call = dataclasses.replace(call, segments=put(call.segments))
    elif isinstance(call, HaloCall):
      call = dataclasses.replace(
          call, call=call.call._replace(segments=put(call.call.segments)))
    else:
      call = dataclasses.replace(
          call, calls=tuple((put(seg), mask) for seg, mask in call.calls))
    out.append(call)
  return out
