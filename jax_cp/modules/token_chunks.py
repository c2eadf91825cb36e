"""Position-wise work over chunks of each rank's tokens: the MLP chunks of
``TransformerLayer.mlp_chunk_size`` and the chunked LM loss
(docs/long_rows.md). Framework-neutral: no Flax import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.cp.layout import CPLayout
from jax_cp.modules.remat import add_cotangents

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


def zeros_like_tokens(x, shape, dtype):
  """Zeros of ``shape`` and ``dtype`` sharded like ``x`` on every axis but
  the last (the features, which may differ): on a mesh of ``Explicit``
  axes a buffer's sharding is part of its type, and a chunk's output can
  only be written into a buffer sharded as it is."""
  try:
    spec = tuple(jax.typeof(x).sharding.spec)
  except (AttributeError, TypeError):
    spec = ()
  if not any(s is not None for s in spec):
    return jnp.zeros(shape, dtype)
  spec += (None,) * (len(shape) - len(spec))
  return jnp.zeros(shape, dtype, out_sharding=jax.sharding.PartitionSpec(
      *spec[:len(shape) - 1], None))


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
    y = xg if in_place else zeros_like_tokens(
        xg, xg.shape[:-1] + out.shape[-1:], out.dtype)
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
      return jax.tree.map(add_cotangents, acc, dc), dx

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
