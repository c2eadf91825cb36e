"""The differentiable per-rank CP attention: forward and backward of one
rank's chunk under ``jax.custom_vjp``, run inside a ``shard_map``.

Forward: exchange K/V (:mod:`jax_cp.kv_exchange`), then run the calls of
:func:`jax_cp.call_plan.forward_calls`; their Q rows are disjoint, so each
later call writes its rows into the first call's outputs (in place with a
backend that ``supports_in_place``; otherwise its fresh outputs are added,
``lse`` by maximum), except a halo call, whose rows are merged by
log-sum-exp (:func:`_halo_forward`). Backward: keep only local residuals
(plus a small received halo, :attr:`KVExchange.keeps_halo`, or
all-gathered K/V no larger than Q, :attr:`CPConfig.keep_gathered_kv`),
exchange K/V again where it must, run
:func:`jax_cp.call_plan.backward_calls` with dq written as
:func:`jax_cp.call_plan.dq_writes` says (a reversed halo call,
:attr:`jax_cp.call_plan.Call.reversed`, reads reversed inputs:
:func:`_reversed_halo_backward`), and return dK/dV to their owners
(reduce-scatter, or reverse halo permutes merged with the backend's
``merge_rows``).
docs/design.md, Call plans and Exchange.

With traced metadata and a ``max_seqlen`` bound, forward and backward each
run under :func:`jax_cp.seqlen_guard.run`: a step whose padded documents
break the bound takes the unbounded program (:attr:`CPConfig.unbounded`).

Inputs are batched: q ``[B, Tl, Hq, D]``, k/v ``[B, Tl, Hkv, D]``, row
metadata ``[B, N+1]`` int32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_cp import call_plan, seqlen_guard
from jax_cp.attention.api import window_kwargs
from jax_cp.attention.merge import (
  NO_WEIGHT_LSE,
  GradSum,
  add,
  merge_softmax,
  merge_softmax_rows,
  reversed_prefix,
)
from jax_cp.cp_config import CPConfig
from jax_cp.modules.remat import CONTEXT


def _prefix(x, rows: int | None):
  """The first ``rows`` rows of axis 1 (all when None)."""
  return x if rows is None else x[:, :rows]


def _flat(x):
  """``[B, T, ...]`` -> ``[B*T, ...]``: the backend's packed layout."""
  return x.reshape((-1,) + x.shape[2:])


def _rank(cfg: CPConfig):
  if cfg.cp_size == 1:
    return jnp.int32(0)
  return jax.lax.axis_index(cfg.cp_axis).astype(jnp.int32)


def _call_kv(call: call_plan.Call, k, v, k_exchanged, v_exchanged, halo):
  """The K/V a call reads: the local chunk, the received halo, or the
  all-gathered buffer, each cut to its first ``kv_rows`` rows."""
  if not call.exchanged:
    k_exchanged, v_exchanged = k, v
  elif halo is not None:
    hk = k.shape[2]
    k_exchanged, v_exchanged = halo[:, :, :hk], halo[:, :, hk:]
  return (_prefix(k_exchanged, call.kv_rows),
          _prefix(v_exchanged, call.kv_rows))


def _exchange(cfg: CPConfig, k, v, cu_seqlens_padded):
  """(k_exchanged, v_exchanged, halo): the all-gathered buffers, or the
  received halo (None for what the exchange kind does not use)."""
  if cfg.exchange.kind == "halo":
    return None, None, cfg.exchange.receive_halo(k, v)
  kx, vx = cfg.exchange.gather(k, v, cu_seqlens_padded)
  return kx, vx, None


def _gather_rows(x, idx, valid, fill=0):
  """Rows ``idx [B, n]`` of axis 1 of ``x [B, T, ...]``, ``fill`` where
  not ``valid [B, n]``: the compact buffers of DUAL_CHUNK_SWAP's windowed
  near and far calls (:attr:`jax_cp.call_plan.Call.window_rows`), and
  their results put back."""
  tail = (1,) * (x.ndim - 2)
  g = jnp.take_along_axis(x, idx.reshape(idx.shape + tail), axis=1)
  return jnp.where(valid.reshape(valid.shape + tail), g,
                   jnp.asarray(fill, x.dtype))


def _compact_kv(rows, kc, vc):
  return (_gather_rows(kc, rows.kv_src, rows.kv_valid),
          _gather_rows(vc, rows.kv_src, rows.kv_valid))


