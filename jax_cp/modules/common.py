"""The runtime shared by the Linen modules of :mod:`jax_cp.flax` and the NNX
modules of :mod:`jax_cp.nnx`: the layout and input checks they run at trace
time, the head and MLP settings they validate alike, rotary embedding of
queries and keys, and the attention call. Framework-neutral: nothing here
imports Flax.

Every module holds one static ``layout`` field, a :class:`jax_cp.CPLayout`
(``None``: no CP). A parent hands its layout to its children, so a layout
chosen once on the outermost module reaches :func:`jax_cp.cp_attention`
unchanged. The checks here run before any projection or attention kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_cp import checks, partition, seqlen_guard
from jax_cp import context_parallel as _cp
from jax_cp.attention.api import default_scale
from jax_cp.attention.registry import resolve_backend
from jax_cp.layout import NO_CP, CPLayout, unpack_metadata
from jax_cp.modules import remat, rotary, row_chunks, window_attention
from jax_cp.strategy import CPLoadBalancingStrategy

# The MLP activations: plain, and gated (``act(gate(x)) * up(x)``).
ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu,
               "silu": jax.nn.silu}
GATED = {"swiglu": jax.nn.silu, "geglu": jax.nn.gelu}
NORMS = ("rmsnorm", "layernorm")

# Int codes ``DotProductAttention`` sows into "intermediates" (strings cannot
# be sown): the position of the strategy in the enum.
STRATEGY_CODES: dict[CPLoadBalancingStrategy, int] = {
    s: i for i, s in enumerate(CPLoadBalancingStrategy)}


def strategy_from_code(code: Any) -> CPLoadBalancingStrategy:
  """Inverse of :data:`STRATEGY_CODES` (accepts a sown array)."""
  return list(CPLoadBalancingStrategy)[int(np.asarray(code).reshape(-1)[0])]


def num_kv_heads(num_heads: int, num_kv_heads: int | None,
                 num_gqa_groups: int | None) -> int:
  """The number of key/value heads from ``num_kv_heads`` or its alias
  ``num_gqa_groups`` (default ``num_heads``).

  Raises:
    ValueError: the two disagree, or the result does not divide
      ``num_heads``.
  """
  a, b = num_kv_heads, num_gqa_groups
  if a is not None and b is not None and a != b:
    raise ValueError(f"num_kv_heads={a} and its alias num_gqa_groups={b} "
                     "disagree; set one of them")
  kv = a if a is not None else b if b is not None else num_heads
  if kv < 1 or num_heads % kv:
    raise ValueError(f"num_kv_heads={kv} must divide num_heads={num_heads}")
  return kv


def head_features(features: int, num_heads: int,
                  head_dim: int | None) -> int:
  """``head_dim``, default ``features // num_heads``.

  Raises:
    ValueError: the result is not positive.
  """
  d = head_dim or features // num_heads
  if d < 1:
    raise ValueError(f"head_dim must be positive; got E={features} with "
                     f"num_heads={num_heads}")
  return d


def check_activation(activation: str) -> None:
  """Raises ValueError unless ``activation`` is an MLP activation."""
  if activation not in (*ACTIVATIONS, *GATED):
    raise ValueError(f"activation={activation!r} is not one of "
                     f"{[*ACTIVATIONS, *GATED]}")


def check_norm_type(norm_type: str) -> None:
  """Raises ValueError unless ``norm_type`` is one of :data:`NORMS`."""
  if norm_type not in NORMS:
    raise ValueError(f"norm_type={norm_type!r} is not one of {list(NORMS)}")


def mlp_hidden(activation: str, up: Callable, gate: Callable, pin: Callable):
  """An MLP block's hidden activations from its projections of the input,
  ``up()`` (and ``gate()`` for a gated activation, called only then), each
  passed through ``pin`` (:meth:`jax_cp.CPLayout.shard_tokens`) and named
  ``mlpwi`` (gated: ``mlpwi_0`` the gate, ``mlpwi_1`` the linear half)."""
  if activation in GATED:
    return (GATED[activation](checkpoint_name(pin(gate()), remat.MLPWI_0))
            * checkpoint_name(pin(up()), remat.MLPWI_1))
  return ACTIVATIONS[activation](checkpoint_name(pin(up()), remat.MLPWI))


# ``mlp_chunk_size="auto"``: a rank's rows of at most this many tokens run
# the position-wise part whole; longer ones in chunks of at least this
# many tokens (a GEMM of this many rows still fills a GPU).
AUTO_MIN_CHUNK = 8192
# ... and of about the layer input's bytes in hidden-wide buffers, of which
# a chunk's backward holds this many at once: the recomputed
# pre-activation, the activation's cotangent and the two terms of its
# derivative (XLA's GPU plan of the 16 x 2048 model's step, gelu, has four
# [c, mlp_dim] buffers live at its peak; a gated MLP holds the gate's and
# the linear half's of each, and ``hidden`` counts both).
AUTO_HIDDEN_BUFFERS = 4


def check_chunk_size(value: Any, field: str, auto: bool = True) -> None:
  """Raises ValueError unless ``value`` is None, a positive int or (with
  ``auto``) ``"auto"``; ``field`` names the field in the message."""
  if value is None or (auto and isinstance(value, str) and value == "auto"):
    return
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    allowed = "None, 'auto' or" if auto else "None or"
    raise ValueError(f"{field}={value!r} must be {allowed} a positive int "
                     "(tokens per chunk)")


def mlp_chunk_tokens(chunk_size: Any, remat: Any, local_tokens: int,
                     features: int, hidden: int) -> int | None:
  """Tokens per chunk of a layer's position-wise part (None: whole), for
  ``local_tokens`` tokens per rank.

  ``chunk_size`` is a positive int, None (whole) or ``"auto"``: whole
  under ``remat="none"`` (the backward keeps every chunk's activations
  anyway) or for at most :data:`AUTO_MIN_CHUNK` tokens; otherwise
  ``AUTO_HIDDEN_BUFFERS * hidden / features`` chunks (``hidden``: the
  ``mlp_dim``, twice that when gated), so that the hidden-wide buffers a
  chunk's backward holds take about what the ``features``-wide input
  takes, of at least :data:`AUTO_MIN_CHUNK` tokens each
  (Mini-Sequence Transformer's ``M = I / d`` chunks, counted for the
  backward)."""
  if chunk_size is None:
    return None
  if chunk_size == "auto":
    if isinstance(remat, str) and remat == "none" or (
        local_tokens <= AUTO_MIN_CHUNK):
      return None
    count = max(-(-AUTO_HIDDEN_BUFFERS * hidden // features), 1)
    chunk_size = max(-(-local_tokens // count), AUTO_MIN_CHUNK)
  return None if chunk_size >= local_tokens else int(chunk_size)


def token_groups(layout: CPLayout, cp_size: int) -> int:
  """How many ranks' tokens a module's token axis holds: ``cp_size`` in
  the global view with CP, else 1."""
  global_cp = layout.cp_axis is not None and not layout.is_local
  return cp_size if global_cp else 1


def pin_groups(layout: CPLayout, x):
  """``x`` ``[.., G, c, F]`` (a chunk of every rank's tokens in the global
  view, ``G`` the ranks) constrained to keep ``G`` on ``cp_axis`` and the
  batch on ``batch_axis``, as :meth:`jax_cp.CPLayout.shard_tokens` keeps
  whole rows; ``x`` itself where that is the identity."""
  free = jax.sharding.PartitionSpec.UNCONSTRAINED
  lead = ((layout.batch_axes or None,) + (None,) * (x.ndim - 4)
          if x.ndim >= 4 else ())
  return layout.constrain(x, (*lead, layout.cp_axis, None, free))


def map_token_chunks(fn: Callable, x, chunk: int | None, layout: CPLayout,
                     cp_size: int, aux=None):
  """``fn`` over the tokens of ``x [.., T, E]``, ``chunk`` of each rank's
  tokens at a time (None, or at least a rank's tokens: ``fn(x, pin)``
  whole, ``pin`` the layout's :meth:`jax_cp.CPLayout.shard_tokens`).

  ``fn(x_c, pin)`` must be position-wise (each token's output depends on
  that token alone) and ``pin`` any value it makes of the chunk's tokens.
  With ``aux`` (an array ``[.., T]`` of per-token inputs that take no
  gradient, such as labels) it is ``fn(x_c, aux_c, pin)``, ``aux_c`` the
  chunk's tokens of ``aux``.
  In the global view with CP a chunk is ``[.., cp, c, E]``: ``c`` tokens
  of every rank, each rank's own (``pin`` keeps them there), so chunking
  moves no token between ranks; in the local view and without CP it is
  ``[.., c, E]``. The full chunks run in a loop; a shorter last chunk
  after it takes the rest of the tokens. Returns ``[.., T, F]``.

  The loop is a ``custom_vjp`` (Mini-Sequence Transformer's): what it
  keeps for the backward is ``x`` and the arrays ``fn`` reads (its
  parameters), and its backward re-runs each chunk's forward with
  :func:`jax.vjp` next to that chunk's backward, so one chunk's
  activations are live at a time, forward and backward, whatever an
  enclosing ``jax.checkpoint`` policy saves (the names ``fn`` tags are
  never saved; the policy decides about ``x`` alone). When ``fn`` keeps
  the shape and dtype (``F == E``: a residual block) both directions run
  in place: the forward writes each chunk's output over its input in the
  loop's carry, the backward each chunk's input cotangent over its output
  cotangent, and the parameter cotangents start from the first chunk's.
  Otherwise the backward writes each chunk's input cotangent over that
  chunk of ``x`` (read first, for the recompute). Either way the backward
  allocates no zero-filled buffer (token-sized or parameter-sized), which
  XLA would create ahead of time and keep until the loop runs.
  """
  groups = token_groups(layout, cp_size)
  lead, local = x.shape[:-2], x.shape[-2] // groups
  if aux is not None and tuple(aux.shape[:x.ndim - 1]) != tuple(
      x.shape[:-1]):
    raise ValueError(f"aux must have the shape of x without its feature "
                     f"dim, {tuple(x.shape[:-1])}; got {tuple(aux.shape)}")
  call = (lambda xc, ac, p: fn(xc, p)) if aux is None else fn
  if chunk is None or chunk >= local:
    return call(x, aux, layout.shard_tokens)
  pin = lambda v: pin_groups(layout, v)
  xg = pin(x.reshape(lead + (groups, local, x.shape[-1])))
  # aux with x's token axes (``.., groups, local``), its trailing dims
  # after them.
  ag = None if aux is None else aux.reshape(
      lead + (groups, local) + aux.shape[x.ndim - 1:])
  n, rest = divmod(local, chunk)
  part = lambda v, start, size: jax.lax.dynamic_slice_in_dim(
      v, start, size, axis=v.ndim - 2)
  aux_part = lambda ag, start, size: None if ag is None else \
      jax.lax.dynamic_slice_in_dim(ag, start, size, axis=len(lead) + 1)
  put = lambda v, u, start: pin(jax.lax.dynamic_update_slice_in_dim(
      v, u.astype(v.dtype), start, axis=v.ndim - 2))

  def convert(size):
    """``fn`` on ``size`` tokens as ``f(consts, x_c, aux_c)``, and the
    consts: the arrays it reads besides ``x_c`` and ``aux_c``, explicit for
    the ``custom_vjp``."""
    if ag is None:
      f, consts = jax.closure_convert(lambda xc: call(pin(xc), None, pin),
                                      xg[..., :size, :])
      return (lambda consts, xc, ac: f(xc, *consts)), consts
    f, consts = jax.closure_convert(
        lambda xc, ac: call(pin(xc), ac, pin), xg[..., :size, :],
        aux_part(ag, 0, size))
    return (lambda consts, xc, ac: f(xc, ac, *consts)), consts

  f_full, c_full = convert(chunk)
  f_rest, c_rest = convert(rest) if rest else (None, [])
  out = jax.eval_shape(f_full, c_full, xg[..., :chunk, :],
                       aux_part(ag, 0, chunk))
  in_place = out.shape[-1] == xg.shape[-1] and out.dtype == xg.dtype

  def forward(c_full, c_rest, xg, ag):
    # In place the carry starts as x; chunk i is read before it is written.
    y = xg if in_place else jnp.zeros(xg.shape[:-1] + out.shape[-1:],
                                      out.dtype)
    src = lambda y: y if in_place else xg
    y = jax.lax.fori_loop(0, n, lambda i, y: put(y, f_full(
        c_full, part(src(y), i * chunk, chunk),
        aux_part(ag, i * chunk, chunk)), i * chunk), pin(y))
    if rest:
      y = put(y, f_rest(c_rest, part(src(y), n * chunk, rest),
                        aux_part(ag, n * chunk, rest)), n * chunk)
    return y

  @jax.custom_vjp
  def chunked(c_full, c_rest, xg, ag):
    return forward(c_full, c_rest, xg, ag)

  def chunked_fwd(c_full, c_rest, xg, ag):
    return forward(c_full, c_rest, xg, ag), (c_full, c_rest, xg, ag)

  def chunked_bwd(res, dy):
    c_full, c_rest, xg, ag = res
    dy = pin(dy)

    def step(f, consts, start, size, dx):
      """The chunk's parameter cotangents, and ``dx`` with its input
      cotangent written in. The barrier orders the chunk's recompute after
      the previous chunk's backward, also where XLA unrolls the loop."""
      src = xg if in_place else dx
      xc, dx = jax.lax.optimization_barrier((part(src, start, size), dx))
      ac = aux_part(ag, start, size)
      _, vjp = jax.vjp(lambda c, xc: f(c, xc, ac), consts, pin(xc))
      dc, dxc = vjp(pin(part(dx if in_place else dy, start, size)))
      return dc, put(dx, dxc, start)

    # In place dx is dy's buffer: chunk i of dy is read before it is
    # overwritten with chunk i of dx. Otherwise it is x's: chunk i of x is
    # read (for the recompute) before it is overwritten.
    dx = dy if in_place else xg
    dc_full, dx = step(f_full, c_full, 0, chunk, dx)

    def body(i, carry):
      acc, dx = carry
      dc, dx = step(f_full, c_full, i * chunk, chunk, dx)
      return jax.tree.map(remat.add_cotangents, acc, dc), dx

    dc_full, dx = jax.lax.fori_loop(1, n, body, (dc_full, dx))
    dc_rest = []
    if rest:
      dc_rest, dx = step(f_rest, c_rest, n * chunk, rest, dx)
    # One buffer for all of dx's readers: without the barrier XLA fuses the
    # last update into each reader and copies dx for every one of them.
    return dc_full, dc_rest, jax.lax.optimization_barrier(dx), None

  chunked.defvjp(chunked_fwd, chunked_bwd)
  ys = chunked(c_full, c_rest, xg, ag)
  return layout.shard_tokens(ys.reshape(lead + (x.shape[-2], -1)))


def check_layout(layout: CPLayout | None) -> CPLayout:
  """The module's layout (``None``: :data:`jax_cp.layout.NO_CP`).

  Raises:
    ValueError: ``layout`` is not a :class:`jax_cp.CPLayout`.
  """
  if layout is None:
    return NO_CP
  if not isinstance(layout, CPLayout):
    raise ValueError(f"layout must be a jax_cp.CPLayout or None, got "
                     f"{type(layout).__name__} {layout!r}")
  return layout


def metadata(layout: CPLayout, cu_seqlens, cu_seqlens_padded, what: str
             ) -> tuple[Any, Any]:
  """``(cu_seqlens, cu_seqlens_padded)`` of a module call, from the arrays
  or from a :class:`jax_cp.CPBatch` (whose layout must match the module's).
  """
  return unpack_metadata(cu_seqlens, cu_seqlens_padded, layout, what)


def check_tokens(layout: CPLayout, n_tokens: int, cu_seqlens_padded,
                 argname: str) -> int:
  """Checks that ``n_tokens`` (the module's token axis) fits the global row
  metadata and returns the cp size.

  Global view (and no CP): ``n_tokens`` is the whole row and must equal
  ``cu_seqlens_padded[..., -1]``. Local view: ``n_tokens`` is this rank's
  chunk and ``n_tokens * cp_size`` must. Values are compared only when the
  metadata is concrete; shapes are always checked.

  Raises:
    ValueError: naming ``cu_seqlens_padded`` (length mismatch), ``cp_axis``
      or ``batch_axis`` (not on the mesh, or not bound).
  """
  cp = layout.resolve_cp_size()
  if np.ndim(cu_seqlens_padded) not in (1, 2):
    raise ValueError(f"cu_seqlens_padded must be [N+1] or [B, N+1], got shape "
                     f"{np.shape(cu_seqlens_padded)}")
  total = n_tokens * cp if layout.is_local else n_tokens
  cuP = checks.concrete(cu_seqlens_padded)
  if cuP is not None and cuP.size:
    ends = np.unique(cuP.reshape(-1, cuP.shape[-1])[:, -1])
    if ends.size != 1 or int(ends[0]) != total:
      if layout.is_local:
        what = (f"{argname} has {n_tokens} tokens per rank, i.e. "
                f"{n_tokens} x cp_size {cp} = {total} in the row")
      else:
        what = f"{argname} has {total} tokens"
      raise ValueError(
          f"{what}, but cu_seqlens_padded[..., -1] is {ends.tolist()}: the "
          "token count must equal the padded row length "
          f"(view={layout.view!r}, cp_axis={layout.cp_axis!r})")
  return cp


def check_position_ids(position_ids, x_shape, argname: str = "x") -> None:
  """Raises ValueError unless ``position_ids`` (if given) has the shape of
  ``x`` without its feature dim."""
  if position_ids is not None and tuple(np.shape(position_ids)) != tuple(
      x_shape[:-1]):
    raise ValueError(f"position_ids must have the shape of {argname} without "
                     f"its feature dim, {tuple(x_shape[:-1])}; got "
                     f"{tuple(np.shape(position_ids))}")


def default_position_ids(layout: CPLayout, cu_seqlens_padded, n_tokens: int,
                         cp_size: int):
  """Per-document positions in the layout of the module's tokens, from the
  metadata (:func:`jax_cp.get_position_ids` with the layout)."""
  total = n_tokens * cp_size if layout.is_local else n_tokens
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  if cp_size == 1:
    return partition.get_position_ids(cuP, total_tokens=total)
  return partition.get_position_ids(cuP, total_tokens=total,
                                    layout=layout.replace(cp_size=cp_size))


def call_inputs(layout: CPLayout | None, x_shape, cu_seqlens,
                cu_seqlens_padded, position_ids, what: str,
                rope_theta: float | None = None) -> tuple[CPLayout, Any]:
  """The checks every layer module runs on ``x [.., T, E]`` first:
  ``(layout, position_ids)``, with the metadata unpacked from a batch
  (:func:`metadata`), the token count checked against them
  (:func:`check_tokens`) and ``position_ids`` against ``x``; with rotary
  embeddings (``rope_theta`` not None) ``position_ids`` default to the
  documents' positions (:func:`default_position_ids`), computed here,
  outside any rematerialized body. ``what`` names the module in errors.

  The caller passes its own ``cu_seqlens`` (a :class:`CPBatch` or arrays)
  on to attention, not the unpacked ones: a batch keeps its host check."""
  layout = check_layout(layout)
  cu_seqlens, cu_seqlens_padded = metadata(
      layout, cu_seqlens, cu_seqlens_padded, f"{what}'s batch")
  cp_size = check_tokens(layout, x_shape[-2], cu_seqlens_padded, "x")
  check_position_ids(position_ids, x_shape)
  if position_ids is None and rope_theta is not None:
    position_ids = default_position_ids(layout, cu_seqlens_padded,
                                        x_shape[-2], cp_size)
  return layout, position_ids


def rotate_qkv(q, k, v, theta: float | None, position_ids):
  """``q``/``k`` ``[.., T, H, D]`` with rotary embeddings of base ``theta``
  (unchanged when None) at ``position_ids``, and ``v``; named
  ``query_proj``, ``key_proj``, ``value_proj``. ``q`` may hold the last
  tokens of ``k``'s only (a layer chunk's queries, whose keys include the
  halo before them): it takes the last of the positions."""
  if theta is not None:
    q = rotary.apply_rotary(q, position_ids[..., -q.shape[-3]:], theta)
    k = rotary.apply_rotary(k, position_ids, theta)
  return (checkpoint_name(q, remat.QUERY_PROJ),
          checkpoint_name(k, remat.KEY_PROJ),
          checkpoint_name(v, remat.VALUE_PROJ))


def layer_chunk_plan(chunk_size: int | None, layout: CPLayout, x_shape,
                     window_size) -> row_chunks.Plan | None:
  """The chunks of a :class:`TransformerLayer` with ``layer_chunk_size=
  chunk_size`` on ``x`` of ``x_shape`` (None: the whole row at once),
  :func:`jax_cp.modules.row_chunks.plan`."""
  window_left = checks.check_window_size(window_size, "causal")
  return row_chunks.plan(chunk_size, layout, x_shape[-2], window_left)


def run_layer_chunks(make_fn: Callable, layout: CPLayout, x, position_ids,
                     cu_seqlens, cu_seqlens_padded, plan: row_chunks.Plan):
  """A layer over the chunks of ``plan``
  (:func:`jax_cp.modules.row_chunks.map_row_chunks`), on ``x [B, T, E]``
  or ``[T, E]``, with the bound of the halo checked first
  (:func:`jax_cp.modules.row_chunks.check_bound`). ``cu_seqlens``: the
  layer's argument, arrays or a :class:`jax_cp.CPBatch`."""
  cu, cuP = metadata(layout, cu_seqlens, cu_seqlens_padded,
                     "TransformerLayer's batch")
  broken = row_chunks.check_bound(plan, layout.for_batch(cu_seqlens), cuP)
  cu, cuP = jnp.asarray(cu, jnp.int32), jnp.asarray(cuP, jnp.int32)
  single = x.ndim == 2
  if single:
    x, cu, cuP = x[None], cu[None], cuP[None]
    position_ids = None if position_ids is None else position_ids[None]
  y = row_chunks.map_row_chunks(make_fn, x, position_ids, cu, cuP, plan,
                                broken, layout.shard_tokens)
  return y[0] if single else y


def init_window(x, queries: int = 1):
  """A one-document window of the first ``queries`` tokens of ``x [.., T,
  E]``, for the modules to create their parameters on."""
  lens = jnp.full(x.shape[:-2] + (1,), queries, jnp.int32)
  zeros = jnp.zeros_like(lens)
  return row_chunks.Window(queries, (lens, lens, zeros, zeros), queries)


def attend_window(layout: CPLayout, query, key, value, window, *,
                  window_size=None, softmax_scale: float | None = None):
  """Attention of one layer chunk (:class:`jax_cp.modules.row_chunks.
  Window`): the chunk's queries ``[B, c, Hq, D]`` to its window's keys and
  values ``[B, W, Hkv, D]``, as a top-left chunk call and a halo call
  (:func:`jax_cp.modules.window_attention.window_attention`), on each
  device's rows (a ``shard_map`` over the batch and head axes in the
  global view with a mesh). Keys and values turn NaN when
  ``window.broken`` holds."""
  key, value = seqlen_guard.nan_where(window.broken, key, value)
  c, w = query.shape[-3], key.shape[-3]
  spec = window_attention.Spec(
      backend=resolve_backend(
          layout.backend, dtype=query.dtype,
          score_bytes=4 * query.shape[-2] * math.prod(query.shape[:-2]) * w),
      scale=default_scale(query.shape[-1], softmax_scale),
      window_left=checks.check_window_size(window_size, "causal"),
      halo=w - c, max_q=window.max_seqlen_q, whole_halo=window.whole_halo)

  def call(q, k, v, *segments):
    return window_attention.window_attention(q, k, v, segments, spec)

  if layout.cp_axis is None or layout.is_local:
    return call(query, key, value, *window.segments)
  mesh = _cp.resolve_mesh(layout.mesh)
  x_spec, m_spec = _cp.specs(4, layout.batch_axes, layout.cp_axis,
                             layout.head_axis)
  args = [_cp.place(a, mesh, x_spec) for a in (query, key, value)]
  args += [_cp.place(a, mesh, m_spec) for a in window.segments]
  return jax.shard_map(call, mesh=mesh, in_specs=(x_spec,) * 3 + (m_spec,) * 4,
                       out_specs=x_spec, check_vma=False)(*args)


def attend(layout: CPLayout, query, key, value, cu_seqlens,
           cu_seqlens_padded, **kwargs):
  """Attention of a module: :func:`jax_cp.cp_attention` in the global view
  with CP, :func:`jax_cp.cp_attention_local` otherwise (local view, or no
  CP: the whole row on one rank)."""
  if layout.cp_axis is None or layout.is_local:
    return _cp.cp_attention_local(query, key, value, cu_seqlens,
                                  cu_seqlens_padded, layout=layout, **kwargs)
  return _cp.cp_attention(query, key, value, cu_seqlens, cu_seqlens_padded,
                          layout=layout, **kwargs)
