"""Attention of one layer chunk (``TransformerLayer.layer_chunk_size``;
docs/long_rows.md): the chunk's queries against its window's keys.

A chunk's window holds ``halo`` tokens and then the chunk's tokens; the
chunk's queries are the window's last tokens. A document that starts inside
the chunk sees only keys of the chunk, as many as its queries: top-left
causal. The one document per row that starts before the chunk straddles
its start, and runs as NO_LOAD_BALANCE runs its straddling document
(:mod:`jax_cp.attention.decompose.straddle`):

* the **chunk call**: every document's queries against its keys in the
  chunk, top-left causal (with the window's band, if any), on the chunk's
  keys alone;
* the **halo call**: the straddling document's queries against its keys in
  the halo: a rectangle when ``max_seqlen`` bounds the halo (every such
  query sees all of them), reversed when a sliding window does (``halo ==
  window_left``).

The forward merges the halo call's rows into the chunk call's by
log-sum-exp; the backward runs both calls on the merged out and lse, adds
the halo call's dq into the chunk call's and puts the halo's dK/dV before
the chunk's.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.attention import padding
from jax_cp.attention.api import window_kwargs
from jax_cp.attention.backend import Segments, packed, row_segments
from jax_cp.attention.decompose import straddle


class Spec(NamedTuple):
  """A window's static settings (hashable).

  Attributes:
    backend: the resolved attention backend.
    scale: the softmax scale.
    window_left: the sliding window's left bound (-1: none).
    halo: halo tokens at the window's start (0: none).
    max_q: the bound on a document's queries in the chunk.
    whole_halo: the halo is ``max_seqlen - 1`` tokens, so every query of
      the straddling document sees all of its keys there (the rectangle);
      False: a sliding window's ``left`` bounds the halo (reversed).
  """

  backend: Any
  scale: float
  window_left: int
  halo: int
  max_q: int
  whole_halo: bool


class Calls(NamedTuple):
  """The calls of one window: the chunk call's segments (top-left causal,
  over the chunk's Q and K/V rows) and the halo call (None: no halo)."""

  chunk: Segments
  halo: straddle.HaloCall | None


def plan_calls(segments, queries: int, halo: int, max_q: int,
               whole_halo: bool) -> Calls:
  """The calls of a window of ``halo`` halo tokens whose ``queries`` chunk
  queries attend to its keys as ``segments`` say (``q_lens``,
  ``kv_lens``, ``q_offsets``, ``kv_offsets``, each ``[B, N]``, K/V offsets
  from the window's first token:
  :func:`jax_cp.modules.layer_chunks.chunk_segments`); ``max_q`` and
  ``whole_halo`` as in :class:`Spec`."""
  q_lens, kv_lens, q_offs, _ = (jnp.asarray(a, jnp.int32) for a in segments)
  # A document's keys in the chunk start where its queries do.
  chunk = row_segments(q_lens, q_lens, q_offs, q_offs, queries, queries,
                       max_q, max_q, rows_see_keys=True, clamp=True)
  if not halo:
    return Calls(chunk, None)
  # Only the straddling document has keys before its first query.
  before = jnp.where(q_lens > 0, kv_lens - q_lens, 0)
  q_doc = jnp.sum(jnp.where(before > 0, q_lens, 0), axis=-1)
  h = jnp.sum(before, axis=-1)
  rows = min(queries, max_q) if whole_halo else halo
  call = straddle.halo_call(q_doc, h, halo - h, rows=rows, kv_tokens=halo,
                            max_kv=halo, reversed=not whole_halo)
  return Calls(chunk, call)


def _forward(q, k, v, segments, spec: Spec):
  b = spec.backend
  calls = plan_calls(segments, q.shape[1], spec.halo, spec.max_q,
                     spec.whole_halo)
  kc, vc = k[:, spec.halo:], v[:, spec.halo:]
  out, lse = b.forward(packed(q), packed(kc), packed(vc), calls.chunk,
                       mask="causal_top_left", scale=spec.scale,
                       **window_kwargs(spec.window_left))
  out, lse = out.reshape(q.shape), lse.reshape(q.shape[:3])
  if calls.halo is None:
    return out, lse
  kh, vh = k[:, :spec.halo], v[:, :spec.halo]
  o_h, l_h = straddle.forward(b, calls.halo, q, kh, vh, scale=spec.scale)
  return straddle.merge(out, lse, o_h, l_h, calls.halo, b.merge_rows)