def _forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  """(out, lse, saved): what the backward reuses of the exchange, the
  received K|V halo when the exchange keeps it, the all-gathered
  ``(k, v)`` with :attr:`CPConfig.keep_gathered_kv`, else None."""
  backend = cfg.backend
  kx, vx, halo = _exchange(cfg, k, v, cu_seqlens_padded)
  out = lse = None
  compact, rows = [], None
  for call in call_plan.forward_calls(cfg, cu_seqlens, cu_seqlens_padded,
                                      _rank(cfg)):
    if call.window_rows is not None:
      if rows is None:
        rows = call.window_rows
        qc = _gather_rows(q, rows.q_src, rows.q_valid)
        kc, vc = _compact_kv(rows, *_call_kv(call, k, v, kx, vx, halo))
      o, l = backend.forward(
          _flat(qc), _flat(kc), _flat(vc),
          call_plan.segments(call, qc.shape[1], kc.shape[1]),
          mask=call.mask, scale=cfg.scale)
      compact.append((o.reshape(qc.shape), l.reshape(qc.shape[:3])))
      continue
    assert not call.overlaps_previous, call
    if call.exchanged and halo is not None and out is not None:
      # The halo call waits for the halo: keep it after the earlier calls,
      # which then hide the exchange (XLA may otherwise schedule it first).
      halo, out, lse = jax.lax.optimization_barrier((halo, out, lse))
    if call.halo_rows is not None:
      out, lse = _halo_forward(cfg, call, q, k, v, kx, vx, halo, out, lse)
      continue
    kc, vc = _call_kv(call, k, v, kx, vx, halo)
    seg = call_plan.segments(call, q.shape[1], kc.shape[1])
    in_place = out is not None and backend.supports_in_place
    # The first call's outputs hold 0 / -inf on the other calls' rows.
    extra = dict(into=(_flat(out), _flat(lse))) if in_place else {}
    extra.update(window_kwargs(call_plan.window_left(cfg, call)))
    o, l = backend.forward(_flat(q), _flat(kc), _flat(vc), seg,
                           mask=call.mask, scale=cfg.scale, **extra)
    o, l = o.reshape(q.shape), l.reshape(q.shape[:3])
    if out is None or in_place:
      out, lse = o, l
    else:
      out, lse = add(out, o), jnp.maximum(lse, l)
  if compact:
    # The near and far parts' rows, merged among themselves, put back on
    # the local rows and merged into the diagonals' by log-sum-exp.
    o, l = merge_softmax(*compact[0], compact[1:])
    out, lse = merge_softmax(out, lse, [
        (_gather_rows(o, rows.q_inv, rows.q_has),
         _gather_rows(l, rows.q_inv, rows.q_has, -jnp.inf))])
  if cfg.keep_gathered_kv:
    saved = (kx, vx)
  else:
    saved = halo if cfg.exchange.keeps_halo else None
  return out.astype(q.dtype), lse, saved


def _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded,
                     cfg: CPConfig):
  """:func:`_forward` under the bound check (:mod:`jax_cp.seqlen_guard`).
  Both branches save what the bounded program saves, in its shape: a
  bounded halo becomes zeros in the unbounded branch (its backward does not
  read them); all-gathered K/V are all-gathered by both."""

  def branch(c: CPConfig, q, k, v, cu, cuP):
    out, lse, halo = _forward(q, k, v, cu, cuP, c)
    if c is cfg.unbounded and cfg.keep_gathered_kv:
      assert c.exchange.kind == "all_gather", c.exchange
    elif c is cfg.unbounded:
      # Its backward exchanges again (with a sliding window it may keep a
      # halo of another size, dropped here); the residual takes the
      # bounded forward's shape: zeros shaped (and, in a shard_map checking
      # types, varying) like its halo, at most half a chunk, so a prefix of
      # the local K|V.
      halo = None
      if cfg.exchange.keeps_halo:
        h = cfg.exchange.halo_tokens
        halo = jnp.zeros_like(jnp.concatenate([k[:, :h], v[:, :h]], axis=2))
    return out, lse, halo

  return seqlen_guard.run(cfg, cu_seqlens_padded, branch, q, k, v,
                          cu_seqlens, cu_seqlens_padded)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def cp_attention_vjp(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  """This rank's attention output ``[B, Tl, Hq, D]``, differentiable in
  q, k, v."""
  return _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg)[0]


def _vjp_forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  out, lse, halo = _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded,
                                    cfg)
  # Named for jax.checkpoint policies (jax_cp.modules.remat): a policy that
  # saves "context" spares its backward the exchange and the forward calls.
  out, lse, halo = checkpoint_name((out, lse, halo), CONTEXT)
  # Residuals are local, plus a small received halo (KVExchange.keeps_halo):
  # all-gathered K/V are rebuilt in the backward.
  return out, (q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, halo)


def _vjp_backward(cfg: CPConfig, residuals, dout):
  def branch(c: CPConfig, residuals, dout):
    if c is cfg.unbounded and not cfg.keep_gathered_kv:
      residuals = residuals[:-1] + (None,)   # its forward kept no halo
    return _backward(c, residuals, dout)

  dq, dk, dv = seqlen_guard.run(cfg, residuals[4], branch, residuals, dout)
  return dq, dk, dv, None, None


