"""Which exchange a layout should run (``CPLayout.comm_type``), predicted
by the cost model for each exchange that can run the batch
(docs/long_rows.md, Choosing an exchange).

Per exchange, for the busiest rank (forward, or forward + backward):

* ``"all_gather"`` (the halo under NO_LOAD_BALANCE with a bound or a
  window): :meth:`CPCostEstimate.predicted_time_s`, nothing overlapped;
* ``"ring"``: the same compute, of each hop what its step does not hide
  (:meth:`CPCostEstimate.ring_exposed_s`);
* ``"all_to_all"``: every rank attends whole rows for ``Hq / cp`` heads, so
  its compute is the batch's over ``cp``; it sends and receives ``(cp -
  1) / cp`` of its q, k, v (K/V heads repeated up to ``cp`` where there
  are fewer) and of the output, and as much again in the backward; its
  calls are the cp = 1 plan's, counted on that plan
  (:func:`~jax_cp.planning.cost_model.plan_calls`);
* ``"all_to_all+ring"`` (``cp_inner`` given): the all-to-all over the
  ``cp_inner`` ranks of a node at ``inner_bandwidth``, then the ring over
  the ``cp / cp_inner`` nodes on ``Hq / cp_inner`` heads at ``bandwidth``.

An exchange the layout would reject (a ring with a window under
DUAL_CHUNK_SWAP, head counts an all-to-all cannot scatter) is listed with
the reason instead of a time. Host numpy, like the rest of the planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_cp.attention.validation import check_window_size
from jax_cp.cp import validation
from jax_cp.cp.layout import CPLayout
from jax_cp.cp.strategies.load_balancing import (
    CPLoadBalancingStrategy,
    as_strategy,
)
from jax_cp.planning.cost_model import (
    CALL_OVERHEAD_S,
    FWD_BWD_FLOP_FACTOR,
    H200_ALLGATHER_BUS_BANDWIDTH,
    H200_ATTENTION_FLOPS,
    CPCostEstimate,
    estimate_cp_imbalance,
    plan_calls,
)
from jax_cp.planning.host import host_metadata
from jax_cp.typing import ArrayLike, WindowSize


@dataclasses.dataclass(frozen=True)
class ExchangeRecommendation:
  """What :func:`recommend_exchange` picked and why.

  Attributes:
    comm_type: the exchange with the lowest predicted step time (a value
      of ``CPLayout.comm_type``).
    predicted_time_s: predicted step time of each exchange that can run
      the batch, by ``comm_type``.
    ruled_out: why each other exchange cannot, by ``comm_type``.
    estimate: the strategy's :class:`CPCostEstimate` at ``cp_size``.
    reason: one sentence: the times, and what decided.
  """

  comm_type: str
  predicted_time_s: dict[str, float]
  ruled_out: dict[str, str]
  estimate: CPCostEstimate
  reason: str


def _positive(value, name: str) -> float:
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a positive finite number, got "
                     f"{value!r}")
  return float(value)


def head_scatter_bytes(rows: int, local_tokens: int, hq: int, hkv: int,
                       d: int, nbytes: int, size: int,
                       include_backward: bool) -> float:
  """Bytes a rank sends (and receives) in the all-to-alls of one call
  over ``size`` ranks: ``(size - 1) / size`` of its q, k, v (K/V heads
  repeated up to ``size`` where there are fewer) and of the output; the
  backward moves the output's cotangent and dq, dk, dv: as much again."""
  kv = max(hkv, size)
  per_token = (2 * hq + 2 * kv) * d * nbytes
  moved = rows * local_tokens * per_token * (size - 1) / size
  return moved * (2 if include_backward else 1)


