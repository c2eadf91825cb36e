"""Which tokens of a packed THD row each context-parallel rank holds.

Every function here has two paths with the same results:

* a **numpy** path, taken when the metadata and the rank are host values
  (numpy arrays, lists, Python ints): for data loaders, which slice the
  batch on the host before it reaches the devices;
* a **jnp** path, taken when any of them is a JAX array (possibly traced,
  e.g. ``cp_rank = lax.axis_index("cp")`` inside ``shard_map``): jittable,
  with the number of documents (``max_docs``) static. Trailing empty
  documents (repeated last ``cu_seqlens_padded`` value) are allowed.

Each strategy places the tokens its own way (docs/concepts.md,
Strategies; :mod:`jax_cp.cp.strategies`); the functions here check the
arguments and apply the layout's placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention.validation import concrete
from jax_cp.cp import validation
from jax_cp.cp.layout import CPLayout, check_layout
from jax_cp.cp.strategies import strategy_for
from jax_cp.cp.strategies.load_balancing import CPLoadBalancingStrategy
from jax_cp.typing import Array, ArrayLike


def _is_jax(*xs: Any) -> bool:
  return any(isinstance(x, jax.Array) for x in xs)


def _xp(*xs: Any):
  return jnp if _is_jax(*xs) else np


def valid_local_tokens(cu_seqlens, cu_seqlens_padded, cp_size: int,
                       strategy: CPLoadBalancingStrategy, rank,
                       local_tokens: int):
  """jnp, jittable: which local tokens of ``rank`` are valid tokens of a
  document (not padding).

  Args:
    cu_seqlens, cu_seqlens_padded: int32 ``[B, N+1]`` row metadata.
    cp_size: the cp size.
    strategy: the layout's strategy.
    rank: this rank, an int32 scalar (possibly traced).
    local_tokens: ``T / cp``.

  Returns:
    bool ``[B, local_tokens]``: the token's position in its document is
    below the document's length.
  """
  placement = strategy_for(strategy)

  def one_row(cu, cuP):
    t = jnp.arange(local_tokens, dtype=jnp.int32)
    b, position = placement.document_position(cuP, cp_size, rank, t,
                                               local_tokens)
    return position < cu[b + 1] - cu[b]

  return jax.vmap(one_row)(jnp.asarray(cu_seqlens, jnp.int32),
                           jnp.asarray(cu_seqlens_padded, jnp.int32))


def _cp_size(layout: CPLayout, what: str) -> int:
  """The layout's cp size: as set (or read from its mesh), else the size of
  its axis where it runs (context mesh, enclosing ``shard_map``)."""
  if layout.cp_size is not None:
    return layout.cp_size
  if layout.cp_axis is None:
    return 1
  try:
    return layout.resolve_cp_size()
  except ValueError as e:
    raise ValueError(f"{what} needs the cp size: build the CPLayout with "
                     f"mesh=... or cp_size=... ({e})") from None


def _traced_rank(layout: CPLayout, what: str):
  """``lax.axis_index(cp_axis)``, inside a ``shard_map``."""
  if layout.cp_axis is None:
    return 0
  try:
    return jax.lax.axis_index(layout.cp_axis)
  except NameError:
    raise ValueError(
        f"{what}: cp_rank is needed outside a shard_map over "
        f"{layout.cp_axis!r}") from None


def _local_tokens(cu_seqlens_padded, cp_size: int,
                  total_tokens: int | None) -> int:
  if total_tokens is None:
    if isinstance(cu_seqlens_padded, jax.core.Tracer):
      raise ValueError(
          "total_tokens must be given when cu_seqlens_padded is traced "
          "(the number of local tokens has to be static)")
    total_tokens = int(np.asarray(cu_seqlens_padded)[..., -1].flat[0])
  validation.check_divisible_tokens(total_tokens, cp_size)
  return total_tokens // cp_size


def get_partition_indices(cu_seqlens_padded: ArrayLike, layout: CPLayout,
                          cp_rank: int | ArrayLike, *,
                          total_tokens: int | None = None
                          ) -> np.ndarray | Array:
  """Physical token indices that CP rank ``cp_rank`` holds, in local order.

  Args:
    cu_seqlens_padded: int ``[N+1]`` (or ``[B, N+1]`` for a batch of rows)
      cumulative padded document lengths, ``cuP[-1] == T``.
    layout: the :class:`jax_cp.CPLayout` (its cp size and strategy).
    cp_rank: this rank, a Python int or a (traced) JAX scalar.
    total_tokens: ``T``; needed only when ``cu_seqlens_padded`` is traced.

  Returns:
    int32 ``[T // cp_size]`` (``[B, T // cp_size]`` for batched metadata):
    numpy for host inputs, a JAX array when any input is a JAX array.
  """
  layout = check_layout(layout, "get_partition_indices")
  placement = strategy_for(layout.strategy)
  cp_size = _cp_size(layout, "get_partition_indices")
  xp = _xp(cu_seqlens_padded, cp_rank)
  if xp is np:
    validation.check_cp_rank(cp_rank, cp_size)
  validation.check_cu_seqlens_padded(cu_seqlens_padded, total_tokens)
  local = _local_tokens(cu_seqlens_padded, cp_size, total_tokens)
  placement.check_padded_lengths(cu_seqlens_padded, cp_size)
  if xp is jnp:
    cp_rank = jnp.asarray(cp_rank, jnp.int32)

  def one_row(cuP):
    return placement.physical_index(xp, cuP, cp_size, cp_rank,
                                    xp.arange(local, dtype=xp.int32), local)

  cuP = xp.asarray(cu_seqlens_padded)
  if cuP.ndim == 1:
    return one_row(cuP)
  if xp is jnp:
    return jax.vmap(one_row)(cuP)
  return np.stack([one_row(row) for row in cuP])


def _explicit_sharding(x):
  """The NamedSharding of ``x`` if it is sharded over Explicit mesh axes."""
  try:
    sharding = jax.typeof(x).sharding
  except Exception:  # pylint: disable=broad-except  (numpy input)
    return None
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return None
  return sharding


def token_dim(seq_dim: int | None, cu_seqlens_padded) -> int:
  """The token dim of arrays that go with ``cu_seqlens_padded``: as given,
  or by default (None) 1 for batched metadata ``[B, N+1]`` (arrays ``[B,
  T, ...]``) and 0 for ``[N+1]`` (arrays ``[T, ...]``), the convention of
  every data function that takes ``seq_dim``."""
  if seq_dim is None:
    return 1 if np.ndim(cu_seqlens_padded) == 2 else 0
  if isinstance(seq_dim, bool) or not isinstance(seq_dim, (int, np.integer)):
    raise ValueError(f"seq_dim must be an int (the token dim) or None, got "
                     f"{seq_dim!r}")
  return int(seq_dim)


def _check_token_dim(x, seq_dim: int, cu_seqlens_padded, name: str) -> None:
  """``x`` has the row's tokens (``cu_seqlens_padded[..., -1]``, when
  concrete) along ``seq_dim``; the error names ``seq_dim``.

  Raises:
    ValueError: ``x`` has no dim ``seq_dim``, or another token count there.
  """
  shape = tuple(np.shape(x))
  if not -len(shape) <= seq_dim < len(shape):
    raise ValueError(f"{name} has shape {shape}: no token dim seq_dim="
                     f"{seq_dim}")
  try:
    validation.check_seq_len_matches(shape[seq_dim], cu_seqlens_padded, name)
  except ValueError as e:
    batched = np.ndim(cu_seqlens_padded) == 2
    raise ValueError(
        f"{e} (counted along seq_dim={seq_dim} of shape {shape}; with "
        f"{'batched' if batched else 'unbatched'} metadata the tokens are "
        f"dim {1 if batched else 0} by default: pass seq_dim= for another "
        "layout)") from None


def _take(x, idx, seq_dim: int, batched: bool):
  sharding = _explicit_sharding(x) if isinstance(x, jax.Array) else None
  spec = sharding.spec if sharding is not None else ()
  if len(spec) > seq_dim and spec[seq_dim] is not None:
    # A gather across an explicitly sharded axis: gather on an unsharded
    # copy of that axis, then shard the result the same way as the input.
    open_spec = list(spec) + [None] * (x.ndim - len(spec))
    open_spec[seq_dim] = None
    mesh = sharding.mesh
    x = jax.reshard(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*open_spec)))
    return jax.reshard(_take(x, idx, seq_dim, batched),
                       jax.sharding.NamedSharding(mesh, spec))
  xp = _xp(x, idx)
  if not batched:
    return xp.take(x, idx, axis=seq_dim)
  if seq_dim == 0:
    raise ValueError("with batched cu_seqlens_padded [B, N+1], seq_dim must "
                     "point past the leading batch dim (seq_dim >= 1)")
  if x.ndim <= seq_dim or x.shape[0] != idx.shape[0]:
    raise ValueError(
        f"batched cu_seqlens_padded has {idx.shape[0]} rows, so the "
        f"tensors must be [B={idx.shape[0]}, ...] with the tokens on "
        f"seq_dim={seq_dim}; got shape {tuple(x.shape)}")
  shape = [1] * x.ndim
  shape[0] = idx.shape[0]
  shape[seq_dim] = idx.shape[1]
  return xp.take_along_axis(x, idx.reshape(shape), axis=seq_dim)


def get_batch_on_this_cp_rank(cu_seqlens_padded: ArrayLike,
                              *tensors: ArrayLike, layout: CPLayout,
                              cp_rank: int | ArrayLike | None = None,
                              seq_dim: int | None = None,
                              cu_seqlens: ArrayLike | None = None
                              ) -> tuple[Any, ...]:
  """Slices each tensor along ``seq_dim`` to the tokens of ``cp_rank``.

  The usual data-loader step: ``input_ids, labels, position_ids =
  get_batch_on_this_cp_rank(cuP, input_ids, labels, position_ids,
  layout=layout, cp_rank=r)``, then attend with the same ``layout``. With
  batched metadata ``[B, N+1]`` each row is sliced with its own layout
  (``seq_dim`` must then be >= 1).

  Args:
    cu_seqlens_padded: int ``[N+1]`` / ``[B, N+1]`` row metadata.
    *tensors: arrays with the whole rows along ``seq_dim``.
    layout: the :class:`jax_cp.CPLayout` (cp size, strategy, and
      ``max_seqlen``: when set and the metadata is concrete it is checked
      against the longest document here, on the host, where a violation
      can still be reported; under ``jit`` it cannot).
    cp_rank: the rank, an int or a (traced) scalar; default, inside a
      ``shard_map``: ``lax.axis_index(layout.cp_axis)``.
    seq_dim: the token dim of the tensors; default (None): 1 with batched
      metadata (tensors ``[B, T, ...]``), 0 without (``[T, ...]``).
    cu_seqlens: optional valid-length metadata of the same rows, for the
      ``max_seqlen`` check alone: slots that hold no token (the padding
      after a row's last document) then do not count against the bound
      (:func:`jax_cp.cp.validation.document_spans`); without it every
      padded slot does.

  Raises:
    ValueError: a tensor's length along ``seq_dim`` is not ``cuP[-1]``, the
      layout breaks the strategy's rules, or a document is longer than
      ``max_seqlen``.
  """
  layout = check_layout(layout, "get_batch_on_this_cp_rank")
  if cp_rank is None:
    cp_rank = _traced_rank(layout, "get_batch_on_this_cp_rank")
  if layout.max_seqlen is not None:
    check_max_seqlen_bound(cu_seqlens_padded, layout.max_seqlen, cu_seqlens,
                           layout)
  if not tensors:
    return ()
  seq_dim = token_dim(seq_dim, cu_seqlens_padded)
  batched = np.ndim(cu_seqlens_padded) == 2
  total = tensors[0].shape[seq_dim]
  for i, x in enumerate(tensors):
    _check_token_dim(x, seq_dim, cu_seqlens_padded, f"tensors[{i}]")
    if x.shape[seq_dim] != total:
      raise ValueError(
          f"tensors[{i}] has {x.shape[seq_dim]} tokens along seq_dim="
          f"{seq_dim}, tensors[0] has {total}")
  idx = get_partition_indices(cu_seqlens_padded, layout, cp_rank,
                              total_tokens=total)
  return tuple(_take(x, idx, seq_dim, batched) for x in tensors)


def _cp_permutation(cu_seqlens_padded, layout, cp_size, total_tokens):
  """Concatenation over ranks of their partition indices: ``[.., T]``."""
  parts = [get_partition_indices(cu_seqlens_padded, layout, r,
                                 total_tokens=total_tokens)
           for r in range(cp_size)]
  xp = _xp(*parts)
  return xp.concatenate(parts, axis=-1)


def _inverse_permutation(perm):
  xp = _xp(perm)
  n = perm.shape[-1]
  if xp is np:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(
        np.arange(n, dtype=perm.dtype), perm.shape), axis=-1)
    return inv
  return jnp.argsort(perm, axis=-1).astype(jnp.int32)


def reorder_for_cp(x: ArrayLike, cu_seqlens_padded: ArrayLike,
                   layout: CPLayout,
                   seq_dim: int | None = None) -> np.ndarray | Array:
  """Global view: permutes the tokens so that a contiguous split of
  ``seq_dim`` over the cp axis gives rank ``r`` exactly
  ``get_partition_indices(..., r)``.

  After this, shard ``seq_dim`` over the cp mesh axis (``NamedSharding`` with
  ``P(..., "cp", ...)``) and call :func:`jax_cp.cp_attention` with the same
  ``layout``. NO_LOAD_BALANCE is the identity. On a mesh of ``Explicit``
  axes a sharded ``x`` keeps its sharding (the tokens over cp).

  Args:
    x: the whole rows, tokens along ``seq_dim``.
    cu_seqlens_padded: int ``[N+1]`` / ``[B, N+1]`` row metadata.
    layout: the :class:`jax_cp.CPLayout` (its cp size and strategy).
    seq_dim: the token dim of ``x``; default (None): 1 with batched
      metadata (``x`` ``[B, T, ...]``), 0 without (``[T, ...]``).
  """
  layout = check_layout(layout, "reorder_for_cp")
  return _permute(x, cu_seqlens_padded, layout, seq_dim, inverse=False)


def restore_from_cp(x: ArrayLike, cu_seqlens_padded: ArrayLike,
                    layout: CPLayout,
                    seq_dim: int | None = None) -> np.ndarray | Array:
  """Inverse of :func:`reorder_for_cp`: back to physical token order (same
  arguments). On a mesh of ``Explicit`` axes a sharded ``x`` keeps its
  sharding: the result's tokens stay sharded over cp, in physical order
  (``jax.reshard`` it to combine it with arrays of another sharding)."""
  layout = check_layout(layout, "restore_from_cp")
  return _permute(x, cu_seqlens_padded, layout, seq_dim, inverse=True)


def _permute(x, cu_seqlens_padded, layout: CPLayout, seq_dim: int | None,
             inverse: bool):
  cp_size = _cp_size(layout, "reorder_for_cp")
  seq_dim = token_dim(seq_dim, cu_seqlens_padded)
  _check_token_dim(x, seq_dim, cu_seqlens_padded, "x")
  total = x.shape[seq_dim]
  if strategy_for(layout.strategy).holds_row_in_order(cp_size):
    validation.check_cu_seqlens_padded(cu_seqlens_padded, total)
    validation.check_divisible_tokens(total, cp_size)
    return x
  perm = _cp_permutation(cu_seqlens_padded, layout, cp_size, total)
  if inverse:
    perm = _inverse_permutation(perm)
  return _take(x, perm, seq_dim, np.ndim(cu_seqlens_padded) == 2)


def longest_padded_document(cu_seqlens_padded: ArrayLike,
                            cu_seqlens: ArrayLike | None = None) -> int:
  """The longest padded document of a row (or of all rows): the tightest
  ``max_seqlen`` of a :class:`jax_cp.CPLayout` for either strategy. With
  ``cu_seqlens``, slots that hold no token (the padding after a row's
  last document) are left out: they never count against the bound
  (:func:`jax_cp.cp.validation.document_spans`). Host (concrete) data."""
  cuP = concrete(cu_seqlens_padded)
  if cuP is None:
    raise ValueError("longest_padded_document needs concrete (host) "
                     "cu_seqlens_padded, not a traced value")
  validation.check_cu_seqlens_padded(cuP)
  cu = None
  if cu_seqlens is not None:
    cu = concrete(cu_seqlens)
    if cu is None:
      raise ValueError("longest_padded_document needs concrete (host) "
                       "cu_seqlens, not a traced value")
    validation.check_cu_seqlens(cu, cuP)
  # The strictest rule: every padded slot that holds a token counts.
  spans = validation.slot_spans(cu, cuP, padded_slots=True)
  return int(np.max(spans, initial=0))


def check_max_seqlen_bound(cu_seqlens_padded, max_seqlen, cu_seqlens=None,
                           layout: CPLayout | None = None) -> None:
  """Raises if a concrete row holds a document whose span is longer than
  ``max_seqlen`` (:func:`jax_cp.cp.validation.document_spans` under the
  layout's strategy and cp size; without ``cu_seqlens`` every padded slot
  counts); a no-op for traced metadata."""
  cuP = concrete(cu_seqlens_padded)
  if cuP is None:
    return
  validation.check_cu_seqlens_padded(cuP)
  strategy, cp = None, 1
  if layout is not None:
    strategy, cp = layout.strategy, _cp_size(layout, "max_seqlen check")
  validation.check_max_seqlen_bound(cuP, max_seqlen, cu_seqlens, strategy,
                                    cp)


def get_position_ids(cu_seqlens_padded: ArrayLike,
                     total_tokens: int | None = None, *,
                     layout: CPLayout | None = None,
                     cp_rank: int | ArrayLike | None = None
                     ) -> np.ndarray | Array:
  """Per-token position inside its document, restarting at 0 per document.

  Without ``layout``: int32 ``[T]`` (``[B, T]`` for batched metadata) in
  physical order, numpy for host input, JAX otherwise; slice it with
  :func:`get_batch_on_this_cp_rank` together with the tokens (rotary
  embeddings need the original positions). Padding tokens continue their
  document's count.

  With ``layout``: the positions in that layout, ready to go with tokens
  laid out by it: the whole row in :func:`reorder_for_cp` order (view
  ``"global"``), or rank ``cp_rank``'s chunk ``[.., T / cp]`` (view
  ``"local"``; ``cp_rank`` defaults to ``lax.axis_index(cp_axis)`` inside a
  ``shard_map``). ``total_tokens`` is always the whole row's ``T``.
  """
  pos = _physical_position_ids(cu_seqlens_padded, total_tokens)
  if layout is None:
    return pos
  seq_dim = pos.ndim - 1
  if layout.is_local:
    if cp_rank is None:
      cp_rank = _traced_rank(layout, "get_position_ids")
    return get_batch_on_this_cp_rank(cu_seqlens_padded, pos, cp_rank=cp_rank,
                                     layout=layout, seq_dim=seq_dim)[0]
  return reorder_for_cp(pos, cu_seqlens_padded, layout, seq_dim=seq_dim)


def _physical_position_ids(cu_seqlens_padded, total_tokens):
  xp = _xp(cu_seqlens_padded)
  validation.check_cu_seqlens_padded(cu_seqlens_padded, total_tokens)
  cuP = xp.asarray(cu_seqlens_padded).astype(xp.int32)
  if total_tokens is None:
    if xp is jnp and isinstance(cu_seqlens_padded, jax.core.Tracer):
      raise ValueError("total_tokens must be given when cu_seqlens_padded "
                       "is traced")
    total_tokens = int(np.asarray(cu_seqlens_padded)[..., -1].flat[0])

  def one_row(row):
    t = xp.arange(total_tokens, dtype=xp.int32)
    b = xp.clip(xp.searchsorted(row, t, side="right") - 1, 0,
                row.shape[0] - 2)
    return (t - row[b]).astype(xp.int32)

  if cuP.ndim == 1:
    return one_row(cuP)
  if xp is jnp:
    return jax.vmap(one_row)(cuP)
  return np.stack([one_row(r) for r in cuP])


__all__: Sequence[str] = (
    "get_partition_indices", "get_batch_on_this_cp_rank", "reorder_for_cp",
    "restore_from_cp", "get_position_ids", "longest_padded_document")
