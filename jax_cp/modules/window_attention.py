"""Attention of one layer chunk (``TransformerLayer.layer_chunk_size``;
docs/design.md, "Layer chunks"), split where the chunk starts.

A chunk's window holds ``halo`` tokens and then the chunk's tokens; the
chunk's queries are the window's last tokens. A document that starts inside
the chunk sees only keys of the chunk, as many as its queries: top-left
causal. The one document per row that starts before the chunk (it
*straddles*) also sees keys in the halo, so as one call over the window it
is bottom-right causal, and one bottom-right segment makes the whole call
bottom-right, whose cuDNN backward is about 2x slower than a top-left one
(about 11x with a sliding window's band; docs/design.md, Measurements).
Attention over a set of keys is a log-sum-exp merge of attention over its
parts, so the straddling document's keys are split at the chunk's start,
as NO_LOAD_BALANCE splits its straddling document:

* the **chunk call**: every document's queries against its keys in the
  chunk, top-left causal (with the window's band, if any), on the chunk's
  keys alone;
* the **halo call**: the straddling document's queries (the chunk's first
  rows) against its keys in the halo. When ``max_seqlen`` bounds the halo
  every such query sees all of them: an unmasked rectangle. When a sliding
  window bounds it (``halo == window_left``), the chunk's query ``j`` sees
  the halo's keys from row ``j`` on; with the first ``halo`` query rows and
  the halo's keys both in reverse order that is top-left causal.

The forward merges the halo call's rows into the chunk call's by log-sum-exp
(:func:`jax_cp.attention.merge.merge_softmax_rows`); the backward runs both
calls on the merged out and lse, adds the halo call's dq into the chunk
call's and puts the halo's dK/dV before the chunk's.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.attention.api import flatten_segments, window_kwargs
from jax_cp.attention.backend import Segments
from jax_cp.attention.merge import (
  NO_WEIGHT_LSE,
  merge_softmax_rows,
  reversed_prefix,
)


class Calls(NamedTuple):
  """The calls of one window.

  Attributes:
    chunk: the chunk call's segments (top-left causal, over the chunk's Q
      and K/V rows).
    halo: the halo call's segments, one per row (None: the window has no
      halo).
    halo_mask: the halo call's mask: ``"no_mask"`` (a rectangle) or
      ``"causal_top_left"`` (rows and keys reversed).
    rows: the halo call's Q rows per batch row: the chunk's first ``rows``
      (zero rows past the chunk when it is shorter).
    doc_rows: int ``[B]``: how many of those rows hold the straddling
      document's queries (the others are dropped).
  """

  chunk: Segments
  halo: Segments | None
  halo_mask: str
  rows: int
  doc_rows: Any

  @property
  def valid(self):
    """bool ``[B, rows]``: the rows of the straddling document."""
    return jnp.arange(self.rows)[None, :] < self.doc_rows[:, None]


class Spec(NamedTuple):
  """A window's static settings (hashable).

  Attributes:
    backend: the resolved attention backend.
    scale: the softmax scale.
    window_left: the sliding window's left bound (-1: none).
    halo: halo tokens at the window's start (0: none).
    max_q: the bound on a document's queries in the chunk.
    whole_halo: the straddling document's queries see all of its halo keys
      (``max_seqlen`` bounds the halo); False: the window bounds it
      (``halo == window_left``).
  """

  backend: Any
  scale: float
  window_left: int
  halo: int
  max_q: int
  whole_halo: bool


def plan_calls(segments, queries: int, halo: int, max_q: int,
               whole_halo: bool) -> Calls:
  """The calls of a window of ``halo`` halo tokens whose ``queries`` chunk
  queries attend to its keys as ``segments`` say (``q_lens``,
  ``kv_lens``, ``q_offsets``, ``kv_offsets``, each ``[B, N]``, KV offsets
  from the window's first token:
  :func:`jax_cp.modules.row_chunks.chunk_segments`); ``max_q`` and
  ``whole_halo`` as in :class:`Spec`."""
  q_lens, kv_lens, q_offs, _ = (jnp.asarray(a, jnp.int32) for a in segments)
  # A document's keys in the chunk start where its queries do.
  chunk = flatten_segments(q_lens, q_lens, q_offs, q_offs, queries, queries,
                           max_q, max_q, rows_see_keys=True)
  if not halo:
    return Calls(chunk, None, "", 0, None)
  # Only the straddling document has keys before its first query.
  before = jnp.where(q_lens > 0, kv_lens - q_lens, 0)
  q_doc = jnp.sum(jnp.where(before > 0, q_lens, 0), axis=-1, keepdims=True)
  h = jnp.sum(before, axis=-1, keepdims=True)
  zero = jnp.zeros_like(h)
  if whole_halo:
    rows = min(queries, max_q)
    seg = flatten_segments(q_doc, h, zero, halo - h, rows, halo, rows, halo,
                           rows_see_keys=True)
    mask = "no_mask"
  else:
    # Reversed (row i' = halo-1-j, key m' = halo-1-m): query j sees key m
    # when m >= j, i.e. m' <= i'; the document's keys are the first h.
    rows = halo
    seg = flatten_segments(jnp.where(h > 0, rows, 0), h, zero, zero, rows,
                           halo, rows, halo, rows_see_keys=True)
    mask = "causal_top_left"
  return Calls(chunk, seg, mask, rows, q_doc[:, 0])


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


def _halo_rows(calls: Calls, spec: Spec, x, fill=None):
  """The halo call's Q-side input from ``x [B, c, ...]``: its first
  ``calls.rows`` rows; reversed (zero rows past ``c``, ``fill``, if
  given, on the rows that are not the straddling document's) when the
  call is."""
  if spec.whole_halo:
    return x[:, :calls.rows]
  return reversed_prefix(x, calls.rows, calls.doc_rows, fill)


def _from_halo_rows(calls: Calls, spec: Spec, x, c: int):
  """A halo call's per-row result back in chunk order, its first
  ``min(rows, c)`` rows."""
  if not spec.whole_halo:
    x = jnp.flip(x, axis=1)
  return x[:, :min(calls.rows, c)]


def _halo_kv(spec: Spec, k, v):
  kh, vh = k[:, :spec.halo], v[:, :spec.halo]
  if not spec.whole_halo:
    kh, vh = jnp.flip(kh, axis=1), jnp.flip(vh, axis=1)
  return kh, vh


def _forward(q, k, v, segments, spec: Spec):
  b, c = spec.backend, q.shape[1]
  calls = plan_calls(segments, c, spec.halo, spec.max_q, spec.whole_halo)
  kc, vc = k[:, spec.halo:], v[:, spec.halo:]
  out, lse = b.forward(_flat(q), _flat(kc), _flat(vc), calls.chunk,
                       mask="causal_top_left", scale=spec.scale,
                       **window_kwargs(spec.window_left))
  out, lse = out.reshape(q.shape), lse.reshape(q.shape[:3])
  if calls.halo is None:
    return out, lse
  qh = _halo_rows(calls, spec, q)
  kh, vh = _halo_kv(spec, k, v)
  o_h, l_h = b.forward(_flat(qh), _flat(kh), _flat(vh), calls.halo,
                       mask=calls.halo_mask, scale=spec.scale)
  o_h = _from_halo_rows(calls, spec, o_h.reshape(qh.shape), c)
  l_h = _from_halo_rows(calls, spec, l_h.reshape(qh.shape[:3]), c)
  return merge_softmax_rows(out, lse, o_h, l_h, calls.valid[:, :c],
                            b.merge_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _window_attention(q, k, v, segments, spec: Spec):
  return _forward(q, k, v, segments, spec)[0]


def _window_attention_fwd(q, k, v, segments, spec: Spec):
  out, lse = _forward(q, k, v, segments, spec)
  return out, (q, k, v, segments, out, lse)


def _window_attention_bwd(spec: Spec, res, dout):
  q, k, v, segments, out, lse = res
  b, c, heads = spec.backend, q.shape[1], q.shape[2]
  dout = dout.astype(out.dtype)
  calls = plan_calls(segments, c, spec.halo, spec.max_q, spec.whole_halo)
  kc, vc = k[:, spec.halo:], v[:, spec.halo:]
  dq, dk, dv = b.backward(_flat(q), _flat(kc), _flat(vc), _flat(out),
                          lse.reshape(-1, heads), _flat(dout), calls.chunk,
                          mask="causal_top_left", scale=spec.scale,
                          **window_kwargs(spec.window_left))
  dq, dk, dv = dq.reshape(q.shape), dk.reshape(kc.shape), dv.reshape(vc.shape)
  if calls.halo is not None:
    # Rows that are not the straddling document's count nothing: in a
    # rectangle no segment covers them; reversed, their out and dO are 0
    # and their lse makes every probability 0.
    kh, vh = _halo_kv(spec, k, v)
    qh = _halo_rows(calls, spec, q)
    dq_h, dk_h, dv_h = b.backward(
        _flat(qh), _flat(kh), _flat(vh), _flat(_halo_rows(calls, spec, out, 0)),
        _halo_rows(calls, spec, lse, NO_WEIGHT_LSE).reshape(-1, heads),
        _flat(_halo_rows(calls, spec, dout, 0)), calls.halo,
        mask=calls.halo_mask, scale=spec.scale)
    dq_h = _from_halo_rows(calls, spec, dq_h.reshape(qh.shape), c)
    dq = b.merge_rows(dq, dq_h.astype(dq.dtype), 0, "add")
    dk_h, dv_h = dk_h.reshape(kh.shape), dv_h.reshape(vh.shape)
    if not spec.whole_halo:
      dk_h, dv_h = jnp.flip(dk_h, axis=1), jnp.flip(dv_h, axis=1)
    dk = jnp.concatenate([dk_h.astype(dk.dtype), dk], axis=1)
    dv = jnp.concatenate([dv_h.astype(dv.dtype), dv], axis=1)
  return dq, dk, dv, None


_window_attention.defvjp(_window_attention_fwd, _window_attention_bwd)


def window_attention(q, k, v, segments, spec: Spec):
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
    return window_attention(q[None], k[None], v[None],
                            [jnp.asarray(a)[None] for a in segments], spec)[0]
  return _window_attention(q, k, v, tuple(segments), spec)
