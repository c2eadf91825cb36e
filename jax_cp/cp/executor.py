"""The plan executor: a rank's forward and backward as the calls of its
plan (:func:`jax_cp.cp.strategies.call_plan.forward_plan`,
:func:`~jax_cp.cp.strategies.call_plan.backward_plan`), over the local
K/V and the buffer its exchange received (docs/internals.md, Call
plans). The exchanges whose steps are the plan's
(:class:`~jax_cp.cp.exchange.base.KVExchange`: none, all-gather, halo)
run it; the ring runs steps of its own.

Forward: exchange K/V (:meth:`KVExchange.receive`), then run the calls
in order, each by its kind: a
:class:`~jax_cp.cp.strategies.calls.RowsCall` writes its rows into the
first call's outputs (in place where the backend can) or has them added,
a :class:`~jax_cp.cp.strategies.no_load_balance.HaloCall` and the
:class:`~jax_cp.cp.strategies.dual_chunk_swap.CompactCalls` are merged
by log-sum-exp. Backward: the local residuals (plus a small received
halo, :attr:`KVExchange.keeps_halo`, or all-gathered K/V no larger than
Q, :attr:`CPConfig.keep_gathered_kv`), the exchange again where it must,
the backward plan, and dK/dV back to their owners
(:meth:`KVExchange.scatter`).

Inputs are batched: q ``[B, Tl, Hq, D]``, k/v ``[B, Tl, Hkv, D]``, row
metadata ``[B, N+1]`` int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_cp.attention.api import window_kwargs
from jax_cp.attention.backend import packed
from jax_cp.attention.decompose import straddle
from jax_cp.attention.decompose.merge import GradSum, add, merge_softmax
from jax_cp.cp.strategies import call_plan
from jax_cp.cp.strategies.call_plan import CompactCalls, HaloCall, RowsCall


class _KV:
  """The K/V a rank's calls read: its local chunk, and the exchanged
  buffer (the all-gathered row ``gathered``, or the received ``halo``
  ``[B, H, 2*Hkv, D]``, K heads first)."""

  def __init__(self, cfg, k, v, gathered=None, halo=None):
    self.cfg, self.k, self.v = cfg, k, v
    self.gathered, self.halo = gathered, halo

  @classmethod
  def exchange(cls, cfg, k, v, cu_seqlens_padded):
    gathered, halo = cfg.exchange.receive(k, v, cu_seqlens_padded)
    return cls(cfg, k, v, gathered=gathered, halo=halo)

  def exchanged(self):
    """The exchanged buffer, ``(k, v)``."""
    if self.halo is not None:
      hk = self.k.shape[2]
      return self.halo[:, :, :hk], self.halo[:, :, hk:]
    return self.gathered

  def of(self, call: RowsCall):
    return self.exchanged() if call.exchanged else (self.k, self.v)

  def before_chunk(self, rows: int):
    """The ``rows`` K/V rows right before the chunk, in sequence order:
    the received halo, or rows ``[lo - rows, lo)`` of the all-gathered
    row, zero rows standing for those before row 0 (no document reaches
    there)."""
    if self.halo is not None:
      return self.exchanged()
    lo = self.cfg.rank() * self.k.shape[1]
    pad = lambda x: jnp.pad(x, [(0, 0), (rows, 0), (0, 0), (0, 0)])
    return tuple(jax.lax.dynamic_slice_in_dim(pad(x), lo, rows, axis=1)
                 for x in self.gathered)

  def halo_kv(self, call: HaloCall):
    if call.before_chunk is None:
      return self.exchanged()
    return self.before_chunk(call.before_chunk)

  def place_before_chunk(self, g, rows: int):
    """A gradient of :meth:`before_chunk`'s rows as one of the exchanged
    buffer: itself for a received halo, else in place in a row of
    zeros."""
    if self.halo is not None:
      return g
    lo = self.cfg.rank() * self.k.shape[1]
    t = self.gathered[0].shape[1]
    zeros = jnp.zeros((g.shape[0], t + rows) + g.shape[2:], g.dtype)
    return jax.lax.dynamic_update_slice_in_dim(zeros, g, lo, axis=1)[:, rows:]


def _gather_rows(x, idx, valid, fill=0):
  """Rows ``idx [B, n]`` of axis 1 of ``x [B, T, ...]``, ``fill`` where
  not ``valid [B, n]``: the compact buffers of windowed DUAL_CHUNK_SWAP
  (:class:`~jax_cp.cp.strategies.call_plan.CompactCalls`), and their results put
  back."""
  tail = (1,) * (x.ndim - 2)
  g = jnp.take_along_axis(x, idx.reshape(idx.shape + tail), axis=1)
  return jnp.where(valid.reshape(valid.shape + tail), g,
                   jnp.asarray(fill, x.dtype))


def _compact_kv(rows, kv: _KV):
  kx, vx = kv.exchanged()
  return (_gather_rows(kx, rows.kv_src, rows.kv_valid),
          _gather_rows(vx, rows.kv_src, rows.kv_valid))


def forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded,
            need_lse: bool = True):
  """(out, lse, saved): ``saved`` is what the backward reuses of the
  exchange: the received K|V halo when the exchange keeps it, the
  all-gathered ``(k, v)`` with :attr:`CPConfig.keep_gathered_kv`, else
  None. Without ``need_lse`` (a forward nothing differentiates) a plan of
  one call runs the backend's inference form and lse is None."""
  backend = cfg.backend
  kv = _KV.exchange(cfg, k, v, cu_seqlens_padded)
  plan = call_plan.poisoned(list(call_plan.forward_plan(
      cfg, cu_seqlens, cu_seqlens_padded, cfg.rank())), cfg.poison)
  if (not need_lse and backend.forward_out is not None and len(plan) == 1
      and isinstance(plan[0], RowsCall)):
    call = plan[0]
    kc, vc = kv.of(call)
    o = backend.forward_out(packed(q), packed(kc), packed(vc), call.segments,
                            mask=call.mask, scale=cfg.scale,
                            **window_kwargs(call.window_left))
    return o.reshape(q.shape).astype(q.dtype), None, None
  out = lse = None
  for call in plan:
    if isinstance(call, RowsCall):
      kc, vc = kv.of(call)
      extra = window_kwargs(call.window_left)
      if call.into:
        # The earlier calls' outputs hold 0 / -inf on this call's rows.
        extra.update(into=(packed(out), packed(lse)))
      o, l = backend.forward(packed(q), packed(kc), packed(vc), call.segments,
                             mask=call.mask, scale=cfg.scale, **extra)
      o, l = o.reshape(q.shape), l.reshape(q.shape[:3])
      if out is None or call.into:
        out, lse = o, l
      else:
        out, lse = add(out, o), jnp.maximum(lse, l)
    elif isinstance(call, HaloCall):
      if kv.halo is not None:
        # The halo call waits for the halo: keep it after the earlier
        # calls, which then hide the exchange (XLA may otherwise schedule
        # it first).
        kv.halo, out, lse = jax.lax.optimization_barrier(
            (kv.halo, out, lse))
      kh, vh = kv.halo_kv(call)
      o_h, l_h = straddle.forward(backend, call.call, q, kh, vh,
                                  scale=cfg.scale)
      out, lse = straddle.merge(out, lse, o_h, l_h, call.call,
                                backend.merge_rows)
    else:
      out, lse = _compact_forward(cfg, call, q, kv, out, lse)
  if cfg.keep_gathered_kv:
    saved = kv.gathered
  else:
    saved = kv.halo if cfg.exchange.keeps_halo else None
  return out.astype(q.dtype), lse, saved


