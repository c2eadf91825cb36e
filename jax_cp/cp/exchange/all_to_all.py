"""The all-to-all exchanges: tokens over cp traded for heads over cp
(docs/internals.md, All-to-all exchanges).

``comm_type="all_to_all"`` (Ulysses): rank ``j`` of the all-to-all axis
sends every other rank ``i`` the heads ``i`` attends, for its own tokens,
and receives its own heads for every rank's tokens: q, k, v go from
``[B, T/cp, H, D]`` to ``[B, T, H/cp, D]``, the row in the order of its
ranks. The strategy's token placement is put back into sequence order
(DUAL_CHUNK_SWAP; NO_LOAD_BALANCE's chunks are in order already), the
whole rows are attended by the cp = 1 program, and the output takes the
way back. Differentiable by JAX: the all-to-all's transpose is the
all-to-all back, and the reordering is a gather whose transpose is the
inverse gather (:func:`_take_rows`).

``comm_type="all_to_all+ring"`` (hierarchical) over ``cp_axis=(outer,
inner)``: the same all-to-all over the inner axis only. Under both
strategies the tokens the inner ranks of outer rank ``o`` hold together
are exactly what rank ``o`` holds in the same strategy's placement for
``cp_outer`` ranks (DUAL_CHUNK_SWAP: chunks ``[o·ci, (o+1)·ci)`` of
``2·cp`` are chunk ``o`` of ``2·cp_outer``, and likewise the mirrored
ones), so after the reordering the inner program is the ring over the
outer axis at ``cp_outer``, on ``H/ci`` heads.

K/V heads: with ``Hkv % ci == 0`` each rank gets ``Hkv/ci`` of them; with
fewer K/V heads than ranks (``ci % Hkv == 0``, MQA included) each is
repeated ``ci/Hkv`` times before the all-to-all, so it reaches the ranks
whose query heads read it (their gradients are summed on the way back).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy


@jax.custom_vjp
def _take_rows(x, idx, inv):
  """Rows ``idx [B, n]`` of axis 1 of ``x [B, n, ...]`` (a permutation
  whose inverse is ``inv``); the transpose gathers with ``inv``, no
  scatter."""
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)),
                             axis=1)


def _take_rows_fwd(x, idx, inv):
  return _take_rows(x, idx, inv), (idx, inv)


def _take_rows_bwd(res, g):
  idx, inv = res
  return _take_rows(g, inv, idx), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class Split(NamedTuple):
  """Where a layout's all-to-all runs and what runs after it."""

  axis: str | tuple[str, ...]      # the all-to-all's axis (or axes)
  size: int                        # its size ci
  outer_axis: str | None           # the axis of the program after it
  outer_size: int                  # its size co
  inner_comm_type: str             # that program's exchange


def whole_rows(cp_axis, axis_sizes: tuple[int, ...]) -> Split:
  """``comm_type="all_to_all"``: over every cp axis; the cp = 1 program
  on whole rows after it."""
  return Split(cp_axis, math.prod(axis_sizes), None, 1, "all_gather")


def inner_then_ring(cp_axis, axis_sizes: tuple[int, ...]) -> Split:
  """``comm_type="all_to_all+ring"`` over ``cp_axis=(outer, inner)``: the
  all-to-all over the inner axis, the ring over the outer one."""
  outer, inner = cp_axis
  co, ci = axis_sizes
  return Split(inner, ci, outer if co > 1 else None, co, "ring")