def _reversed_rows(call: call_plan.Call, x, fill):
  """The Q-side input of a reversed halo call
  (:attr:`jax_cp.call_plan.Call.halo_rows`): its first ``call.q_rows``
  rows, ``fill`` past each batch entry's ``call.halo_rows``, reversed
  (:func:`jax_cp.attention.merge.reversed_prefix`)."""
  return reversed_prefix(x, call.q_rows, call.halo_rows, fill)


def _halo_kv(cfg: CPConfig, call: call_plan.Call, k, kx, vx, halo):
  """The ``H = call.kv_rows`` rows before the chunk, ``(kh, vh)``
  ``[B, H, Hkv, D]`` in sequence order: the received halo, or rows
  ``[lo - H, lo)`` of the all-gathered buffer, with zero rows standing for
  those before row 0 (no document reaches there)."""
  hk, hb = k.shape[2], call.kv_rows
  if halo is not None:
    return halo[:, :, :hk], halo[:, :, hk:]
  lo = _rank(cfg) * k.shape[1]
  pad = lambda x: jnp.pad(x, [(0, 0), (hb, 0), (0, 0), (0, 0)])
  return (jax.lax.dynamic_slice_in_dim(pad(kx), lo, hb, axis=1),
          jax.lax.dynamic_slice_in_dim(pad(vx), lo, hb, axis=1))


def _halo_forward(cfg: CPConfig, call: call_plan.Call, q, k, v, kx, vx,
                  halo, out, lse):
  """Runs a halo call's forward (:attr:`jax_cp.call_plan.Call.halo_rows`)
  and merges its rows into the local call's ``out``/``lse``
  (``attention.merge.merge_softmax_rows``): the straddling document's
  first rows then have attention over all their keys, local and before
  the chunk."""
  n = q.shape[1] if call.q_rows is None else min(call.q_rows, q.shape[1])
  if call.reversed:
    kh, vh = _halo_kv(cfg, call, k, kx, vx, halo)
    qr = _reversed_rows(call, q, None)
    seg = call_plan.segments(call, call.q_rows, call.kv_rows)
    o_r, l_r = cfg.backend.forward(
        _flat(qr), _flat(jnp.flip(kh, axis=1)), _flat(jnp.flip(vh, axis=1)),
        seg, mask=call.mask, scale=cfg.scale)
    o_h = jnp.flip(o_r.reshape(qr.shape), axis=1)[:, :n]
    l_h = jnp.flip(l_r.reshape(qr.shape[:3]), axis=1)[:, :n]
  else:
    kc, vc = _call_kv(call, k, v, kx, vx, halo)
    qc = q[:, :n]
    o_h, l_h = cfg.backend.forward(
        _flat(qc), _flat(kc), _flat(vc),
        call_plan.segments(call, n, kc.shape[1]), mask=call.mask,
        scale=cfg.scale)
    o_h, l_h = o_h.reshape(qc.shape), l_h.reshape(qc.shape[:3])
  valid = jnp.arange(n)[None, :] < call.halo_rows[:, None]        # [B, n]
  return merge_softmax_rows(out, lse, o_h, l_h, valid,
                            cfg.backend.merge_rows)


def _reversed_halo_backward(cfg: CPConfig, call: call_plan.Call, q, k, kx,
                            vx, halo, out, lse, dout):
  """Runs a reversed halo call's backward
  (:attr:`jax_cp.call_plan.Call.halo_rows`, built by
  ``call_plan._split_straddle``): its first ``call.q_rows`` local Q
  rows and the ``H = call.kv_rows`` exchanged rows before the chunk, both
  in reverse order, with out/dO zeroed and the lse made huge past each
  row's ``halo_rows``.

  Returns (dq ``[B, min(q_rows, Tl), Hq, D]``, dk, dv): dK/dV ``[B, H, ..]``
  of the received halo, or, with an all-gather, ``[B, T, ..]`` of the
  gathered buffer (zero outside the ``H`` rows)."""
  tl, hb = q.shape[1], call.kv_rows
  n = min(call.q_rows, tl)
  kh, vh = _halo_kv(cfg, call, k, kx, vx, halo)
  qr = _reversed_rows(call, q, 0)
  seg = call_plan.segments(call, call.q_rows, hb)
  dq_r, dk_r, dv_r = cfg.backend.backward(
      _flat(qr), _flat(jnp.flip(kh, axis=1)), _flat(jnp.flip(vh, axis=1)),
      _flat(_reversed_rows(call, out, 0)),
      _reversed_rows(call, lse, NO_WEIGHT_LSE).reshape(-1, q.shape[2]),
      _flat(_reversed_rows(call, dout, 0)), seg, mask=call.mask,
      scale=cfg.scale)
  dq_h = jnp.flip(dq_r.reshape(qr.shape), axis=1)[:, :n]
  dk_h = jnp.flip(dk_r.reshape(kh.shape), axis=1)
  dv_h = jnp.flip(dv_r.reshape(vh.shape), axis=1)
  if halo is None:
    lo = _rank(cfg) * tl
    t = kx.shape[1]
    place = lambda g: jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((g.shape[0], t + hb) + g.shape[2:], g.dtype), g, lo,
        axis=1)[:, hb:]
    dk_h, dv_h = place(dk_h), place(dv_h)
  return dq_h, dk_h, dv_h