def _compact_forward(cfg, call: CompactCalls, q, kv: _KV, out,
                     lse):
  """The near and far parts' rows, merged among themselves, put back on
  the local rows and merged into ``out``/``lse`` by log-sum-exp."""
  rows = call.rows
  qc = _gather_rows(q, rows.q_src, rows.q_valid)
  kc, vc = _compact_kv(rows, kv)
  parts = []
  for seg, mask in call.calls:
    o, l = cfg.backend.forward(packed(qc), packed(kc), packed(vc), seg,
                               mask=mask, scale=cfg.scale)
    parts.append((o.reshape(qc.shape), l.reshape(qc.shape[:3])))
  o, l = merge_softmax(*parts[0], parts[1:])
  return merge_softmax(out, lse, [
      (_gather_rows(o, rows.q_inv, rows.q_has),
       _gather_rows(l, rows.q_inv, rows.q_has, -jnp.inf))])


def backward(cfg, residuals, dout):
  """(dq, dk, dv) of this rank's chunk."""
  q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, saved = residuals
  backend = cfg.backend
  if isinstance(saved, tuple):
    kv = _KV(cfg, k, v, gathered=saved)       # all-gathered in the forward
  elif saved is not None:
    kv = _KV(cfg, k, v, halo=saved)
  else:
    # The barrier keeps XLA from merging this re-gather with the forward's
    # (which would keep the exchanged K/V alive from forward to backward).
    k, v = jax.lax.optimization_barrier((k, v))
    kv = _KV.exchange(cfg, k, v, cu_seqlens_padded)
  dout = dout.astype(out.dtype)
  dq, dk, dv, dkx, dvx = GradSum(), GradSum(), GradSum(), GradSum(), GradSum()
  for call in call_plan.poisoned(call_plan.backward_plan(
      cfg, cu_seqlens, cu_seqlens_padded, cfg.rank()), cfg.poison):
    if isinstance(call, RowsCall):
      kc, vc = kv.of(call)
      extra = window_kwargs(call.window_left)
      if call.into:
        extra.update(dq_into=packed(dq.full))
      dq_i, dk_i, dv_i = backend.backward(
          packed(q), packed(kc), packed(vc), packed(out),
          lse.reshape(-1, q.shape[2]), packed(dout), call.segments,
          mask=call.mask, scale=cfg.scale, **extra)
      dq_i = dq_i.reshape(q.shape)
      if call.into:
        dq.full = dq_i
      else:
        dq.add(dq_i, None)
      (dkx if call.exchanged else dk).add(dk_i.reshape(kc.shape), None)
      (dvx if call.exchanged else dv).add(dv_i.reshape(vc.shape), None)
    elif isinstance(call, HaloCall):
      kh, vh = kv.halo_kv(call)
      dq_h, dk_h, dv_h = straddle.backward(backend, call.call, q, kh, vh,
                                           out, lse, dout, scale=cfg.scale)
      dq.add(dq_h, dq_h.shape[1])
      if call.before_chunk is not None:
        dk_h = kv.place_before_chunk(dk_h, call.before_chunk)
        dv_h = kv.place_before_chunk(dv_h, call.before_chunk)
      dkx.add(dk_h, None)
      dvx.add(dv_h, None)
    else:
      _compact_backward(cfg, call, q, out, lse, dout, kv, dq, dkx, dvx)
  merge = backend.merge_rows
  dq = dq.total(merge, q.dtype)
  dk, dv = dk.total(merge, k.dtype), dv.total(merge, v.dtype)
  dkx, dvx = dkx.total(merge, k.dtype), dvx.total(merge, v.dtype)
  if dkx is not None:
    # Gradients of the exchanged K/V go back to their owners and are merged
    # into the local ones (dk/dv may be None: DUAL_CHUNK_SWAP has no local
    # call).
    dk, dv = cfg.exchange.scatter(dkx, dvx, cu_seqlens_padded, into=(dk, dv),
                                  merge_rows=merge)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _compact_backward(cfg, call: CompactCalls, q, out, lse, dout,
                      kv: _KV, dq: GradSum, dkx: GradSum, dvx: GradSum):
  """The near and far parts' gradients, summed in the compact buffers and
  put back on their rows: dq on the local ones, dK/dV on the exchanged
  ones (per step: the two steps' regions may hold the same key)."""
  rows = call.rows
  qc, oc, lc, dc = (_gather_rows(x, rows.q_src, rows.q_valid)
                    for x in (q, out, lse, dout))
  kc, vc = _compact_kv(rows, kv)
  dqc, dkc, dvc = GradSum(), GradSum(), GradSum()
  for seg, mask in call.calls:
    dq_i, dk_i, dv_i = cfg.backend.backward(
        packed(qc), packed(kc), packed(vc), packed(oc),
        lc.reshape(-1, q.shape[2]), packed(dc), seg, mask=mask,
        scale=cfg.scale)
    dqc.add(dq_i.reshape(qc.shape), None)
    dkc.add(dk_i.reshape(kc.shape), None)
    dvc.add(dv_i.reshape(vc.shape), None)
  dq.add(_gather_rows(dqc.full, rows.q_inv, rows.q_has), None)
  for part, total in ((dkc, dkx), (dvc, dvx)):
    total.add(sum(_gather_rows(part.full, rows.kv_inv[st],
                               rows.kv_has[st]).astype(jnp.float32)
                  for st in (0, 1)), None)
