"""Host-side cost model of CP attention (docs/concepts.md, Strategies).

Given a batch's metadata, :func:`estimate_cp_imbalance` predicts what each
context-parallel rank does in the forward of causal self-attention under a
load-balancing strategy:

* **work**: the causal (query, key) pairs each rank computes, counted exactly
  for every document's *valid* tokens (query at position ``j`` of its
  document sees keys ``0..j``, so a whole document of ``L`` valid tokens has
  ``L(L+1)/2`` pairs; with a sliding window ``(left, 0)`` it sees
  ``min(j+1, left+1)`` keys); forward FLOPs are ``4 * D * Hq * pairs`` (two
  matmuls of ``2*D`` FLOPs per pair and head);
* **imbalance**: max over ranks / mean over ranks of that work (1 is
  perfect; the step waits for the slowest rank);
* **traffic**: the K/V bytes each rank receives in the all-gather,
  ``(cp-1)/cp * T * Hkv * D * 2 * dtype_bytes``, and where the layout runs
  another exchange (NO_LOAD_BALANCE's halo under a ``max_seqlen`` bound or
  a window, none for a window of 0) what that exchange object receives
  (:meth:`~jax_cp.cp.exchange.base.KVExchange.received_tokens` of the
  config's exchange); DUAL_CHUNK_SWAP all-gathers with or without a window;
* **calls**: attention kernel calls per rank, counted on the call plan
  the layout runs (:func:`plan_calls`), not on a model of it.

Under NO_LOAD_BALANCE the work also depends on the order of the documents
in the row; :func:`jax_cp.planning.balance_document_order` picks an order
that evens it out (counting pairs as this module does,
:mod:`jax_cp.planning.pairs`).

:func:`recommend_strategy` turns two such estimates into a predicted step
time with a deliberately simple model (see
:meth:`CPCostEstimate.predicted_time_s`) and picks the cheaper strategy.
Everything here is numpy on the host: call it from the data loader, not
inside ``jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.validation import check_window_size
from jax_cp.cp import validation
from jax_cp.cp.config import make_config
from jax_cp.cp.layout import CPLayout
from jax_cp.cp.strategies import call_plan
from jax_cp.cp.strategies.dual_chunk_swap import CompactCalls
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.planning import document_order
from jax_cp.planning.flops import RECOMPUTE_BACKWARD_FACTOR, attention_flops
from jax_cp.planning.host import as_int_rows, host_metadata, resolve_layout
from jax_cp.planning.pairs import range_pairs
from jax_cp.typing import ArrayLike, WindowSize

_DCS = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP
_NLB = CPLoadBalancingStrategy.NO_LOAD_BALANCE

#: Default sustained causal-attention throughput of one H200 (FLOP/s, bf16).
H200_ATTENTION_FLOPS = 600e12
#: Default all-gather bus bandwidth between H200s over NVLink (B/s).
H200_ALLGATHER_BUS_BANDWIDTH = 150e9
#: Default fixed cost of one attention kernel call (launch + metadata), s.
CALL_OVERHEAD_S = 20e-6
#: FLOPs of forward + backward relative to the forward, as the GPU runs them
#: (the fused backward recomputes Q K^T: 2.5x the forward,
#: jax_cp.planning.flops).
FWD_BWD_FLOP_FACTOR = 1.0 + RECOMPUTE_BACKWARD_FACTOR
#: K/V exchanges of forward + backward relative to the forward: forward
#: gather, backward re-gather, and the reduce-scatter of dK/dV.
FWD_BWD_BYTES_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class CPCostEstimate:
  """Predicted per-rank work and traffic of one CP attention forward.

  Attributes:
    strategy: the load-balancing strategy the estimate is for.
    cp_size: number of CP ranks.
    pairs_per_rank: causal (query, key) pairs each rank computes, summed over
      the rows of a batch.
    flops_per_rank: forward FLOPs per rank, ``4 * head_dim * num_heads_q *
      pairs``.
    imbalance: ``max(flops_per_rank) / mean(flops_per_rank)`` (1.0 when no
      rank has work).
    calls_per_rank: attention kernel calls of the busiest rank's forward,
      counted on the plan the layout runs (:func:`plan_calls`); the
      backward is charged as many.
    allgather_bytes: K+V bytes each rank receives in the all-gather, summed
      over rows.
    halo_bytes_per_rank: where the layout's exchange is not the
      all-gather (NO_LOAD_BALANCE's halo, or none): K+V bytes rank ``r``
      receives (``min(H, r*Tl)`` tokens per row for a halo of ``H``);
      ``None`` otherwise.
    halo_bytes: ``max(halo_bytes_per_rank)`` or ``None``.
    longest_padded_doc: longest padded document of the batch.
    total_tokens: ``T``, tokens per row.
    num_rows: ``B`` (1 for ``[N+1]`` metadata).
    valid_tokens: valid tokens over all rows.
    max_seqlen: the bound ``W`` used for the halo (clamped to ``T``), or
      ``None``.
    window_left: the left bound of the causal sliding window (-1: none).
    kv_dtype_bytes: bytes per K/V element.
  """

  strategy: CPLoadBalancingStrategy
  cp_size: int
  pairs_per_rank: tuple[int, ...]
  flops_per_rank: tuple[int, ...]
  imbalance: float
  calls_per_rank: int
  allgather_bytes: int
  halo_bytes_per_rank: tuple[int, ...] | None
  halo_bytes: int | None
  longest_padded_doc: int
  total_tokens: int
  num_rows: int
  valid_tokens: int
  max_seqlen: int | None
  window_left: int = -1
  kv_dtype_bytes: int = 2

  @property
  def total_flops(self) -> int:
    """Forward FLOPs of the whole batch (all ranks)."""
    return int(sum(self.flops_per_rank))

  @property
  def max_rank_flops(self) -> int:
    """Forward FLOPs of the busiest rank (what the step waits for)."""
    return int(max(self.flops_per_rank))

  @property
  def exchange_bytes(self) -> int:
    """K/V bytes per rank of the forward exchange the model charges: the
    bounded halo when known, else the all-gather."""
    return self.allgather_bytes if self.halo_bytes is None else self.halo_bytes

  def predicted_time_s(self, *, peak_flops: float = H200_ATTENTION_FLOPS,
                       bandwidth: float = H200_ALLGATHER_BUS_BANDWIDTH,
                       call_overhead_s: float = CALL_OVERHEAD_S,
                       include_backward: bool = False,
                       bounded_exchange: bool = True,
                       comm_type: str = "all_gather") -> float:
    """Predicted step time of the busiest rank, in seconds.

    All-gather: ``max_rank_flops / peak_flops + exchange_bytes / bandwidth
    + calls * call_overhead_s``, with nothing overlapped. With
    ``include_backward``, FLOPs are multiplied by
    :data:`FWD_BWD_FLOP_FACTOR` (3.5), bytes by
    :data:`FWD_BWD_BYTES_FACTOR` (3: gather, re-gather, reduce-scatter) and
    calls by 2.

    Ring (:meth:`ring_exposed_s`): the same compute, one call per step, and
    of each hop only what its step's compute does not hide.

    The model ignores kernel efficiency on short documents, the
    DUAL_CHUNK_SWAP reorder gather and the ring's merges.

    Args:
      peak_flops: sustained causal-attention FLOP/s of one GPU.
      bandwidth: bus bandwidth of the exchange, B/s (the ring's hops are
        charged at it too).
      call_overhead_s: fixed cost per attention kernel call.
      include_backward: model forward + backward instead of the forward.
      bounded_exchange: charge the bounded halo (NO_LOAD_BALANCE with a
        ``max_seqlen``) instead of the full all-gather.
      comm_type: ``"all_gather"`` or ``"ring"`` (``CPLayout.comm_type``).
    """
    for name, x in (("peak_flops", peak_flops), ("bandwidth", bandwidth)):
      if not np.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {x!r}")
    if not np.isfinite(call_overhead_s) or call_overhead_s < 0:
      raise ValueError(f"call_overhead_s must be >= 0, got {call_overhead_s!r}")
    if comm_type not in ("all_gather", "ring"):
      raise ValueError(f"comm_type must be 'all_gather' or 'ring', got "
                       f"{comm_type!r}")
    flops = float(self.max_rank_flops)
    if include_backward:
      flops *= FWD_BWD_FLOP_FACTOR
    compute = flops / peak_flops
    if comm_type == "ring" and self.cp_size > 1:
      steps = self.cp_size
      calls = steps * (2 if include_backward else 1)
      return (compute + self.ring_exposed_s(peak_flops, bandwidth,
                                            include_backward)
              + calls * call_overhead_s)
    nbytes = self.exchange_bytes if bounded_exchange else self.allgather_bytes
    calls = self.calls_per_rank
    if include_backward:
      nbytes *= FWD_BWD_BYTES_FACTOR
      calls *= 2
    return compute + nbytes / bandwidth + calls * call_overhead_s

  def ring_exposed_s(self, peak_flops: float, bandwidth: float,
                     include_backward: bool) -> float:
    """The ring's exchange time that compute does not hide, in seconds.

    ``cp`` steps, each a ``1/cp`` share of the busiest rank's compute; a
    forward hop moves one chunk of K|V (``allgather_bytes / (cp - 1)``),
    a backward hop that and its float32 dK|dV accumulator, and one last
    hop brings the accumulator home. Each of the ``cp - 1`` hops of a
    direction overlaps one step: ``max(0, hop - step)`` is exposed; the
    home hop is exposed whole."""
    cp = self.cp_size
    if cp == 1:
      return 0.0
    chunk = self.allgather_bytes / (cp - 1)
    step = self.max_rank_flops / peak_flops / cp
    exposed = (cp - 1) * max(0.0, chunk / bandwidth - step)
    if include_backward:
      acc = chunk * 4 / self.kv_dtype_bytes
      step_bwd = step * RECOMPUTE_BACKWARD_FACTOR
      exposed += (cp - 1) * max(0.0, (chunk + acc) / bandwidth - step_bwd)
      exposed += acc / bandwidth
    return exposed


@dataclasses.dataclass(frozen=True)
class StrategyRecommendation:
  """What :func:`recommend_strategy` picked and why.

  Attributes:
    strategy: the strategy with the lower predicted step time.
    predicted_time_s: predicted step time per strategy value.
    estimates: the :class:`CPCostEstimate` per strategy value.
    reason: one human-readable sentence: the predicted times and, where
      DUAL_CHUNK_SWAP is picked at cp > 1, the K/V bytes per rank and
      layer of its all-gather against the ring's chunk.
  """

  strategy: CPLoadBalancingStrategy
  predicted_time_s: dict[str, float]
  estimates: dict[str, CPCostEstimate]
  reason: str


# ----------------------------------------------------------------- helpers


def _check_positive_int(value: Any, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def _rank_pairs(lens, starts, plens, cp: int, total: int,
                strategy: CPLoadBalancingStrategy,
                window_left: int = -1) -> np.ndarray:
  """Causal pairs per rank ``[cp]`` of one row (int64)."""
  ranks = np.arange(cp, dtype=np.int64)[:, None]          # [cp, 1]
  lens, starts, plens = lens[None], starts[None], plens[None]  # [1, N]
  if strategy is _NLB or cp == 1:
    tl = total // cp
    lo, hi = ranks * tl, (ranks + 1) * tl
    a = np.clip(lo - starts, 0, lens)
    b = np.clip(hi - starts, 0, lens)
    return range_pairs(a, b, window_left).sum(axis=1)
  c = plens // (2 * cp)                                    # chunk length
  pairs = 0
  for k in (ranks, 2 * cp - 1 - ranks):
    a = np.clip(k * c, 0, lens)
    b = np.clip((k + 1) * c, 0, lens)
    pairs = pairs + range_pairs(a, b, window_left)
  return pairs.sum(axis=1)


# ----------------------------------------------------------------- public API


def estimate_cp_imbalance(cu_seqlens: ArrayLike,
                          cu_seqlens_padded: ArrayLike, layout: CPLayout,
                          *, num_heads_q: int = 1, num_heads_kv: int = 1,
                          head_dim: int = 128, dtype_bytes: int = 2,
                          window_size: WindowSize = None) -> CPCostEstimate:
  """Predicts per-rank causal attention work and K/V traffic of a batch.

  Args:
    cu_seqlens: int ``[N+1]`` or ``[B, N+1]`` cumulative valid lengths.
    cu_seqlens_padded: int, same shape, cumulative padded lengths
      (``cuP[-1] == T`` in every row).
    layout: the :class:`jax_cp.CPLayout` with a known cp size: its strategy
      and ``max_seqlen`` (the static bound ``W`` on every padded document
      length; with NO_LOAD_BALANCE it gives the bounded-halo bytes).
    num_heads_q: query heads (scales FLOPs).
    num_heads_kv: key/value heads (scales bytes).
    head_dim: head dimension ``D``.
    dtype_bytes: bytes per K/V element (2 for bf16).
    window_size: ``None`` or a causal sliding window ``(left, 0)``: a query
      sees at most ``left + 1`` keys, and NO_LOAD_BALANCE's halo is at most
      ``left`` tokens (with or without ``max_seqlen``).

  Returns:
    A :class:`CPCostEstimate`. With batched metadata, per-rank quantities are
    sums over rows.

  Raises:
    ValueError: malformed metadata, ``T % cp_size != 0``, DUAL_CHUNK_SWAP
      with a padded length not divisible by ``2*cp_size``, a document longer
      than ``max_seqlen``, or bad sizes.
  """
  cp, strategy, max_seqlen = resolve_layout(layout, "estimate_cp_imbalance")
  hq = _check_positive_int(num_heads_q, "num_heads_q")
  hkv = _check_positive_int(num_heads_kv, "num_heads_kv")
  d = _check_positive_int(head_dim, "head_dim")
  nbytes = _check_positive_int(dtype_bytes, "dtype_bytes")
  left = check_window_size(window_size, "causal")
  if hq % hkv:
    raise ValueError(f"num_heads_q={hq} must be a multiple of num_heads_kv="
                     f"{hkv} (GQA/MQA)")
  cu, cuP = host_metadata(cu_seqlens, cu_seqlens_padded)
  total = int(cuP[0, -1])
  validation.check_divisible_tokens(total, cp)
  if strategy is _DCS:
    validation.check_dual_chunk_divisible(cuP, cp)
  plens = np.diff(cuP, axis=-1)
  lens = np.diff(cu, axis=-1)
  longest = int(plens.max()) if plens.size else 0
  w = None
  if max_seqlen is not None:
    w = min(_check_positive_int(max_seqlen, "max_seqlen"), total)
    if longest > w:
      raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest "
                       f"padded document ({longest} tokens)")

  pairs = np.zeros(cp, np.int64)
  for row in range(cuP.shape[0]):
    pairs += _rank_pairs(lens[row], cuP[row, :-1], plens[row], cp, total,
                         strategy, left)
  flops = attention_flops(pairs, num_heads=hq, head_dim=d, backward=False)
  mean = float(flops.sum()) / cp
  imbalance = float(flops.max()) / mean if mean > 0 else 1.0
  rows = cuP.shape[0]
  token_bytes = hkv * d * 2 * nbytes                    # K and V of a token
  allgather = (cp - 1) * rows * total * token_bytes // cp
  # The exchange the layout runs: what a rank receives, and the calls of
  # its plan.
  cfg = plan_config(strategy, cp, cu, cuP, hq, hkv, d, w, left)
  halo_per_rank = halo = None
  if not cfg.exchange.gathers_row:
    halo_per_rank = tuple(
        int(cfg.exchange.received_tokens(r) * rows * token_bytes)
        for r in range(cp))
    halo = max(halo_per_rank)
  calls = _most_calls(cfg, cu, cuP)
  return CPCostEstimate(
      strategy=strategy, cp_size=cp,
      pairs_per_rank=tuple(int(p) for p in pairs),
      flops_per_rank=tuple(int(f) for f in flops),
      imbalance=imbalance,
      calls_per_rank=calls,
      allgather_bytes=int(allgather),
      halo_bytes_per_rank=halo_per_rank, halo_bytes=halo,
      longest_padded_doc=longest, total_tokens=total, num_rows=rows,
      valid_tokens=int(lens.sum()), max_seqlen=w, window_left=left,
      kv_dtype_bytes=nbytes)


def pad_cu_seqlens(cu_seqlens, multiple: int
                   ) -> tuple[np.ndarray, np.ndarray]:
  """``(cu_seqlens, cu_seqlens_padded)`` with every document padded up to
  a multiple of ``multiple`` (e.g. ``2*cp`` for DUAL_CHUNK_SWAP). The rows
  grow; every row ends at the longest one's length, with one more slot
  (valid length 0) holding what a shorter row lacks, so the slots have
  ``N + 2`` entries."""
  multiple = _check_positive_int(multiple, "multiple")
  cu = as_int_rows(cu_seqlens, "cu_seqlens")
  lens = np.diff(cu, axis=-1)
  if (lens < 0).any():
    raise ValueError("cu_seqlens must be non-decreasing")
  plens = -(-lens // multiple) * multiple
  ends = np.cumsum(plens, axis=-1)
  total = ends[:, -1:].max(initial=0)
  zero = np.zeros((cu.shape[0], 1), np.int64)
  cu_p = np.concatenate([zero, ends, np.full_like(zero, total)], axis=-1)
  cu = np.concatenate([cu, cu[:, -1:]], axis=-1)
  shape = np.shape(cu_seqlens)[:-1] + (cu.shape[-1],)
  return cu.reshape(shape), cu_p.reshape(shape)


def plan_config(strategy, cp: int, cu, cuP, hq: int, hkv: int, d: int,
                max_seqlen: int | None, window_left: int):
  """The :class:`~jax_cp.cp.config.CPConfig` the layout runs on these host
  metadata (the ``xla`` backend's): its exchange and its plans."""
  total = int(cuP[0, -1])
  plan_layout = CPLayout(cp_size=cp, strategy=strategy,
                         max_seqlen=max_seqlen, backend="xla")
  spec = lambda h: jax.ShapeDtypeStruct((cuP.shape[0], total, h, d),
                                        jnp.float32)
  cfg = make_config(
      plan_layout, spec(hq), spec(hkv), spec(hkv), cu.astype(np.int32),
      cuP.astype(np.int32), cp_size=cp, total_tokens=total,
      attn_mask_type="causal", softmax_scale=None,
      window_size=None if window_left < 0 else (window_left, 0),
      trusted=True, platform="cpu")
  return cfg


def plan_calls(strategy, cp: int, cu, cuP, hq: int, hkv: int, d: int,
               max_seqlen: int | None, window_left: int) -> int:
  """The attention calls of a rank's forward, counted on the plan the
  layout runs (:func:`jax_cp.cp.strategies.call_plan.forward_plan` on
  these host metadata, the ``xla`` backend's plan: one per
  :class:`~jax_cp.cp.strategies.calls.RowsCall` and halo call, one per
  part of windowed DUAL_CHUNK_SWAP's compact calls); the most of any
  rank."""
  return _most_calls(plan_config(strategy, cp, cu, cuP, hq, hkv, d,
                                 max_seqlen, window_left), cu, cuP)


def _most_calls(cfg, cu, cuP) -> int:
  """The most attention calls of any rank's forward plan under ``cfg``."""
  most = 0
  for rank in range(cfg.cp_size):
    plan = call_plan.forward_plan(cfg, jnp.asarray(cu, jnp.int32),
                                  jnp.asarray(cuP, jnp.int32),
                                  jnp.int32(rank))
    most = max(most, sum(len(c.calls) if isinstance(c, CompactCalls) else 1
                         for c in plan))
  return most


def recommend_strategy(cu_seqlens: ArrayLike, cu_seqlens_padded: ArrayLike,
                       cp_size: int, *,
                       num_heads_q: int = 1, num_heads_kv: int = 1,
                       head_dim: int = 128, dtype_bytes: int = 2,
                       max_seqlen: int | None = None,
                       window_size: WindowSize = None,
                       cu_seqlens_padded_dcs: ArrayLike | None = None,
                       peak_flops: float = H200_ATTENTION_FLOPS,
                       bandwidth: float = H200_ALLGATHER_BUS_BANDWIDTH,
                       call_overhead_s: float = CALL_OVERHEAD_S,
                       include_backward: bool = True,
                       bounded_exchange: bool = True,
                       reorder_documents: bool = False
                       ) -> StrategyRecommendation:
  """Picks the load-balancing strategy with the lower predicted step time.

  The model (per strategy, for its busiest rank)::

      t = max_rank_flops / peak_flops + exchange_bytes / bandwidth
          + calls_per_rank * call_overhead_s

  (forward + backward scaled as in :meth:`CPCostEstimate.predicted_time_s`).
  NO_LOAD_BALANCE is charged the bounded halo when ``max_seqlen`` or a
  window is given and ``bounded_exchange`` is on, else the full all-gather.
  With a window both strategies' work counts only the keys in the window,
  so contiguous chunks are close to balanced and NO_LOAD_BALANCE usually
  wins (a halo of at most ``left`` tokens); each is charged the calls of
  the plan it runs, counted on that plan (:func:`plan_calls`).
  Ties go to DUAL_CHUNK_SWAP (the default).

  Args:
    cu_seqlens, cu_seqlens_padded: the batch (``[N+1]`` or ``[B, N+1]``), in
      the layout NO_LOAD_BALANCE would use.
    cp_size: number of CP ranks.
    num_heads_q, num_heads_kv, head_dim, dtype_bytes, max_seqlen,
      window_size: as in :func:`estimate_cp_imbalance`; DUAL_CHUNK_SWAP is
      estimated with ``max_seqlen`` raised to its longest re-padded
      document where re-padding lengthens one past it.
    cu_seqlens_padded_dcs: the padded layout DUAL_CHUNK_SWAP would use for
      the same documents. Default: ``cu_seqlens_padded`` if every padded
      length divides by ``2*cp``, else each document re-padded to a multiple
      of ``2*cp`` (:func:`pad_cu_seqlens`; the row grows, which the estimate
      then includes).
    peak_flops: sustained causal-attention FLOP/s per GPU (default
      :data:`H200_ATTENTION_FLOPS`).
    bandwidth: exchange bus bandwidth, B/s (default
      :data:`H200_ALLGATHER_BUS_BANDWIDTH`).
    call_overhead_s: fixed cost per kernel call (20e-6).
    include_backward: model a training step (forward + backward).
    bounded_exchange: whether NO_LOAD_BALANCE exchanges only the halo.
    reorder_documents: estimate NO_LOAD_BALANCE on the rows with their
      documents reordered by :func:`balance_document_order` (what
      a data loader that reorders them would run), not as given.

  Returns:
    A :class:`StrategyRecommendation`.
  """
  kw = dict(num_heads_q=num_heads_q, num_heads_kv=num_heads_kv,
            head_dim=head_dim, dtype_bytes=dtype_bytes,
            window_size=window_size)
  cp_size = _check_positive_int(cp_size, "cp_size")
  nlb_layout = CPLayout(cp_size=cp_size, strategy=_NLB,
                        max_seqlen=max_seqlen)
  cu_nlb, cuP_nlb = cu_seqlens, cu_seqlens_padded
  if reorder_documents:
    order = document_order.balance_document_order(
        cu_seqlens, cu_seqlens_padded, nlb_layout, window_size=window_size)
    cu_nlb, cuP_nlb = document_order.permute_documents(
        order, cu_seqlens, cu_seqlens_padded)
  nlb = estimate_cp_imbalance(cu_nlb, cuP_nlb, nlb_layout, **kw)
  note = " (no_load_balance on the reordered rows)" if reorder_documents \
      else ""
  cu_dcs = cu_seqlens
  if cu_seqlens_padded_dcs is None:
    plens = np.diff(as_int_rows(cu_seqlens_padded, "cu_seqlens_padded"),
                    axis=-1)
    if (plens % (2 * cp_size)).any():
      cu_dcs, cu_seqlens_padded_dcs = pad_cu_seqlens(cu_seqlens,
                                                     2 * cp_size)
      note += (f" (DUAL_CHUNK_SWAP estimated on documents re-padded to a "
               f"multiple of {2 * cp_size})")
    else:
      cu_seqlens_padded_dcs = cu_seqlens_padded
  dcs_bound = None
  if max_seqlen is not None:
    # The bound DUAL_CHUNK_SWAP's layout would carry: re-padding may
    # lengthen the longest document past the one given.
    plens_dcs = np.diff(as_int_rows(cu_seqlens_padded_dcs,
                                    "cu_seqlens_padded_dcs"), axis=-1)
    dcs_bound = max(int(max_seqlen), int(plens_dcs.max(initial=0)))
  dcs = estimate_cp_imbalance(
      cu_dcs, cu_seqlens_padded_dcs,
      CPLayout(cp_size=cp_size, strategy=_DCS, max_seqlen=dcs_bound), **kw)
  model = dict(peak_flops=peak_flops, bandwidth=bandwidth,
               call_overhead_s=call_overhead_s,
               include_backward=include_backward)
  times = {_DCS.value: dcs.predicted_time_s(**model),
           _NLB.value: nlb.predicted_time_s(
               bounded_exchange=bounded_exchange, **model)}
  best = _NLB if times[_NLB.value] < times[_DCS.value] else _DCS
  other = _DCS if best is _NLB else _NLB
  reason = (f"{best.value} is predicted at {times[best.value] * 1e3:.3f} ms "
            f"vs {times[other.value] * 1e3:.3f} ms for {other.value} "
            f"(imbalance {nlb.imbalance:.3f} no_load_balance vs "
            f"{dcs.imbalance:.3f} dual_chunk_swap; exchange "
            f"{nlb.exchange_bytes if bounded_exchange else nlb.allgather_bytes}"
            f" vs {dcs.exchange_bytes} B/rank){note}")
  if best is _DCS and cp_size > 1:
    gathered = dcs.allgather_bytes * cp_size // (cp_size - 1)
    reason += (f"; per layer its all-gather holds {gathered} B of K/V on "
               f"each rank, comm_type='ring' one chunk of "
               f"{gathered // cp_size} B at a time, which is what to pick "
               f"where the gathered K/V and the buffers sized by them bound "
               f"the row (docs/long_rows.md, Ring exchange)")
  return StrategyRecommendation(
      strategy=best, predicted_time_s=times,
      estimates={_DCS.value: dcs, _NLB.value: nlb}, reason=reason)


__all__ = ("CPCostEstimate", "StrategyRecommendation",
           "estimate_cp_imbalance", "recommend_strategy", "pad_cu_seqlens")
