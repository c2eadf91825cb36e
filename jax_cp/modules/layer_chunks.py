"""A whole decoder layer over chunks of a row's tokens
(``TransformerLayer.layer_chunk_size``; docs/long_rows.md, Layer chunks).

A chunk's queries attend to keys of their own documents only, and causal
attention reads no key after its query, so a chunk of tokens ``[a, b)``
needs, besides its own tokens, only the ``halo`` tokens before it: the
longest document's length less one (the layout's ``max_seqlen - 1``), or a
sliding window's ``left`` when that is shorter. The layer then runs as a
loop over chunks, each on its window of tokens ``[a - halo, b)``: the
window's norm and key/value projections, the chunk's query projection,
attention of the chunk's queries to the window's keys
(:mod:`jax_cp.attention.decompose.chunk_attention`), the output
projection, the MLP and both residual adds. The loop's backward walks the
chunks from the last to the first, re-runs each chunk's forward next to
its backward, and carries
the cotangent of the halo's tokens (float32) to the chunk before, whose
tokens it belongs to. So the layer keeps, per token of the row, its input,
its output and their cotangents, and nothing else: every other buffer is
one window's.

One rank only (cp size 1): the chunks are consecutive tokens of the row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_cp.attention.decompose import chunk_attention
from jax_cp.attention.registry import resolve_backend
from jax_cp.attention.validation import check_window_size, default_scale
from jax_cp.cp import api as cp_api
from jax_cp.cp import guard, validation
from jax_cp.cp.layout import CPLayout
from jax_cp.cp.strategies import metadata
from jax_cp.modules.inputs import metadata as module_metadata
from jax_cp.modules.remat import add_cotangents
from jax_cp.modules.token_chunks import zeros_like_tokens


class Window(NamedTuple):
  """One chunk's attention: the chunk's queries are the last ``queries``
  tokens of a window whose keys and values are all its tokens;
  ``segments`` (``q_seqlens``, ``kv_seqlens``, ``q_offsets``,
  ``kv_offsets``, each ``[B, N]``) are the documents' parts in it, as
  :func:`jax_cp.fused_attention` takes them (bottom-right causal);
  ``broken`` (bool scalar or None) says that a padded document breaks the
  halo's bound (the keys and values turn NaN); ``whole_halo``: the halo is
  ``max_seqlen - 1`` tokens, so every query of the straddling document
  sees all of its keys there (False: a sliding window's ``left`` bounds
  the halo; :mod:`jax_cp.attention.decompose.chunk_attention`)."""

  queries: int
  segments: tuple
  max_seqlen_q: int
  broken: Any = None
  whole_halo: bool = True


class Plan(NamedTuple):
  """How a layer runs in chunks: ``chunk`` tokens each (a shorter last one
  takes the rest), each reading the ``halo`` tokens before it; ``bound``
  is the padded document length the halo relies on (None: a window bounds
  it, documents may be longer)."""

  chunk: int
  halo: int
  bound: int | None


def plan(chunk_size: int | None, layout: CPLayout, tokens: int,
         window_left: int) -> Plan | None:
  """The chunks of a layer with ``layer_chunk_size=chunk_size`` over rows of
  ``tokens`` tokens, or None when the row runs whole (``chunk_size`` None,
  or at least ``tokens``).

  The halo is ``layout.max_seqlen - 1``, or ``window_left`` (a sliding
  window, ``-1``: none) when that is smaller.

  Raises:
    ValueError: naming ``layer_chunk_size``: a cp size above 1, neither
      ``max_seqlen`` nor a window to bound the halo, or a chunk shorter
      than the halo.
  """
  if chunk_size is None or chunk_size >= tokens:
    return None
  cp = layout.resolve_cp_size()
  if cp != 1:
    raise ValueError(
        f"layer_chunk_size={chunk_size} runs a layer over consecutive "
        f"tokens of one rank; the layout has cp size {cp}. Use "
        "mlp_chunk_size with context parallelism")
  bound = layout.max_seqlen
  halos = [h for h in (None if bound is None else bound - 1,
                       window_left if window_left >= 0 else None)
           if h is not None]
  if not halos:
    raise ValueError(
        f"layer_chunk_size={chunk_size} needs a bound on how far back a "
        "chunk's queries read: the layout's max_seqlen (the longest padded "
        "document) or a sliding window_size; neither is set")
  halo = min(halos)
  if chunk_size < halo:
    raise ValueError(
        f"layer_chunk_size={chunk_size} must be at least the halo of "
        f"{halo} tokens a chunk reads before it (max_seqlen - 1 or the "
        "window's left)")
  uses_bound = bound is not None and halo == bound - 1
  return Plan(int(chunk_size), int(halo), bound if uses_bound else None)


def check_bound(p: Plan, cu_seqlens_padded, cu_seqlens=None):
  """The guard of the halo's bound: a ``ValueError`` for concrete metadata
  with a longer document (its valid tokens: a chunk's queries read back
  over those alone, so the padding after a row's last document never
  counts; :func:`jax_cp.cp.validation.document_spans` at cp = 1); for
  traced metadata the bool scalar that
  turns the keys and values NaN (a fallback to the whole row would keep
  the whole row's buffers, which is what chunks avoid). None when no
  bound is needed."""
  if p.bound is None:
    return None
  validation.check_max_seqlen_bound(cu_seqlens_padded, p.bound, cu_seqlens)
  return guard.exceeds_bound(cu_seqlens_padded, p.bound, cu_seqlens)


def chunk_segments(cu_seqlens, cu_seqlens_padded, q_start, kv_start,
                   queries: int):
  """The documents' parts in one chunk's attention call: the queries are
  tokens ``[q_start, q_start + queries)``, the keys tokens from
  ``kv_start`` to the same end. ``(q_seqlens, kv_seqlens, q_offsets,
  kv_offsets)``, each ``[.., N]``: a document's queries in the chunk
  (its valid tokens only) and its keys from ``kv_start`` (or its first
  token) to its last query; empty for documents without queries in the
  chunk. Offsets are relative to each buffer's first token."""
  m = metadata.contiguous_chunk(cu_seqlens, cu_seqlens_padded, q_start,
                                queries)
  cut = jnp.maximum(kv_start - m.kv_offsets, 0)   # keys before the window
  some = m.q_lens > 0
  zero = jnp.zeros_like(m.q_lens)
  return (m.q_lens, jnp.where(some, m.kv_lens - cut, zero),
          jnp.where(some, m.q_offsets, zero),
          jnp.where(some, m.kv_offsets + cut - kv_start, zero))


def map_row_chunks(make_fn: Callable, x, position_ids, cu_seqlens,
                   cu_seqlens_padded, p: Plan, broken=None,
                   pin: Callable = lambda v: v):
  """A layer over the chunks of :class:`Plan` ``p``: ``y [B, T, E]`` from
  ``x [B, T, E]``, where ``make_fn(window: Window)`` returns
  ``fn(x_w, pos_w) -> y_c``: the layer on a window's tokens ``x_w [B, W,
  E]`` (``pos_w``: their ``position_ids``, or None) giving its chunk's
  (the last ``window.queries`` tokens') outputs.

  Chunk 0 reads no halo (its window is the chunk); the full chunks after
  it run in a loop; a shorter last chunk takes the rest. The loop is a
  ``custom_vjp`` that keeps ``x`` and the arrays ``fn`` reads (its
  parameters) for the backward, which walks the chunks backwards, re-runs
  each one's forward with :func:`jax.vjp`, writes the chunk's input
  cotangent over its output cotangent (in place) and carries the float32
  cotangent of its halo to the chunk before. ``pin`` constrains each
  token-sized buffer (the layout's :meth:`jax_cp.CPLayout.shard_tokens`).
  """
  batch, tokens = x.shape[0], x.shape[1]
  c, halo = p.chunk, p.halo
  n, rest = divmod(tokens, c)
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  bound = p.bound or tokens
  part = lambda v, start, size: jax.lax.dynamic_slice_in_dim(v, start, size,
                                                             axis=1)
  put = lambda v, u, start: pin(jax.lax.dynamic_update_slice_in_dim(
      v, u.astype(v.dtype), start, axis=1))

  # The kinds of chunk, by (queries, window tokens): the first, the full
  # ones with a halo, and the rest.
  kinds = {"first": (c, c)}
  if n > 1:
    kinds["full"] = (c, c + halo)
  if rest:
    kinds["rest"] = (rest, rest + halo)

  def aux(ints, q_start, queries, w_start, w_size):
    position_ids, cu, cuP, _ = ints
    seg = chunk_segments(cu, cuP, q_start, w_start, queries)
    pos = (None if position_ids is None
           else part(position_ids, w_start, w_size))
    return pos, seg

  # The chunks' integer inputs, explicit for the custom_vjp.
  ints = (position_ids, cu, cuP, broken)

  def convert(queries, w_size):
    def fn(xw, pos, seg, broken):
      window = Window(queries, seg, min(bound, queries), broken,
                      p.bound is not None)
      return make_fn(window)(pin(xw), pos)
    example = (x[:, :w_size], *aux(ints, 0, queries, 0, w_size), broken)
    f, consts = jax.closure_convert(fn, *example)
    return f, consts

  converted = {k: convert(*v) for k, v in kinds.items()}
  fs = {k: v[0] for k, v in converted.items()}
  consts = {k: v[1] for k, v in converted.items()}

  def starts(i, kind):
    """(query start, window start) of chunk ``i`` of a kind."""
    q_start = i * c
    return q_start, q_start if kind == "first" else q_start - halo

  def run(kind, consts, x, ints, i):
    queries, w_size = kinds[kind]
    q_start, w_start = starts(i, kind)
    pos, seg = aux(ints, q_start, queries, w_start, w_size)
    return fs[kind](part(x, w_start, w_size), pos, seg, ints[-1], *consts)

  def forward(consts, x, ints):
    y = pin(jnp.zeros_like(x))
    y = put(y, run("first", consts["first"], x, ints, 0), 0)
    if n > 1:
      y = jax.lax.fori_loop(1, n, lambda i, y: put(
          y, run("full", consts["full"], x, ints, i), i * c), y)
    if rest:
      y = put(y, run("rest", consts["rest"], x, ints, n), n * c)
    return y

  @jax.custom_vjp
  def chunked(consts, x, ints):
    return forward(consts, x, ints)

  def chunked_fwd(consts, x, ints):
    return forward(consts, x, ints), (consts, x, ints)

  def chunked_bwd(res, dy):
    consts, x, ints = res
    dy = pin(dy)

    def step(kind, i, dx, carry):
      """The chunk's parameter cotangents, ``dx`` with its tokens'
      cotangents written in, and the float32 cotangent of its halo (the
      last ``halo`` tokens before the chunk). ``carry``: the later chunks'
      cotangent of this chunk's last ``halo`` tokens. The barrier orders
      the chunk's recompute after the previous chunk's backward."""
      queries, w_size = kinds[kind]
      q_start, w_start = starts(i, kind)
      xw, dx, carry = jax.lax.optimization_barrier(
          (part(x, w_start, w_size), dx, carry))
      pos, seg = aux(ints, q_start, queries, w_start, w_size)
      _, vjp = jax.vjp(
          lambda cs, xw: fs[kind](xw, pos, seg, ints[-1], *cs),
          consts[kind], xw)
      dc, dxw = vjp(part(dx, q_start, queries))
      dxw = dxw.astype(jnp.float32)
      if halo:    # an update of the tokens' sharding (Explicit axes)
        dxw = jax.lax.dynamic_update_slice_in_dim(
            dxw, dxw[:, w_size - halo:] + carry, w_size - halo, axis=1)
      dx = put(dx, dxw[:, w_size - queries:], q_start)
      return dc, dx, dxw[:, :halo]

    carry = zeros_like_tokens(x, (batch, halo) + x.shape[2:], jnp.float32)
    dx = dy
    dcs = {}
    if rest:
      dcs["rest"], dx, carry = step("rest", n, dx, carry)
    if n > 1:
      dc, dx, carry = step("full", n - 1, dx, carry)

      def body(j, state):
        acc, dx, carry = state
        dc, dx, carry = step("full", n - 1 - j, dx, carry)
        return jax.tree.map(add_cotangents, acc, dc), dx, carry

      dcs["full"], dx, carry = jax.lax.fori_loop(1, n - 1, body,
                                                 (dc, dx, carry))
    dcs["first"], dx, _ = step("first", 0, dx, carry)
    # One buffer for all of dx's readers (see map_token_chunks).
    return ({k: dcs[k] for k in consts}, jax.lax.optimization_barrier(dx),
            None)

  chunked.defvjp(chunked_fwd, chunked_bwd)
  return chunked(consts, x, ints)


def layer_chunk_plan(chunk_size: int | None, layout: CPLayout, x_shape,
                     window_size) -> Plan | None:
  """The chunks of a :class:`TransformerLayer` with ``layer_chunk_size=
  chunk_size`` on ``x`` of ``x_shape`` (None: the whole row at once),
  :func:`plan`."""
  window_left = check_window_size(window_size, "causal")
  return plan(chunk_size, layout, x_shape[-2], window_left)


def run_layer_chunks(make_fn: Callable, layout: CPLayout, x, position_ids,
                     cu_seqlens, cu_seqlens_padded, plan: Plan):
  """A layer over the chunks of ``plan`` (:func:`map_row_chunks`), on
  ``x [B, T, E]`` or ``[T, E]``, with the bound of the halo checked first
  (:func:`check_bound`). ``cu_seqlens``: the layer's argument, arrays or
  a :class:`jax_cp.CPBatch`."""
  cu, cuP = module_metadata(layout, cu_seqlens, cu_seqlens_padded,
                            "TransformerLayer's batch")
  broken = check_bound(plan, cuP, cu)
  cu, cuP = jnp.asarray(cu, jnp.int32), jnp.asarray(cuP, jnp.int32)
  single = x.ndim == 2
  if single:
    x, cu, cuP = x[None], cu[None], cuP[None]
    position_ids = None if position_ids is None else position_ids[None]
  y = map_row_chunks(make_fn, x, position_ids, cu, cuP, plan,
                                broken, layout.shard_tokens)
  return y[0] if single else y


def init_window(x, queries: int = 1):
  """A one-document window of the first ``queries`` tokens of ``x [.., T,
  E]``, for the modules to create their parameters on."""
  lens = jnp.full(x.shape[:-2] + (1,), queries, jnp.int32)
  zeros = jnp.zeros_like(lens)
  return Window(queries, (lens, lens, zeros, zeros), queries)


def attend_window(layout: CPLayout, query, key, value, window, *,
                  window_size=None, softmax_scale: float | None = None):
  """Attention of one layer chunk (:class:`Window`): the chunk's queries
  ``[B, c, Hq, D]`` to its window's keys and values ``[B, W, Hkv, D]``, as
  a top-left chunk call and a halo call
  (:func:`jax_cp.attention.decompose.chunk_attention.chunk_attention`), on each
  device's rows (a ``shard_map`` over the batch and head axes in the
  global view with a mesh). Keys and values turn NaN when
  ``window.broken`` holds."""
  key, value = guard.nan_where(window.broken, key, value)
  c, w = query.shape[-3], key.shape[-3]
  spec = chunk_attention.Spec(
      backend=resolve_backend(
          layout.backend, dtype=query.dtype,
          score_bytes=4 * query.shape[-2] * math.prod(query.shape[:-2]) * w,
          deterministic=layout.deterministic),
      scale=default_scale(query.shape[-1], softmax_scale),
      window_left=check_window_size(window_size, "causal"),
      halo=w - c, max_q=window.max_seqlen_q, whole_halo=window.whole_halo)

  def call(q, k, v, *segments):
    return chunk_attention.chunk_attention(q, k, v, segments, spec)

  if not layout.runs_in_own_shard_map():
    return call(query, key, value, *window.segments)
  mesh = layout.context_mesh()
  x_spec, m_spec = cp_api.specs(4, layout)
  args = [cp_api.place(a, mesh, x_spec) for a in (query, key, value)]
  args += [cp_api.place(a, mesh, m_spec) for a in window.segments]
  return jax.shard_map(call, mesh=mesh, in_specs=(x_spec,) * 3 + (m_spec,) * 4,
                       out_specs=x_spec, check_vma=False)(*args)
