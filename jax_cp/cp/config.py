"""The validated, static configuration of one CP attention call.

:func:`make_config` checks every argument that can be checked before
tracing (:mod:`jax_cp.cp.validation`, :mod:`jax_cp.attention.validation`),
resolves the backend and chooses the K/V exchange, once per call; the
resulting :class:`CPConfig` is hashable and travels into the ``shard_map``
and the ``custom_vjp`` as static data, so forward and backward read the
same instance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.backend import AttentionBackend
from jax_cp.attention.determinism import resolve_deterministic
from jax_cp.attention.registry import resolve_backend
from jax_cp.attention.validation import (
  check_qkv_dtypes,
  check_qkv_shapes,
  check_window_size,
  concrete,
  default_scale,
)
from jax_cp.cp import guard, validation
from jax_cp.cp.exchange import (
  HEAD_SCATTERS,
  HeadScatter,
  KVExchange,
  choose_exchange,
  head_scatter_split,
)
from jax_cp.cp.layout import CPLayout
from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy


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
    exchange: how K/V travel between ranks.
    window_left: the left bound of a causal sliding window (a query at
      document position ``i`` sees keys ``[i - window_left, i]``); -1: none.
    bound_check: what a step does in-graph when its metadata holds a padded
      document longer than ``max_seqlen`` (:mod:`jax_cp.cp.guard`):
      ``"fallback"`` (run ``unbounded``), ``"trusted"`` (checked on the
      host: no branch, outputs made NaN where the bound is broken all the
      same), or None: nothing to check (no bound below T, concrete
      metadata, checked by value already, or a bounded program that is
      exact for longer documents too).
    unbounded: with ``bound_check="fallback"``, the same call with
      ``max_seqlen = T`` (the all-gather, or a sliding window's halo;
      bounds of the row length).
    keep_gathered_kv: the forward keeps the all-gathered K/V for the
      backward instead of gathering them again: when they are at most the
      size of the local Q (``2 * cp * Hkv <= Hq``, e.g. GQA at cp = 2), so
      residual memory grows by at most Q's. The backward then has no
      all-gather to wait for.
    zero_padding: the rows may hold padding tokens, so q, k, v (and the
      output's cotangent) are cleared there before any backend call
      (:mod:`jax_cp.attention.padding`); False when concrete metadata
      show none (``cu_seqlens == cu_seqlens_padded``).
    inner: with an all-to-all ``exchange`` (:class:`~jax_cp.cp.exchange.
      all_to_all.HeadScatter`), the config of the program that runs on the
      scattered heads: cp = 1 on whole rows, or the ring over the outer
      axis (hierarchical); None otherwise.
    poison: None, or, inside a traced step with ``bound_check="trusted"``
      and a backend with ``handles_poison``, the int32 flag of a broken
      bound (:func:`jax_cp.cp.guard.poisoned_config`) that every call of
      the step's plan carries in its segments (:attr:`Segments.poison`,
      :func:`jax_cp.cp.strategies.call_plan.poisoned`). Traced: not part of the
      static identity (not compared, not hashed).
  """

  strategy: CPLoadBalancingStrategy
  cp_axis: str | None
  cp_size: int
  causal: bool
  scale: float
  backend: AttentionBackend
  total_tokens: int
  max_seqlen: int
  exchange: KVExchange | HeadScatter
  window_left: int = -1
  bound_check: str | None = None
  unbounded: CPConfig | None = None
  keep_gathered_kv: bool = False
  zero_padding: bool = True
  inner: CPConfig | None = None
  poison: jax.Array | None = dataclasses.field(default=None, compare=False)

  @property
  def local_tokens(self) -> int:
    """Tl = T / cp, the tokens of one rank's chunk."""
    return self.total_tokens // self.cp_size

  def rank(self):
    """This rank's int32 index on the cp axis (0 without CP); inside the
    ``shard_map``."""
    if self.cp_size == 1:
      return jnp.int32(0)
    return jax.lax.axis_index(self.cp_axis).astype(jnp.int32)

  @property
  def deterministic(self) -> bool:
    """The deterministic mode (docs/determinism.md): the backend runs its
    deterministic backward and the exchange sums in a fixed order."""
    return bool(getattr(self.backend, "deterministic", False))

  @property
  def split_bottom_right_backward(self) -> bool:
    """Bottom-right blocks run their backward as a rectangle and a
    triangle (the backend's preference; never with a window, whose
    rectangle would need the band)."""
    return self.backend.split_bottom_right_backward and self.window_left < 0