def recommend_exchange(cu_seqlens: ArrayLike, cu_seqlens_padded: ArrayLike,
                       cp_size: int, *,
                       strategy: CPLoadBalancingStrategy | str =
                       CPLoadBalancingStrategy.DUAL_CHUNK_SWAP,
                       num_heads_q: int = 1, num_heads_kv: int = 1,
                       head_dim: int = 128, dtype_bytes: int = 2,
                       max_seqlen: int | None = None,
                       window_size: WindowSize = None,
                       cp_inner: int | None = None,
                       peak_flops: float = H200_ATTENTION_FLOPS,
                       bandwidth: float = H200_ALLGATHER_BUS_BANDWIDTH,
                       inner_bandwidth: float | None = None,
                       call_overhead_s: float = CALL_OVERHEAD_S,
                       include_backward: bool = True
                       ) -> ExchangeRecommendation:
  """Picks the exchange (``comm_type``) with the lowest predicted step
  time for a batch under a strategy (module docstring: the model).

  Args:
    cu_seqlens, cu_seqlens_padded: the batch (``[N+1]`` or ``[B, N+1]``) in
      the strategy's layout.
    cp_size: the CP ranks (all of them: ``cp_outer * cp_inner`` for the
      hierarchical exchange).
    strategy: the load-balancing strategy.
    num_heads_q, num_heads_kv, head_dim, dtype_bytes, max_seqlen,
      window_size: as in :func:`~jax_cp.planning.estimate_cp_imbalance`.
    cp_inner: the ranks of the inner mesh axis (one node): with it,
      ``"all_to_all+ring"`` is a candidate.
    peak_flops: sustained attention FLOP/s of one GPU.
    bandwidth: bus bandwidth of the exchange between the ranks (between
      nodes for the hierarchical exchange's ring), B/s.
    inner_bandwidth: bus bandwidth inside a node (the hierarchical
      exchange's all-to-all); default ``bandwidth``.
    call_overhead_s: fixed cost per attention kernel call.
    include_backward: model forward + backward.

  Returns:
    An :class:`ExchangeRecommendation`.

  Raises:
    ValueError: for bad sizes or metadata (as
      :func:`~jax_cp.planning.estimate_cp_imbalance`), a ``cp_inner`` that
      does not divide ``cp_size``, or a non-positive bandwidth.
  """
  strategy = as_strategy(strategy)
  cp = int(cp_size)
  if cp < 1:
    raise ValueError(f"cp_size must be >= 1, got {cp_size!r}")
  bandwidth = _positive(bandwidth, "bandwidth")
  inner_bw = bandwidth if inner_bandwidth is None else _positive(
      inner_bandwidth, "inner_bandwidth")
  peak_flops = _positive(peak_flops, "peak_flops")
  hq, hkv = int(num_heads_q), int(num_heads_kv)
  kw = dict(num_heads_q=hq, num_heads_kv=hkv, head_dim=head_dim,
            dtype_bytes=dtype_bytes, window_size=window_size)
  est = estimate_cp_imbalance(
      cu_seqlens, cu_seqlens_padded,
      CPLayout(cp_size=cp, strategy=strategy, max_seqlen=max_seqlen), **kw)
  model = dict(peak_flops=peak_flops, bandwidth=bandwidth,
               call_overhead_s=call_overhead_s,
               include_backward=include_backward)
  left = check_window_size(window_size, "causal")
  times: dict[str, float] = {}
  ruled_out: dict[str, str] = {}
  times["all_gather"] = est.predicted_time_s(**model)
  try:
    validation.check_comm_type("ring", strategy, left, cp,
                               est.total_tokens)
    times["ring"] = est.predicted_time_s(comm_type="ring", **model)
  except ValueError as e:
    ruled_out["ring"] = str(e)
  if cp == 1:
    ruled_out["all_to_all"] = "cp_size=1: nothing to scatter"
  else:
    try:
      times["all_to_all"] = _all_to_all_time(
          est, cu_seqlens, cu_seqlens_padded, strategy, cp, hq, hkv,
          head_dim, dtype_bytes, max_seqlen, left, inner_bw, model)
    except ValueError as e:
      ruled_out["all_to_all"] = str(e)
  if cp_inner is not None:
    ci = int(cp_inner)
    if ci < 1 or cp % ci:
      raise ValueError(f"cp_inner={cp_inner!r} must divide cp_size={cp}")
    try:
      times["all_to_all+ring"] = _hierarchical_time(
          cu_seqlens, cu_seqlens_padded, strategy, cp, ci, hq, hkv,
          head_dim, dtype_bytes, max_seqlen, window_size, left, inner_bw,
          model)
    except ValueError as e:
      ruled_out["all_to_all+ring"] = str(e)
  best = min(times, key=times.get)
  order = ", ".join(f"{c} {times[c] * 1e3:.3f} ms"
                    for c in sorted(times, key=times.get))
  reason = f"{best} is predicted fastest ({order})"
  if ruled_out:
    reason += "; not possible: " + "; ".join(
        f"{c} ({why})" for c, why in ruled_out.items())
  return ExchangeRecommendation(comm_type=best, predicted_time_s=times,
                                ruled_out=ruled_out, estimate=est,
                                reason=reason)


def _all_to_all_time(est: CPCostEstimate, cu_seqlens, cu_seqlens_padded,
                     strategy, cp, hq, hkv, d, nbytes, max_seqlen, left,
                     bandwidth, model) -> float:
  """Whole rows for ``Hq / cp`` heads per rank: the batch's compute over
  ``cp``, the all-to-alls' bytes, the cp = 1 plan's calls."""
  validation.check_head_scatter(hq, hkv, cp, "all_to_all")
  cu, cuP = host_metadata(cu_seqlens, cu_seqlens_padded)
  flops = est.total_flops / cp
  if model["include_backward"]:
    flops *= FWD_BWD_FLOP_FACTOR
  moved = head_scatter_bytes(est.num_rows, est.total_tokens // cp, hq, hkv,
                             d, nbytes, cp, model["include_backward"])
  calls = plan_calls(strategy, 1, cu, cuP, hq // cp, max(hkv // cp, 1), d,
                     max_seqlen, left)
  if model["include_backward"]:
    calls *= 2
  return (flops / model["peak_flops"] + moved / bandwidth
          + calls * model["call_overhead_s"])


def _hierarchical_time(cu_seqlens, cu_seqlens_padded, strategy, cp, ci, hq,
                       hkv, d, nbytes, max_seqlen, window_size, left,
                       inner_bandwidth, model) -> float:
  """The all-to-all over ``ci`` ranks, then the ring over ``cp / ci`` on
  ``Hq / ci`` heads (its bandwidth ``model["bandwidth"]``)."""
  validation.check_head_scatter(hq, hkv, ci, "all_to_all+ring")
  co = cp // ci
  validation.check_comm_type("ring", strategy, left, co,
                             int(np.max(np.asarray(cu_seqlens_padded))))
  ring = estimate_cp_imbalance(
      cu_seqlens, cu_seqlens_padded,
      CPLayout(cp_size=co, strategy=strategy, max_seqlen=max_seqlen),
      num_heads_q=hq // ci, num_heads_kv=max(hkv // ci, 1), head_dim=d,
      dtype_bytes=nbytes, window_size=window_size)
  moved = head_scatter_bytes(ring.num_rows, ring.total_tokens // cp, hq, hkv,
                             d, nbytes, ci, model["include_backward"])
  return (ring.predicted_time_s(comm_type="ring", **model)
          + moved / inner_bandwidth)


__all__ = ("ExchangeRecommendation", "recommend_exchange")