@dataclasses.dataclass(frozen=True)
class HeadScatter:
  """The all-to-all of q, k, v (heads scattered) and of the output (heads
  gathered back) over ``axis``; static and hashable.

  Attributes:
    axis: the mesh axis (or axes) of the all-to-all: all of ``cp_axis``,
      or its inner axis (hierarchical).
    size: its size ``ci``.
    outer_axis: the axis of the program after it (None: cp = 1, the
      whole row).
    outer_size: its size ``co`` (``cp = co · ci``).
    total_tokens: T, tokens per row.
    strategy: the layout's strategy, whose token placement the received
      rows are in (reordered unless its chunks are contiguous).
    kv_repeat: each K/V head is sent this many times (fewer K/V heads
      than ranks), else 1.
  """

  axis: str | tuple[str, ...]
  size: int
  outer_axis: str | None
  outer_size: int
  total_tokens: int
  strategy: CPLoadBalancingStrategy
  kv_repeat: int = 1

  kind = "all_to_all"

  @property
  def cp_size(self) -> int:
    return self.size * self.outer_size

  def _order(self, cu_seqlens_padded):
    """``(idx, inv)`` int32 ``[B, T/co]``: the received buffer (the inner
    ranks' chunks one after another) read at ``idx`` is the outer rank's
    buffer in the strategy's placement at ``co`` (the row in sequence
    order at ``co = 1``); ``inv`` the inverse. None where the strategy's
    chunks are contiguous (the received rows are in order)."""
    st = strategy_for(self.strategy)
    if st.contiguous_chunks:
      return None
    cp, co, t = self.cp_size, self.outer_size, self.total_tokens
    n, tl = t // co, t // cp
    o = (jnp.int32(0) if self.outer_axis is None else
         jax.lax.axis_index(self.outer_axis).astype(jnp.int32))
    pos = jnp.arange(n, dtype=jnp.int32)

    def one_row(cuP):
      cuP = cuP.astype(jnp.int32)
      # Physical positions of the outer rank's tokens, in its order.
      p_outer = pos if co == 1 else st.physical_index(jnp, cuP, co, o, pos,
                                                      n)
      idx = st.gathered_index(cuP, cp, t, p_outer) - o * n
      # Physical positions of the received rows, in their order.
      p_recv = st.physical_index(jnp, cuP, cp, o * self.size + pos // tl,
                                 pos % tl, tl)
      inv = p_recv if co == 1 else st.gathered_index(cuP, co, t,
                                                     p_recv) - o * n
      return idx, inv

    return jax.vmap(one_row)(jnp.asarray(cu_seqlens_padded))

  def _a2a(self, x, split_axis: int, concat_axis: int):
    return jax.lax.all_to_all(x, self.axis, split_axis=split_axis,
                              concat_axis=concat_axis, tiled=True)

  def to_heads(self, q, k, v, cu_seqlens_padded):
    """Local ``[B, Tl, H, D]`` q, k, v -> ``[B, T/co, H/ci, D]`` of this
    rank's heads, and the order to take the output back with."""
    ci = self.size
    if self.kv_repeat > 1:
      k = jnp.repeat(k, self.kv_repeat, axis=2)
      v = jnp.repeat(v, self.kv_repeat, axis=2)
    b, tl = q.shape[:2]
    hq, hk = q.shape[2] // ci, k.shape[2] // ci
    order = self._order(cu_seqlens_padded)
    if q.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype:
      # One collective: each rank's q, k and v heads side by side.
      x = jnp.concatenate([x.reshape(b, tl, ci, -1, x.shape[-1])
                           for x in (q, k, v)], axis=3)
      x = self._a2a(x.reshape(b, tl, -1, q.shape[-1]), 2, 1)
      if order is not None:
        x = _take_rows(x, *order)
      parts = x[:, :, :hq], x[:, :, hq:hq + hk], x[:, :, hq + hk:]
    else:
      parts = tuple(self._a2a(x, 2, 1) for x in (q, k, v))
      if order is not None:
        parts = tuple(_take_rows(x, *order) for x in parts)
    return parts, order

  def from_heads(self, out, order):
    """``[B, T/co, H/ci, Dv]`` output -> the local ``[B, Tl, H, Dv]``."""
    if order is not None:
      idx, inv = order
      out = _take_rows(out, inv, idx)
    return self._a2a(out, 1, 2)