def make_config(layout: CPLayout, q, k, v, cu_seqlens, cu_seqlens_padded,
                *, cp_size: int, total_tokens: int,
                attn_mask_type: str, softmax_scale: float | None,
                window_size, trusted: bool,
                platform: str | None = None,
                axis_sizes: tuple[int, ...] | None = None,
                head_shards: int = 1) -> CPConfig:
  """Validates everything that can be checked now and builds the config.

  ``q``, ``k``, ``v`` (arrays or ``jax.ShapeDtypeStruct``) have the global
  shapes ``[.., T, H, D]`` (or the local ones with ``total_tokens = Tl *
  cp``); ``cu_seqlens``/``cu_seqlens_padded`` the row
  metadata, checked by value when concrete. With traced metadata and a
  bound below T, the step checks the bound in-graph: ``trusted`` (a batch
  checked on the host) only poisons a broken bound, otherwise a fallback
  runs the unbounded program (:attr:`CPConfig.bound_check`).

  ``axis_sizes`` are the sizes of the layout's cp axes (needed by
  ``comm_type="all_to_all+ring"``), ``head_shards`` the head axis's size
  in the global view (the all-to-all scatters each shard's heads).
  """
  strategy = layout.strategy
  q_shape, k_shape, dtype = q.shape, k.shape, q.dtype
  check_qkv_shapes(q.shape, k.shape, v.shape)
  check_qkv_dtypes(q.dtype, k.dtype, v.dtype)
  validation.check_attention_config(strategy, attn_mask_type, window_size,
                                    dtype)
  window_left = check_window_size(window_size, attn_mask_type)
  comm = layout.comm_type
  # The program after an all-to-all: cp = 1 on whole rows, or the ring
  # over the outer axis (docs/internals.md, All-to-all exchanges).
  split = None if cp_size == 1 else head_scatter_split(
      comm, layout.cp_axis, tuple(axis_sizes or (cp_size,)))
  scatter = split is not None
  if scatter:
    outer_axis, outer, scatter_size = (split.outer_axis, split.outer_size,
                                       split.size)
    comm = split.inner_comm_type
  else:
    outer_axis, outer, scatter_size = layout.cp_axis, cp_size, 1
    if comm in HEAD_SCATTERS:
      comm = "all_gather"     # cp = 1: nothing travels
  if scatter:
    validation.check_head_scatter(q_shape[-2] // head_shards,
                                  k_shape[-2] // head_shards, scatter_size,
                                  layout.comm_type)
  validation.check_comm_type(comm, strategy, window_left, outer,
                             total_tokens)
  # Heads per head-axis shard; K/V heads are repeated where there are
  # fewer than the all-to-all's ranks.
  q_local, kv_local = q_shape[-2] // head_shards, k_shape[-2] // head_shards
  kv_repeat = 1 if kv_local % scatter_size == 0 else \
      scatter_size // kv_local
  validation.check_cu_seqlens_rank(q_shape, cu_seqlens=cu_seqlens,
                                   cu_seqlens_padded=cu_seqlens_padded)
  validation.check_divisible_tokens(total_tokens, cp_size)
  validation.check_cu_seqlens_padded(cu_seqlens_padded, total_tokens)
  validation.check_cu_seqlens(cu_seqlens, cu_seqlens_padded)
  strategy_for(strategy).check_padded_lengths(cu_seqlens_padded, cp_size)
  bound = validation.check_max_seqlen(layout.max_seqlen, cu_seqlens_padded,
                                      total_tokens, cu_seqlens, strategy,
                                      cp_size)
  deterministic = resolve_deterministic(layout.deterministic)
  resolved = resolve_backend(
      layout.backend, platform, dtype,
      score_bytes=4 * int(q_shape[-2]) * int(total_tokens) ** 2,
      deterministic=deterministic)

  cu, cuP = concrete(cu_seqlens), concrete(cu_seqlens_padded)
  # No padding token to clear when concrete metadata show none.
  zero_padding = cu is None or cuP is None or not np.array_equal(cu, cuP)

  def config(w: int) -> CPConfig:
    """The layout for the bound ``w``."""
    left = strategy_for(strategy).window_within_bound(window_left, w)
    exchange = choose_exchange(strategy, outer_axis, outer,
                               total_tokens, w, window_left=left,
                               comm_type=comm,
                               deterministic=deterministic)
    keep = (exchange.gathers_row and
            2 * outer * kv_local * kv_repeat <= q_local)
    return CPConfig(strategy=strategy, cp_axis=outer_axis,
                    cp_size=outer, causal=attn_mask_type == "causal",
                    scale=default_scale(q_shape[-1], softmax_scale),
                    backend=resolved, total_tokens=total_tokens,
                    max_seqlen=w, exchange=exchange, window_left=left,
                    keep_gathered_kv=keep, zero_padding=zero_padding)

  def checked(cfg: CPConfig) -> CPConfig:
    if bound >= total_tokens or concrete(cu_seqlens_padded) is not None:
      return cfg    # no bound, or one checked by value above
    unbounded = config(total_tokens)
    if guard.bounded_program_is_exact(cfg, unbounded):
      return cfg
    if trusted:
      # Checked on the host: no branch, only the poison.
      return dataclasses.replace(cfg, bound_check="trusted")
    return dataclasses.replace(cfg, bound_check="fallback",
                               unbounded=unbounded)

  cfg = checked(config(bound))
  if not scatter:
    return cfg
  exchange = HeadScatter(
      axis=split.axis, size=scatter_size, outer_axis=outer_axis,
      outer_size=outer, total_tokens=total_tokens,
      strategy=strategy, kv_repeat=kv_repeat)
  return dataclasses.replace(cfg, cp_axis=layout.cp_axis, cp_size=cp_size,
                             exchange=exchange, inner=cfg, bound_check=None,
                             unbounded=None, keep_gathered_kv=False)
