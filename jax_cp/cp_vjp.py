"""The differentiable per-rank CP attention: forward and backward of one
rank's chunk under ``jax.custom_vjp``, run inside a ``shard_map``.

Forward: exchange K/V (:mod:`jax_cp.kv_exchange`), then run the calls of
:func:`jax_cp.call_plan.forward_calls`; their Q rows are disjoint, so each
later call writes its rows into the first call's outputs (in place with a
backend that ``supports_in_place``; otherwise its fresh outputs are added,
``lse`` by maximum; a call with lead rows,
:attr:`jax_cp.call_plan.Call.lead_rows`, is merged with the backend's
``merge_rows``). Backward: keep only local residuals (plus a small
received halo, :attr:`KVExchange.keeps_halo`), exchange K/V again where it
must, run :func:`jax_cp.call_plan.backward_calls` with dq written as
:func:`jax_cp.call_plan.dq_writes` says, and return dK/dV to their owners
(reduce-scatter, or reverse halo permutes merged with the backend's
``merge_rows``). docs/design.md, Call plans and Exchange.

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

from jax_cp import call_plan, seqlen_guard
from jax_cp.attention.api import window_kwargs
from jax_cp.attention.merge import GradSum, add
from jax_cp.cp_config import CPConfig


def _prefix(x, rows: int | None):
  """The first ``rows`` rows of axis 1 (all when None)."""
  return x if rows is None else x[:, :rows]


def _lead(x, call: call_plan.Call):
  """``[call.lead_rows zero rows | x]`` on axis 1: a call's Q-side input
  (Q, out, dO, lse); ``x`` itself for a call without lead rows. Zero Q,
  out and dO rows with a zero lse give every gradient 0 (the softmax
  gradient of such a row, ``P * (dO V^T - rowsum(dO * out))``, is 0)."""
  if call.lead_rows is None:
    return x
  pad = jnp.zeros(x.shape[:1] + (call.lead_rows,) + x.shape[2:], x.dtype)
  return jnp.concatenate([pad, x], axis=1)


def _drop_lead(x, call: call_plan.Call):
  """A call's Q-side result without its lead rows (see :func:`_lead`)."""
  return x if call.lead_rows is None else x[:, call.lead_rows:]


def _flat(x):
  """``[B, T, ...]`` -> ``[B*T, ...]``: the backend's packed layout."""
  return x.reshape((-1,) + x.shape[2:])


def _flat_row_range(rows, batch: int):
  """A row range of every batch entry -> the range over flattened rows,
  exact only for B = 1 (None otherwise: the backend's default)."""
  if rows is None or batch != 1:
    return None
  return rows


def _rank(cfg: CPConfig):
  if cfg.cp_size == 1:
    return jnp.int32(0)
  return jax.lax.axis_index(cfg.cp_axis).astype(jnp.int32)


def _call_kv(cfg: CPConfig, call: call_plan.Call, k, v, k_exchanged,
             v_exchanged, halo, cache=None):
  """The K/V a call reads: the local chunk, or the first ``kv_rows`` rows of
  the exchanged buffer (assembled from the halo when there is one, by the
  backend's ``assemble_kv`` on the call's ``kv_range``). ``cache`` (a dict)
  lets the two halves of a split block share one assembly."""
  if not call.exchanged:
    return _prefix(k, call.kv_rows), _prefix(v, call.kv_rows)
  if halo is None:
    return (_prefix(k_exchanged, call.kv_rows),
            _prefix(v_exchanged, call.kv_rows))
  key = (call.kv_rows, None if call.kv_range is None else
         tuple(id(x) for x in call.kv_range))
  if cache is not None and key in cache:
    return cache[key]
  first, count = call.kv_range or (None, None)
  kv = cfg.exchange.assemble(halo, k, v, call.kv_rows, first, count,
                             assemble_kv=cfg.backend.assemble_kv)
  if cache is not None:
    cache[key] = kv
  return kv


def _exchange(cfg: CPConfig, k, v, cu_seqlens_padded):
  """(k_exchanged, v_exchanged, halo): the all-gathered buffers, or the
  received halo (None for what the exchange kind does not use)."""
  if cfg.exchange.kind == "halo":
    return None, None, cfg.exchange.receive_halo(k, v)
  kx, vx = cfg.exchange.gather(k, v, cu_seqlens_padded)
  return kx, vx, None