def _backward(cfg: CPConfig, residuals, dout):
  """(dq, dk, dv) of this rank's chunk."""
  q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, saved = residuals
  backend = cfg.backend
  kx = vx = halo = None
  if isinstance(saved, tuple):
    kx, vx = saved           # all-gathered in the forward
  elif saved is not None:
    halo = saved
  else:
    # The barrier keeps XLA from merging this re-gather with the forward's
    # (which would keep the exchanged K/V alive from forward to backward).
    k, v = jax.lax.optimization_barrier((k, v))
    kx, vx, halo = _exchange(cfg, k, v, cu_seqlens_padded)
  dout = dout.astype(out.dtype)
  dq, dk, dv, dkx, dvx = GradSum(), GradSum(), GradSum(), GradSum(), GradSum()
  calls = call_plan.backward_calls(cfg, cu_seqlens, cu_seqlens_padded,
                                   _rank(cfg))
  writes = call_plan.dq_writes(calls, backend.supports_in_place)
  dqc, dkc, dvc, compact = GradSum(), GradSum(), GradSum(), None
  for call, write in zip(calls, writes):
    if call.window_rows is not None:
      if compact is None:
        wrows = call.window_rows
        compact = [_gather_rows(x, wrows.q_src, wrows.q_valid)
                   for x in (q, out, lse, dout)]
        compact += _compact_kv(wrows, *_call_kv(call, k, v, kx, vx, halo))
      qc, oc, lc, dc, kc, vc = compact
      dq_i, dk_i, dv_i = backend.backward(
          _flat(qc), _flat(kc), _flat(vc), _flat(oc),
          lc.reshape(-1, q.shape[2]), _flat(dc),
          call_plan.segments(call, qc.shape[1], kc.shape[1]),
          mask=call.mask, scale=cfg.scale)
      dqc.add(dq_i.reshape(qc.shape), None)
      dkc.add(dk_i.reshape(kc.shape), None)
      dvc.add(dv_i.reshape(vc.shape), None)
      continue
    if call.reversed:
      dq_h, dk_h, dv_h = _reversed_halo_backward(cfg, call, q, k, kx, vx,
                                                 halo, out, lse, dout)
      dq.add(dq_h, dq_h.shape[1])
      dkx.add(dk_h, dk_h.shape[1] if halo is not None else None)
      dvx.add(dv_h, dv_h.shape[1] if halo is not None else None)
      continue
    kc, vc = _call_kv(call, k, v, kx, vx, halo)
    rows = write.q_rows
    qc, oc, lc, dc = (_prefix(x, rows) for x in (q, out, lse, dout))
    extra = window_kwargs(call_plan.window_left(cfg, call))
    if backend.supports_in_place:
      extra.update(dq_into=_flat(dq.full) if write.into else None)
    dq_i, dk_i, dv_i = backend.backward(
        _flat(qc), _flat(kc), _flat(vc), _flat(oc),
        lc.reshape(-1, q.shape[2]), _flat(dc),
        call_plan.segments(call, qc.shape[1], kc.shape[1]), mask=call.mask,
        scale=cfg.scale, **extra)
    dq_i, dk_i, dv_i = (dq_i.reshape(qc.shape), dk_i.reshape(kc.shape),
                        dv_i.reshape(vc.shape))
    if write.into:
      dq.full = dq_i
    else:
      dq.add(dq_i, rows)
    (dkx if call.exchanged else dk).add(dk_i, call.kv_rows)
    (dvx if call.exchanged else dv).add(dv_i, call.kv_rows)
  if compact is not None:
    # The near and far parts' gradients, put back on their rows: dq on the
    # local ones, dK/dV on the exchanged ones (per step: the two steps'
    # regions may hold the same key).
    dq.add(_gather_rows(dqc.full, wrows.q_inv, wrows.q_has), None)
    for part, total in ((dkc, dkx), (dvc, dvx)):
      total.add(sum(_gather_rows(part.full, wrows.kv_inv[st],
                                 wrows.kv_has[st]).astype(jnp.float32)
                    for st in (0, 1)), None)
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


cp_attention_vjp.defvjp(_vjp_forward, _vjp_backward)
