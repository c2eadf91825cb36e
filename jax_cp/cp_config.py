"""The validated, static configuration of one CP attention call.

:func:`make_config` checks every argument that can be checked before
tracing (:mod:`jax_cp.checks`), resolves the backend and chooses the K/V
exchange, once per call; the resulting :class:`CPConfig` is hashable and
travels into the ``shard_map`` and the ``custom_vjp`` as static data, so
forward and backward read the same instance.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from jax_cp import checks, seqlen_guard
from jax_cp.attention.api import default_scale
from jax_cp.attention.backend import AttentionBackend
from jax_cp.attention.registry import resolve_backend
from jax_cp.kv_exchange import KVExchange, choose_exchange
from jax_cp.strategy import CPLoadBalancingStrategy, as_strategy

_DCS = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP
_NLB = CPLoadBalancingStrategy.NO_LOAD_BALANCE

def _warn_bottom_right_window() -> None:
  """The warning of a DUAL_CHUNK_SWAP window run as bottom-right banded
  calls on cudnn (shown once per process by Python's default filter)."""
  warnings.warn(
      "DUAL_CHUNK_SWAP with a sliding window runs bottom-right banded cuDNN "
      "calls (dcs_window_plan='bottom_right'), whose backward cuDNN 9.19 "
      "runs about 11x slower than a top-left band; leave dcs_window_plan at "
      "'split', or use NO_LOAD_BALANCE with a window.", RuntimeWarning,
      stacklevel=4)


@dataclasses.dataclass(frozen=True)
class CPConfig:
  """Static (hashable) layout of one CP attention call.

  Attributes:
    strategy: the load-balancing strategy.
    cp_axis: the mesh axis the row is split over (None: no CP).
    cp_size: its size.
    causal: causal (else unmasked) attention.
    scale: the softmax scale.
    backend: the resolved attention backend.
    total_tokens: T, the tokens of the whole row.
    max_seqlen: W, the bound on any padded document length (``<= T``).
    split_causal_backward: run the backward of bottom-right blocks as an
      unmasked rectangle plus a top-left triangle.
    exchange: how K/V travel between ranks.
    window_left: the left bound of a causal sliding window (a query at
      document position ``i`` sees keys ``[i - window_left, i]``); -1: none.
    bound_check: what a step does in-graph when its metadata holds a padded
      document longer than ``max_seqlen`` (:mod:`jax_cp.seqlen_guard`):
      ``"fallback"`` (run ``unbounded``), ``"error"`` (a ``checkify``
      check), ``"trusted"`` (checked on the host: no branch, outputs made
      NaN where the bound is broken all the same,
      :func:`jax_cp.seqlen_guard.poison`), or None: nothing to check (no
      bound below T, concrete metadata, checked by value already, or a
      bounded program that is exact for longer documents too).
    unbounded: with ``bound_check="fallback"``, the same call with
      ``max_seqlen = T`` (the all-gather, or a sliding window's halo;
      bounds of the row length).
    keep_gathered_kv: the forward keeps the all-gathered K/V for the
      backward instead of gathering them again: when they are at most the
      size of the local Q (``2 * cp * Hkv <= Hq``, e.g. GQA at cp = 2), so
      residual memory grows by at most Q's. The backward then has no
      all-gather to wait for.
    dcs_window_plan: DUAL_CHUNK_SWAP's plan with a window (docs/design.md,
      Call plans): ``"split"`` (the default) runs each chunk as a top-left
      band, an unmasked near rectangle and a top-left far triangle over
      reversed rows and keys, each way; ``"split_backward"`` the forward
      as one banded bottom-right call and the backward split;
      ``"bottom_right"`` banded bottom-right calls each way, whose cuDNN
      backward is much slower. The ``dcs_window_plan`` argument of
      :func:`jax_cp.cp_attention`, for measurements.
  """

  strategy: CPLoadBalancingStrategy
  cp_axis: str | None
  cp_size: int
  causal: bool
  scale: float
  backend: AttentionBackend
  total_tokens: int
  max_seqlen: int
  split_causal_backward: bool
  exchange: KVExchange
  window_left: int = -1
  bound_check: str | None = None
  unbounded: CPConfig | None = None
  keep_gathered_kv: bool = False
  dcs_window_plan: str = "split"

  @property
  def local_tokens(self) -> int:
    """Tl = T / cp, the tokens of one rank's chunk."""
    return self.total_tokens // self.cp_size


def make_config(q_shape, k_shape, v_shape, dtype, cu_seqlens,
                cu_seqlens_padded, *, cp_size: int, cp_axis: str | None,
                load_balancing_strategy: Any, cp_comm_type: str,
                attn_mask_type: str, softmax_scale: float | None,
                backend: str, max_seqlen: int | None, window_size: Any,
                split_causal_backward: bool | None, total_tokens: int,
                platform: str | None = None,
                max_seqlen_violation: str = "fallback",
                dcs_window_plan: str = "split") -> CPConfig:
  """Validates everything that can be checked now and builds the config.

  Shapes are the global ``[.., T, H, D]`` ones (or the local ones with
  ``total_tokens = Tl * cp``); ``cu_seqlens``/``cu_seqlens_padded`` the row
  metadata, checked by value when concrete. With traced metadata and a
  bound below T, the step checks the bound in-graph as
  ``max_seqlen_violation`` says (:attr:`CPConfig.bound_check`).
  """
  strategy = as_strategy(load_balancing_strategy)
  checks.check_qkv_shapes(q_shape, k_shape, v_shape)
  checks.check_attention_config(strategy, attn_mask_type, cp_comm_type,
                                window_size, dtype)
  window_left = checks.check_window_size(window_size, attn_mask_type)
  checks.check_cu_seqlens_rank(q_shape, cu_seqlens=cu_seqlens,
                               cu_seqlens_padded=cu_seqlens_padded)
  checks.check_divisible_tokens(total_tokens, cp_size)
  checks.check_cu_seqlens_padded(cu_seqlens_padded, total_tokens)
  checks.check_cu_seqlens(cu_seqlens, cu_seqlens_padded)
  if strategy is _DCS and cp_size > 1:
    checks.check_dual_chunk_divisible(cu_seqlens_padded, cp_size)
  bound = checks.check_max_seqlen(max_seqlen, cu_seqlens_padded, total_tokens)
  checks.check_max_seqlen_violation(max_seqlen_violation)
  checks.check_dcs_window_plan(dcs_window_plan)
  resolved = resolve_backend(
      backend, platform, dtype,
      score_bytes=4 * int(q_shape[-2]) * int(total_tokens) ** 2)

  def config(w: int) -> CPConfig:
    """The layout for the bound ``w``."""
    left = window_left
    if strategy is _DCS and left >= w - 1:
      left = -1    # no document is longer than the window: plain causal
    split = split_causal_backward
    if split is None:
      split = resolved.name == "cudnn"
    if left >= 0:
      # The rectangle of a split bottom-right block would need the band too:
      # windowed blocks run their backward whole.
      split = False
    exchange = choose_exchange(
        strategy is _NLB, cp_axis, cp_size, total_tokens, w,
        communicate=cp_comm_type != checks.CP_COMM_LOCAL_COPIES,
        window_left=left)
    keep = (exchange.kind == "all_gather" and
            2 * cp_size * k_shape[-2] <= q_shape[-2])
    if (strategy is _DCS and cp_size > 1 and left >= 0
        and dcs_window_plan == "bottom_right" and resolved.name == "cudnn"):
      _warn_bottom_right_window()
    return CPConfig(strategy=strategy, cp_axis=cp_axis, cp_size=cp_size,
                    causal=attn_mask_type == "causal",
                    scale=default_scale(q_shape[-1], softmax_scale),
                    backend=resolved, total_tokens=total_tokens,
                    max_seqlen=w, split_causal_backward=bool(split),
                    exchange=exchange,
                    window_left=left, keep_gathered_kv=keep,
                    dcs_window_plan=dcs_window_plan)

  cfg = config(bound)
  if bound >= total_tokens or checks.concrete(cu_seqlens_padded) is not None:
    return cfg    # no bound, or one checked by value above
  if max_seqlen_violation == "error":
    return dataclasses.replace(cfg, bound_check="error")
  unbounded = config(total_tokens)
  if seqlen_guard.bounded_program_is_exact(cfg, unbounded):
    return cfg
  if max_seqlen_violation == "checked_on_host":
    # The caller checked the values: no branch, only the poison.
    return dataclasses.replace(cfg, bound_check="trusted")
  return dataclasses.replace(cfg, bound_check="fallback", unbounded=unbounded)