def _forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  """(out, lse, halo): halo is the received K|V halo when the exchange
  keeps it for the backward (else None)."""
  backend = cfg.backend
  kx, vx, halo = _exchange(cfg, k, v, cu_seqlens_padded)
  out = lse = None
  for call in call_plan.forward_calls(cfg, cu_seqlens, cu_seqlens_padded,
                                      _rank(cfg)):
    assert not call.overlaps_previous, call
    if call.exchanged and halo is not None and out is not None:
      # The assembly waits for the halo: keep it after the earlier calls,
      # which then hide the exchange (XLA may otherwise schedule it first).
      halo, out, lse = jax.lax.optimization_barrier((halo, out, lse))
    kc, vc = _call_kv(cfg, call, k, v, kx, vx, halo)
    if call.lead_rows is not None:
      # A call with lead rows reads its own Q buffer; its rows are merged
      # into the earlier calls' outputs, which hold 0 / -inf there.
      assert out is not None, call
      qc = _lead(_prefix(q, call.q_rows), call)
      seg = call_plan.segments(call, qc.shape[1], kc.shape[1])
      o, l = backend.forward(_flat(qc), _flat(kc), _flat(vc), seg,
                             mask=call.mask, scale=cfg.scale,
                             **window_kwargs(cfg.window_left))
      o = _drop_lead(o.reshape(qc.shape), call)
      l = _drop_lead(l.reshape(qc.shape[:3]), call)
      out = backend.merge_rows(out, o.astype(out.dtype), 0, "add")
      lse = backend.merge_rows(lse, l, 0, "max")
      continue
    seg = call_plan.segments(call, q.shape[1], kc.shape[1])
    in_place = out is not None and backend.supports_in_place
    # The first call's outputs hold 0 / -inf on the other calls' rows.
    extra = dict(into=(_flat(out), _flat(lse))) if in_place else {}
    extra.update(window_kwargs(cfg.window_left))
    o, l = backend.forward(_flat(q), _flat(kc), _flat(vc), seg,
                           mask=call.mask, scale=cfg.scale, **extra)
    o, l = o.reshape(q.shape), l.reshape(q.shape[:3])
    if out is None or in_place:
      out, lse = o, l
    else:
      out, lse = add(out, o), jnp.maximum(lse, l)
  return out.astype(q.dtype), lse, (halo if cfg.exchange.keeps_halo else
                                    None)


def _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded,
                     cfg: CPConfig):
  """:func:`_forward` under the bound check (:mod:`jax_cp.seqlen_guard`).
  Both branches give a halo of the bounded exchange's shape: the unbounded
  one gives zeros, which its backward does not read."""

  def branch(c: CPConfig, q, k, v, cu, cuP):
    out, lse, halo = _forward(q, k, v, cu, cuP, c)
    if c is cfg.unbounded:
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
  # Residuals are local, plus a small received halo (KVExchange.keeps_halo):
  # all-gathered K/V are rebuilt in the backward.
  return out, (q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, halo)


def _vjp_backward(cfg: CPConfig, residuals, dout):
  def branch(c: CPConfig, residuals, dout):
    if c is cfg.unbounded:   # its forward kept no halo
      residuals = residuals[:-1] + (None,)
    return _backward(c, residuals, dout)

  dq, dk, dv = seqlen_guard.run(cfg, residuals[4], branch, residuals, dout)
  return dq, dk, dv, None, None


def _backward(cfg: CPConfig, residuals, dout):
  """(dq, dk, dv) of this rank's chunk."""
  q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, halo = residuals
  backend = cfg.backend
  kx = vx = None
  if halo is None:
    # The barrier keeps XLA from merging this re-gather with the forward's
    # (which would keep the exchanged K/V alive from forward to backward).
    k, v = jax.lax.optimization_barrier((k, v))
    kx, vx, halo = _exchange(cfg, k, v, cu_seqlens_padded)
  dout = dout.astype(out.dtype)
  dq, dk, dv, dkx, dvx = GradSum(), GradSum(), GradSum(), GradSum(), GradSum()
  assembled = {}
  calls = call_plan.backward_calls(cfg, cu_seqlens, cu_seqlens_padded,
                                   _rank(cfg))
  writes = call_plan.dq_writes(calls, q.shape[1], backend.supports_in_place)
  for call, write in zip(calls, writes):
    kc, vc = _call_kv(cfg, call, k, v, kx, vx, halo, assembled)
    rows = write.q_rows
    qc = _lead(_prefix(q, rows), call)
    extra = window_kwargs(cfg.window_left)
    if backend.supports_in_place:
      extra.update(dq_into=_flat(dq.full) if write.into else None,
                   dq_fill=_flat_row_range(write.fill, q.shape[0]))
    dq_i, dk_i, dv_i = backend.backward(
        _flat(qc), _flat(kc), _flat(vc),
        _flat(_lead(_prefix(out, rows), call)),
        _lead(_prefix(lse, rows), call).reshape(-1, q.shape[2]),
        _flat(_lead(_prefix(dout, rows), call)),
        call_plan.segments(call, qc.shape[1], kc.shape[1]), mask=call.mask,
        scale=cfg.scale, **extra)
    if write.into:
      dq.full = dq_i.reshape(q.shape)
    else:
      dq.add(_drop_lead(dq_i.reshape(qc.shape), call), rows)
    (dkx if call.exchanged else dk).add(dk_i.reshape(kc.shape), call.kv_rows)
    (dvx if call.exchanged else dv).add(dv_i.reshape(vc.shape), call.kv_rows)
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
