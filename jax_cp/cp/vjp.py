"""The differentiable per-rank CP attention: forward and backward of one
rank's chunk under ``jax.custom_vjp``, run inside a ``shard_map``
(docs/internals.md, Call plans and Exchange).

The layout's exchange runs both directions (:meth:`KVExchange.forward`,
:meth:`KVExchange.backward`): the plan executor
(:mod:`jax_cp.cp.executor`) for the exchanges that feed a plan's calls,
or steps of its own (the ring, :mod:`jax_cp.cp.exchange.ring`). Around
them this module puts 0 on the padding tokens of q, k, v and of the
output's cotangent (docs/internals.md, Padding tokens), gives the calls
a trusted bound's poison (:func:`jax_cp.cp.guard.poisoned_config`) and,
with traced metadata and a ``max_seqlen`` bound, runs forward and
backward under :func:`jax_cp.cp.guard.run`: a step whose padded
documents break the bound takes the unbounded program
(:attr:`CPConfig.unbounded`).

Inputs are batched: q ``[B, Tl, Hq, D]``, k/v ``[B, Tl, Hkv, D]``, row
metadata ``[B, N+1]`` int32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_cp.attention.padding import zero_rows
from jax_cp.checkpoint_names import CONTEXT
from jax_cp.cp import guard
from jax_cp.cp.config import CPConfig
from jax_cp.cp.partition import valid_local_tokens


def _forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig,
             need_lse: bool = True):
  """``(out, lse, saved)`` of the layout's exchange
  (:meth:`KVExchange.forward`), with a trusted bound's poison."""
  cfg = guard.poisoned_config(cfg, cu_seqlens, cu_seqlens_padded)
  return cfg.exchange.forward(cfg, q, k, v, cu_seqlens, cu_seqlens_padded,
                              need_lse)


def _backward(cfg: CPConfig, residuals, dout):
  """``(dq, dk, dv)`` of the layout's exchange
  (:meth:`KVExchange.backward`), with a trusted bound's poison."""
  cfg = guard.poisoned_config(cfg, residuals[3], residuals[4])
  return cfg.exchange.backward(cfg, residuals, dout)


def _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded,
                     cfg: CPConfig, need_lse: bool = True):
  """:func:`_forward` under the bound check (:mod:`jax_cp.cp.guard`).
  Both branches save what the bounded program saves, in its shape: a
  bounded halo becomes zeros in the unbounded branch (its backward does not
  read them); all-gathered K/V are all-gathered by both. Without
  ``need_lse`` only ``out`` comes back (lse and saved are None)."""

  def branch(c: CPConfig, q, k, v, cu, cuP):
    out, lse, saved = _forward(q, k, v, cu, cuP, c, need_lse)
    if not need_lse:
      return out, None, None
    if c is cfg.unbounded and cfg.keep_gathered_kv:
      assert c.exchange.gathers_row, c.exchange
    elif c is cfg.unbounded:
      # Its backward exchanges again (with a sliding window it may keep a
      # halo of another size, dropped here); the residual takes the
      # bounded forward's shape: zeros shaped (and, in a shard_map checking
      # types, varying) like its halo, at most half a chunk, so a prefix of
      # the local K|V.
      saved = None
      if cfg.exchange.keeps_halo:
        h = cfg.exchange.halo_tokens
        saved = jnp.zeros_like(jnp.concatenate([k[:, :h], v[:, :h]], axis=2))
    return out, lse, saved

  return guard.run(cfg, cu_seqlens, cu_seqlens_padded, branch, q, k, v,
                   cu_seqlens, cu_seqlens_padded)


def _valid_tokens(cfg: CPConfig, cu_seqlens, cu_seqlens_padded, tokens):
  """bool ``[B, Tl]``: the local tokens inside a document, with
  :attr:`CPConfig.zero_padding`; else None (nothing to clear)."""
  if not cfg.zero_padding:
    return None
  return valid_local_tokens(cu_seqlens, cu_seqlens_padded, cfg.cp_size,
                            cfg.strategy, cfg.rank(), tokens)


def _clear_padding(cfg: CPConfig, q, k, v, cu_seqlens, cu_seqlens_padded):
  """q, k, v with 0 on their padding tokens, before the exchange and every
  call (docs/internals.md, Padding tokens)."""
  valid = _valid_tokens(cfg, cu_seqlens, cu_seqlens_padded, q.shape[1])
  return zero_rows(valid, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def cp_attention_vjp(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  """This rank's attention output ``[B, Tl, Hq, D]``, differentiable in
  q, k, v."""
  q, k, v = _clear_padding(cfg, q, k, v, cu_seqlens, cu_seqlens_padded)
  return _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg,
                          need_lse=False)[0]


def _vjp_forward(q, k, v, cu_seqlens, cu_seqlens_padded, cfg: CPConfig):
  # The residuals are the cleared q, k, v.
  q, k, v = _clear_padding(cfg, q, k, v, cu_seqlens, cu_seqlens_padded)
  out, lse, saved = _guarded_forward(q, k, v, cu_seqlens, cu_seqlens_padded,
                                     cfg)
  # Named for jax.checkpoint policies (jax_cp.modules.remat): a policy that
  # saves "context" spares its backward the exchange and the forward calls.
  out, lse, saved = checkpoint_name((out, lse, saved), CONTEXT)
  return out, (q, k, v, cu_seqlens, cu_seqlens_padded, out, lse, saved)


def _vjp_backward(cfg: CPConfig, residuals, dout):
  def branch(c: CPConfig, residuals, dout):
    if c is cfg.unbounded and not cfg.keep_gathered_kv:
      residuals = residuals[:-1] + (None,)   # its forward kept no halo
    return _backward(c, residuals, dout)

  # dout's padding rows would reach dK/dV as 0 * dout (NaN for NaN).
  (dout,) = zero_rows(_valid_tokens(cfg, residuals[3], residuals[4],
                                    dout.shape[1]), dout)
  dq, dk, dv = guard.run(cfg, residuals[3], residuals[4], branch, residuals,
                         dout)
  return dq, dk, dv, None, None


cp_attention_vjp.defvjp(_vjp_forward, _vjp_backward)
