"""The ring exchange (``comm_type="ring"``), its forward and backward on
one rank: steps of its own, not a plan executor's (inside the
``shard_map`` and the ``custom_vjp`` of :mod:`jax_cp.cp.vjp`;
docs/long_rows.md, Ring exchange). DUAL_CHUNK_SWAP runs all ``cp``
steps; NO_LOAD_BALANCE with a bound W only ``1 + ceil((W-1) / Tl)`` (no
query reaches further back).

Forward: the rank's K|V chunk travels around the ring
(:meth:`Ring.ring_next`); at each step the rank attends its Q rows to
the chunk it holds (:func:`jax_cp.cp.strategies.call_plan.ring_plan`)
and merges the result into a float32 running output by log-sum-exp. The
next chunk is requested before the step's call, so the hop can overlap
it; a barrier closes each step, so one step's results are live at a
time.

Backward: the chunks travel again, each with a float32 dK|dV accumulator
that every rank adds its step's contribution to; after the last step one
permute brings each accumulator home (:meth:`Ring.ring_home`). dQ is
summed locally in float32 over the steps;
every call gets the forward's whole ``out`` and ``lse``, so its
contributions are exact parts of the gradient.

Every buffer is one chunk (``[B, T/cp, ...]``): nothing grows with the
row. The float32 running buffers (the forward's output, the backward's dQ
and the dK|dV accumulator with the one in flight) take ``4·(Hq·D +
2·Hkv·(D + Dv))`` bytes per token of the chunk, more than q, k, v and the
output together; where they would pass the backend's scratch bound
(:attr:`~jax_cp.attention.backend.Backend.scratch_limit`, the bound on one
attention call's float32 working memory; none for the ``xla`` backend),
the ring runs once per group of whole GQA head groups
(:func:`head_groups`), one group after another in a ``lax.scan``, so
only one group's running buffers are live at a time. Attention is
independent per KV head, so the results are the same; the K/V hops carry
one group's heads each, the same bytes in all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_cp.attention.backend import packed, scratch_bound
from jax_cp.attention.decompose.merge import merge_softmax
from jax_cp.attention.head_groups import backward_in_head_groups, fewest_groups
from jax_cp.cp.exchange.base import KVExchange
from jax_cp.cp.strategies import call_plan


def _step(cfg, kv, heads: int, cu_seqlens, cu_seqlens_padded,
          rank, step: int):
  """``(call, k, v, next)``: step ``step``'s call, the held chunk's K and
  V packed for the backend, and the next chunk's hop (requested now, so
  it overlaps the call; None after the last step)."""
  ex = cfg.exchange
  nxt = ex.ring_next(kv) if step + 1 < ex.ring_steps else None
  (call,) = call_plan.poisoned(
      [call_plan.ring_plan(cfg, cu_seqlens, cu_seqlens_padded, rank, step)],
      cfg.poison)
  return call, packed(kv[:, :, :heads]), packed(kv[:, :, heads:]), nxt


def head_groups(q, k, v, limit: float) -> int:
  """How many groups of whole GQA head groups the ring runs one after
  another: the fewest (a divisor of the KV heads) whose float32 running
  buffers, ``B·Tl·4·(Hq·D + 2·Hkv·(D + Dv))`` bytes for all heads, stay
  within ``limit`` bytes (the backend's
  :func:`~jax_cp.attention.backend.scratch_bound`; one KV head per group
  where none does)."""
  b, tl, hq, d = q.shape
  hkv, dv = v.shape[2], v.shape[3]
  need = b * tl * 4 * (hq * d + 2 * hkv * (d + dv))
  return fewest_groups(hkv, lambda n: need / n <= limit)


def _heads(x, g, n: int):
  """Heads ``[g·n, (g+1)·n)`` (axis 2) of ``x [B, T, H, ...]``."""
  return jax.lax.dynamic_slice_in_dim(x, g * n, n, axis=2)


def _put_heads(x, part, g, n: int):
  return jax.lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), g * n,
                                             axis=2)


def forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded):
  """``(out, lse)`` of this rank's Q rows over the whole row: ``out``
  ``[B, Tl, Hq, Dv]`` in q's dtype, ``lse`` float32 ``[B, Tl, Hq]``; in
  :func:`head_groups` groups of heads."""
  groups = head_groups(q, k, v, scratch_bound(cfg.backend))
  rank = cfg.rank()
  if groups == 1:
    out, lse = _forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, rank)
    return out.astype(q.dtype), lse
  gq, gkv = q.shape[2] // groups, k.shape[2] // groups

  def one_group(carry, g):
    out, lse = carry
    o, l = _forward(cfg, _heads(q, g, gq), _heads(k, g, gkv),
                    _heads(v, g, gkv), cu_seqlens, cu_seqlens_padded, rank)
    return (_put_heads(out, o, g, gq), _put_heads(lse, l, g, gq)), None

  # The carry starts as values of q, which every group overwrites on its
  # own heads: zero-filled buffers are broadcasts, which XLA may make for
  # every layer at the start of the step and keep until they are used.
  out0 = q if v.shape[3] == q.shape[3] else \
      jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
  init = (out0, q[..., 0].astype(jnp.float32))
  (out, lse), _ = jax.lax.scan(one_group, init,
                               jnp.arange(groups, dtype=jnp.int32))
  return out, lse


def _forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, rank):
  """The ring forward over all heads of q, k, v on rank ``rank``: ``out``
  float32."""
  ex, heads = cfg.exchange, k.shape[2]
  kv = jnp.concatenate([k, v], axis=2)
  out = lse = None
  for step in range(ex.ring_steps):
    call, kc, vc, nxt = _step(cfg, kv, heads, cu_seqlens,
                              cu_seqlens_padded, rank, step)
    o, l = cfg.backend.forward(packed(q), kc, vc, call.segments,
                               mask=call.mask, scale=cfg.scale)
    o = o.reshape(q.shape).astype(jnp.float32)
    l = l.reshape(q.shape[:3])
    out, lse = (o, l) if out is None else merge_softmax(out, lse, [(o, l)])
    # One step at a time: the merge before the next step's call, so one
    # step's output is live at once (XLA would otherwise keep every step's
    # and merge them at the end).
    out, lse, kv = jax.lax.optimization_barrier((out, lse, nxt))
  return out, lse


def backward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, out,
             lse, dout):
  """``(dq, dk, dv)`` of this rank's chunk, in q's and k's dtypes; in
  :func:`head_groups` groups of heads."""
  groups = head_groups(q, k, v, scratch_bound(cfg.backend))
  rank = cfg.rank()
  if groups == 1:
    return _backward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, out, lse,
                     dout, rank)
  rows = lambda x: x.reshape(q.shape[:2] + x.shape[1:])

  # The loop of the cuDNN backward's head-group split, on packed buffers
  # (heads on axis 1): each group's ring writes its gradients over its
  # own heads of q, k and v.
  def one_group(q, k, v, out, lse, dout, seg):
    del seg
    grads = _backward(cfg, rows(q), rows(k), rows(v), cu_seqlens,
                      cu_seqlens_padded, rows(out), rows(lse), rows(dout),
                      rank)
    return tuple(packed(g) for g in grads)

  grads = backward_in_head_groups(one_group, groups, packed(q), packed(k),
                                  packed(v), packed(out), packed(lse),
                                  packed(dout), None)
  return tuple(rows(g) for g in grads)


def _backward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, out,
              lse, dout, rank):
  """The ring backward over all heads of its inputs on rank ``rank``."""
  ex, heads = cfg.exchange, k.shape[2]
  # The barrier keeps XLA from merging these hops with the forward's
  # (which would keep every chunk alive from forward to backward).
  k, v = jax.lax.optimization_barrier((k, v))
  kv = jnp.concatenate([k, v], axis=2)
  dq = dkv = None
  for step in range(ex.ring_steps):
    call, kc, vc, nxt = _step(cfg, kv, heads, cu_seqlens,
                              cu_seqlens_padded, rank, step)
    dq_i, dk_i, dv_i = cfg.backend.backward(
        packed(q), kc, vc, packed(out), lse.reshape(-1, q.shape[2]),
        packed(dout), call.segments, mask=call.mask, scale=cfg.scale)
    dq_i = dq_i.reshape(q.shape).astype(jnp.float32)
    dkv_i = jnp.concatenate([dk_i.reshape(k.shape), dv_i.reshape(v.shape)],
                            axis=2).astype(jnp.float32)
    # The accumulator of the chunk now held comes from the predecessor
    # while the call runs.
    dq = dq_i if dq is None else dq + dq_i
    dkv = dkv_i if dkv is None else ex.ring_next(dkv) + dkv_i
    # One step at a time (as in the forward).
    dq, dkv, kv = jax.lax.optimization_barrier((dq, dkv, nxt))
  dkv = ex.ring_home(dkv)
  return (dq.astype(q.dtype), dkv[:, :, :heads].astype(k.dtype),
          dkv[:, :, heads:].astype(v.dtype))


@dataclasses.dataclass(frozen=True)
class Ring(KVExchange):
  """K|V chunks travel around the ring of ranks, one ``ppermute`` hop per
  step, rank ``r`` holding at step ``s`` the chunk of rank ``(r - s) mod
  cp``; the backward sends a float32 dK|dV accumulator along with each
  chunk and returns it to the chunk's owner with one last permute. Every
  buffer is one chunk.

  Attributes (beyond :class:`KVExchange`'s):
    ring_steps: the steps, the local one included.
  """

  ring_steps: int = 0

  kind = "ring"

  @classmethod
  def of_row(cls, strategy, steps, **common):
    return cls(ring_steps=steps, **common)

  @property
  def buffer_rows(self) -> int:
    return self.local_tokens

  def received_tokens(self, rank):
    return (self.ring_steps - 1) * self.local_tokens

  def buffer_start(self, rank):
    return jnp.asarray(rank, jnp.int32) * self.local_tokens

  def ring_next(self, x):
    """One step: rank ``i``'s buffer to rank ``i + 1`` (mod cp)."""
    return self._shift(x, 1)

  def ring_home(self, x):
    """After the last step, the buffer rank ``r`` holds (the chunk of rank
    ``r - ring_steps + 1``, and its gradient) back to that rank."""
    hops = (1 - self.ring_steps) % self.cp_size
    return x if hops == 0 else self._shift(x, hops)

  def forward(self, cfg, q, k, v, cu_seqlens, cu_seqlens_padded,
              need_lse: bool = True):
    out, lse = forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded)
    return out.astype(q.dtype), lse, None

  def backward(self, cfg, residuals, dout):
    q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, _ = residuals
    return backward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded, out, lse,
                    dout.astype(out.dtype))