def _valid_rows(segments, queries: int, window: int):
  """bool ``[B, queries]`` and ``[B, window]``: the chunk's queries and
  the window's keys that some document's part covers; the others are
  padding, or keys no query of the chunk reads."""
  q_lens, kv_lens, q_offs, kv_offs = (jnp.asarray(a, jnp.int32)
                                      for a in segments)
  seg = row_segments(q_lens, kv_lens, q_offs, kv_offs, queries, window,
                     queries, window)
  rows = q_lens.shape[0]
  q_valid, kv_valid = padding.segment_rows(seg, rows * queries,
                                           rows * window)
  return q_valid.reshape(rows, queries), kv_valid.reshape(rows, window)


def _clear_padding(q, k, v, segments):
  """q, k, v with 0 on their padding rows (docs/internals.md, Padding
  tokens)."""
  q_valid, kv_valid = _valid_rows(segments, q.shape[1], k.shape[1])
  (q,) = padding.zero_rows(q_valid, q)
  return (q,) + padding.zero_rows(kv_valid, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunk_attention(q, k, v, segments, spec: Spec):
  q, k, v = _clear_padding(q, k, v, segments)
  return _forward(q, k, v, segments, spec)[0]


def _chunk_attention_fwd(q, k, v, segments, spec: Spec):
  q, k, v = _clear_padding(q, k, v, segments)   # the residuals are cleared
  out, lse = _forward(q, k, v, segments, spec)
  return out, (q, k, v, segments, out, lse)


def _chunk_attention_bwd(spec: Spec, res, dout):
  q, k, v, segments, out, lse = res
  b = spec.backend
  q_valid, _ = _valid_rows(segments, q.shape[1], k.shape[1])
  (dout,) = padding.zero_rows(q_valid, dout.astype(out.dtype))
  calls = plan_calls(segments, q.shape[1], spec.halo, spec.max_q,
                     spec.whole_halo)
  kc, vc = k[:, spec.halo:], v[:, spec.halo:]
  dq, dk, dv = b.backward(packed(q), packed(kc), packed(vc), packed(out),
                          lse.reshape(-1, q.shape[2]), packed(dout),
                          calls.chunk, mask="causal_top_left",
                          scale=spec.scale, **window_kwargs(spec.window_left))
  dq, dk, dv = dq.reshape(q.shape), dk.reshape(kc.shape), dv.reshape(vc.shape)
  if calls.halo is not None:
    kh, vh = k[:, :spec.halo], v[:, :spec.halo]
    dq_h, dk_h, dv_h = straddle.backward(b, calls.halo, q, kh, vh, out, lse,
                                         dout, scale=spec.scale)
    dq = b.merge_rows(dq, dq_h.astype(dq.dtype), 0, "add")
    dk = jnp.concatenate([dk_h.astype(dk.dtype), dk], axis=1)
    dv = jnp.concatenate([dv_h.astype(dv.dtype), dv], axis=1)
  return dq, dk, dv, None


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def chunk_attention(q, k, v, segments, spec: Spec):
  """Attention of a layer chunk's queries ``q [B, c, Hq, D]`` to its
  window's keys and values ``k``/``v`` ``[B, spec.halo + c, Hkv, D]``,
  the documents' parts as ``segments`` say (:func:`plan_calls`), as a
  chunk call and a halo call (module docstring); differentiable in q, k
  and v. Returns ``[B, c, Hq, D]`` in q's dtype. Without the batch axis
  (``[c, Hq, D]``, ``[N]`` segments) the same for one row."""
  if k.shape[-3] != spec.halo + q.shape[-3]:
    raise ValueError(f"a window of {k.shape[-3]} keys must hold the halo's "
                     f"{spec.halo} and the chunk's {q.shape[-3]}")
  if q.ndim == 3:
    return chunk_attention(q[None], k[None], v[None],
                           [jnp.asarray(a)[None] for a in segments], spec)[0]
  return _chunk_attention(q, k, v, tuple(segments), spec)
