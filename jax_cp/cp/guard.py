"""The in-graph guard of the ``max_seqlen`` bound (docs/max_seqlen.md).

A bound W below the row length lets a step exchange only a halo of
``W - 1`` tokens and size its kernels by W; a padded document longer than
W would silently lose keys. Concrete metadata is checked by value
(:func:`jax_cp.cp.validation.check_max_seqlen`); traced metadata is
checked here, in the step, as :attr:`jax_cp.cp.config.CPConfig.bound_check`
says:

* ``"fallback"`` (raw metadata arrays): :func:`run` picks between the
  bounded program and the unbounded one (all-gather exchange, bounds of
  the row length) with a ``lax.cond``. The predicate is a few integer ops
  on the metadata, which every rank of the cp axis holds replicated, so
  all of them take the same branch and the collectives inside it match. A
  step that breaks the bound is right, only slower. Where the bounded
  program is exact for longer documents anyway
  (:func:`bounded_program_is_exact`), there is no ``cond``.
* ``"trusted"`` (a :class:`jax_cp.CPBatch` checked on the host): the
  bounded program only, with no ``cond`` and none of the fallback's
  memory. The predicate is still evaluated, so metadata that broke the
  promise give NaN outputs and gradients instead of a silently wrong
  answer: a backend with ``handles_poison`` gets it as
  :attr:`jax_cp.attention.backend.Segments.poison` in every call
  (:func:`poisoned_config`; the cudnn handler reads it on the device and
  fills its results with NaN, no pass over any buffer while it is clear);
  for any other backend :func:`poison` multiplies the local keys and values
  by NaN or 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_cp.cp import validation
from jax_cp.cp.strategies import strategy_for


def bounded_program_is_exact(cfg, unbounded) -> bool:
  """Whether the program of ``cfg`` gives the results of ``unbounded``
  (its config with ``max_seqlen = T``) for documents of any length, so no
  fallback is needed: the same exchange, no call reading a prefix sized by
  the bound (NO_LOAD_BALANCE's halo call reads the first ``min(W-1,
  Tl)`` rows; windowed DUAL_CHUNK_SWAP's compact buffers are sized by the
  chunk bound, and a window of ``W - 1`` or more is dropped;
  docs/internals.md, Call plans), and a backend whose results do not
  depend on the kernels' static bounds."""
  if not cfg.backend.exact_past_bounds or cfg.exchange != unbounded.exchange:
    return False
  return not (cfg.cp_size > 1 and strategy_for(
      cfg.strategy).program_sized_by_bound(cfg, unbounded))


def longest_padded(cu_seqlens_padded, cu_seqlens=None, strategy=None,
                   cp_size: int = 1):
  """The longest span of a document of all rows (int32 scalar): its
  padded length, or what :func:`jax_cp.cp.validation.document_spans`
  counts when ``cu_seqlens`` is given (empty slots nothing)."""
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
  spans = validation.document_spans(cu, cuP, strategy, cp_size)
  return jnp.max(spans, initial=0).astype(jnp.int32)


def exceeds_bound(cu_seqlens_padded, max_seqlen: int, cu_seqlens=None,
                  strategy=None, cp_size: int = 1):
  """bool scalar: some document spans more than ``max_seqlen`` tokens
  (:func:`longest_padded`)."""
  return longest_padded(cu_seqlens_padded, cu_seqlens, strategy,
                        cp_size) > max_seqlen


def broken(cfg, cu_seqlens, cu_seqlens_padded):
  """bool scalar: the step's metadata break ``cfg``'s bound, by the rule
  of its strategy and cp size."""
  return exceeds_bound(cu_seqlens_padded, cfg.max_seqlen, cu_seqlens,
                       cfg.strategy, cfg.cp_size)


def run(cfg, cu_seqlens, cu_seqlens_padded, branch, *operands):
  """``branch(cfg, *operands)``, or with ``bound_check="fallback"``
  ``branch(cfg.unbounded, *operands)`` for a step whose documents exceed
  the bound. Both branches must return the same pytree of shapes."""
  if cfg.bound_check != "fallback":
    return branch(cfg, *operands)
  return jax.lax.cond(broken(cfg, cu_seqlens, cu_seqlens_padded),
                      functools.partial(branch, cfg.unbounded),
                      functools.partial(branch, cfg), *operands)


def _poisons_segments(cfg) -> bool:
  """Whether a trusted bound reaches the backend as ``Segments.poison``."""
  return (cfg.bound_check == "trusted"
          and bool(getattr(cfg.backend, "handles_poison", False)))


def poisoned_config(cfg, cu_seqlens, cu_seqlens_padded):
  """``cfg`` carrying the poison flag of a trusted bound (int32: 1 where
  some padded document is longer than the bound) as
  :attr:`~jax_cp.cp.config.CPConfig.poison`, which the step's plan puts
  in every call's segments
  (:func:`jax_cp.cp.strategies.call_plan.poisoned`), for a backend with
  ``handles_poison``; else ``cfg``. Forward and backward each call it on
  their own metadata."""
  if not _poisons_segments(cfg):
    return cfg
  flag = broken(cfg, cu_seqlens, cu_seqlens_padded).astype(jnp.int32)
  return dataclasses.replace(cfg, poison=flag)


def poison(cfg, cu_seqlens, cu_seqlens_padded, *arrays):
  """With ``bound_check="trusted"`` and a backend without
  ``handles_poison``: ``arrays`` (the local keys and values) times NaN
  where some padded document is longer than the bound, else times 1
  (exactly themselves). Both, so that the output and every gradient turn
  NaN: a backend may treat a NaN row of scores as empty in its backward (a
  finite ``dv``). Otherwise ``arrays`` unchanged."""
  if cfg.bound_check != "trusted" or _poisons_segments(cfg):
    return arrays
  return nan_where(broken(cfg, cu_seqlens, cu_seqlens_padded), *arrays)


def nan_where(broken, *arrays):
  """``arrays`` times NaN where the bool scalar ``broken`` holds, else
  times 1 (exactly themselves); ``arrays`` unchanged when it is None."""
  if broken is None:
    return arrays
  return tuple(x * jnp.where(broken, jnp.nan, 1).astype(x.dtype)
               for x in arrays)
