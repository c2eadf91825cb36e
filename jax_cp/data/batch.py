"""Per-process loading of packed THD batches into global CP-sharded arrays.

Under JAX's multi-controller runtime (``jax.distributed.initialize``, one
process per host) every process feeds only the devices it owns.
:func:`make_global_batch` takes *this process's* packed rows, slices each
row on the host for the cp rank of each of its devices with
:func:`jax_cp.data.get_batch_on_this_cp_rank`, and assembles global
``jax.Array`` s whose token axis is in :func:`jax_cp.data.reorder_for_cp`
layout,
sharded over the cp mesh axis (and the batch over the batch axes). Nothing a
process does touches another process's rows, and a device only ever
receives its own tokens.

Which rows a process loads (:func:`process_batch_rows`): with the batch dim
sharded over ``batch_axis`` (one axis or a tuple of axes, ``n`` shards in
all), global row ``i`` lives in batch shard ``i // (B // n)``. A process must
pass the rows of every batch shard that any of its devices holds, in
increasing global row order, *whole* (all ``T`` tokens: the host slices
them per cp rank, so when the cp axis spans processes each of them reads the
full rows but sends only its own cp chunks to its devices). With
``batch_axis=None`` every process passes all rows.

Single process, the result equals ``jax.device_put(reorder_for_cp(x, ...),
NamedSharding(mesh, P(batch_axis, cp_axis)))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp.cp import validation
from jax_cp.cp.layout import CPBatch, CPLayout, check_layout
from jax_cp.cp.partition import (
  check_max_seqlen_bound,
  get_batch_on_this_cp_rank,
  token_dim,
)
from jax_cp.typing import ArrayLike

AxisNames = str | Sequence[str] | None


# ------------------------------------------------------------------ helpers


def _batch_axes(mesh, batch_axis: AxisNames,
                cp_axis: str | None = None) -> tuple[str, ...]:
  axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(
      batch_axis or ())
  for ax in axes:
    validation.check_mesh_axis(mesh, ax, "batch_axis")
  cp_axes = (cp_axis,) if isinstance(cp_axis, str) else tuple(cp_axis or ())
  if set(cp_axes) & set(axes):
    raise ValueError(f"cp_axis={cp_axis!r} cannot also be a batch axis "
                     f"(batch_axis={batch_axis!r})")
  if len(set(axes)) != len(axes):
    raise ValueError(f"batch_axis={batch_axis!r} names an axis twice")
  return axes


def _batch_entry(axes: tuple[str, ...]):
  """The PartitionSpec entry of the batch dim."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _local_batch_shards(mesh, axes: tuple[str, ...],
                        process_index: int | None) -> tuple[list, int]:
  """Sorted indices of the batch shards held by a process's devices, and
  the number of batch shards."""
  n = math.prod(mesh.shape[a] for a in axes)
  pid = jax.process_index() if process_index is None else int(process_index)
  sharding = NamedSharding(mesh, P(_batch_entry(axes)))
  held = sorted({idx[0].indices(n)[0]
                 for d, idx in sharding.devices_indices_map((n,)).items()
                 if d.process_index == pid})
  if not held:
    raise ValueError(f"process {pid} owns no device of the mesh "
                     f"{dict(mesh.shape)}; every process must own some")
  return held, n


def _rows_of_shards(shards, n_shards: int, global_batch: int) -> np.ndarray:
  per = global_batch // n_shards
  return np.concatenate([np.arange(s * per, (s + 1) * per) for s in shards]
                        ).astype(np.int64)


def process_batch_rows(layout: CPLayout, global_batch: int, *,
                       process_index: int | None = None) -> np.ndarray:
  """The global row indices a process must load and pass, in order.

  Args:
    layout: the :class:`jax_cp.CPLayout` the batch will be in: its mesh
      (a ``jax.sharding.Mesh``) and ``batch_axis`` (None: replicated, every
      process loads every row).
    global_batch: ``B``, the number of packed rows of the global batch.
    process_index: which process (default: this one, ``jax.process_index()``).
      Useful to plan the reads of every process from one place.

  Returns:
    int64 ``[B_local]``, sorted: the rows of every batch shard that any of
    the process's devices holds. Pass ``rows[these]`` to
    :func:`make_global_batch`.

  Raises:
    ValueError: ``global_batch`` is not divisible by the number of batch
      shards, the layout has no mesh, or the process owns no device.
  """
  mesh, batch_axis = _layout_mesh(layout, "process_batch_rows")
  axes = _batch_axes(mesh, batch_axis)
  shards, n = _local_batch_shards(mesh, axes, process_index)
  if global_batch < 1 or global_batch % n:
    raise ValueError(
        f"global_batch={global_batch} must be a positive multiple of the "
        f"number of batch shards ({n}: batch_axis={batch_axis!r} over mesh "
        f"{dict(mesh.shape)})")
  return _rows_of_shards(shards, n, global_batch)


def _as_items(tensors) -> tuple[list, Any]:
  """(name, numpy array) pairs of a dict / tuple / list / single array, and
  a function rebuilding the caller's container from a list of values."""
  if isinstance(tensors, dict):
    keys = list(tensors)
    return ([(repr(k), np.asarray(tensors[k])) for k in keys],
            lambda vals: dict(zip(keys, vals)))
  if isinstance(tensors, (tuple, list)):
    kind = type(tensors)
    return ([(f"[{i}]", np.asarray(x)) for i, x in enumerate(tensors)],
            lambda vals: kind(vals))
  return [("", np.asarray(tensors))], lambda vals: vals[0]


def _local_batch_size(items, what: str) -> int:
  sizes = {x.shape[0] if x.ndim else None for _, x in items}
  if len(sizes) != 1 or None in sizes:
    shapes = {name: x.shape for name, x in items}
    raise ValueError(f"every {what} array needs the same leading (row) dim; "
                     f"got shapes {shapes}")
  return sizes.pop()


def _infer_global_batch(b_local: int, shards, n_shards: int,
                        global_batch_size: int | None, batch_axis) -> int:
  k = len(shards)
  expected = None
  if global_batch_size is not None:
    if global_batch_size % n_shards:
      raise ValueError(
          f"global_batch_size={global_batch_size} must be divisible by the "
          f"number of batch shards ({n_shards}, batch_axis={batch_axis!r})")
    expected = global_batch_size // n_shards * k
  if b_local % k or (expected is not None and b_local != expected):
    want = (f"{expected}" if expected is not None
            else f"a multiple of {k}")
    raise ValueError(
        f"this process (index {jax.process_index()}) passed {b_local} rows, "
        f"but its devices hold {k} of the {n_shards} batch shards "
        f"(batch_axis={batch_axis!r}), so it must pass {want} rows: those "
        f"of jax_cp.data.process_batch_rows(layout, B), in order")
  return b_local // k * n_shards


def _assemble(global_shape, sharding, local_of_device):
  """A global array from ``local_of_device(index) -> numpy`` per
  addressable device (``index``: the device's slices of the global array)."""
  cache: dict[Any, np.ndarray] = {}
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(
      global_shape).items():
    key = tuple(s.indices(n) for s, n in zip(index, global_shape))
    if key not in cache:
      cache[key] = local_of_device(index)
    arrays.append(jax.device_put(cache[key], device))
  return jax.make_array_from_single_device_arrays(global_shape, sharding,
                                                  arrays)


def _row_locator(rows: np.ndarray):
  """Global row slice -> slice of this process's local rows."""
  def locate(sl: slice, global_batch: int) -> slice:
    start, stop, _ = sl.indices(global_batch)
    lo = int(np.searchsorted(rows, start))
    if stop - start and (lo + stop - start > len(rows)
                         or rows[lo] != start
                         or rows[lo + stop - start - 1] != stop - 1):
      raise AssertionError(f"rows [{start}, {stop}) are not local")
    return slice(lo, lo + stop - start)
  return locate


def _layout_mesh(layout: CPLayout, what: str):
  """``(mesh, batch_axis)`` of a layout that must have a mesh."""
  layout = check_layout(layout, what)
  if not isinstance(layout.mesh, jax.sharding.Mesh):
    raise ValueError(f"{what} needs the layout's mesh, a jax.sharding.Mesh "
                     f"(got {layout.mesh!r})")
  return layout.mesh, layout.batch_axis


def make_global_metadata(local_meta: Any, layout: CPLayout, *,
                         global_batch_size: int | None = None) -> Any:
  """Assembles per-row arrays (``cu_seqlens``, ...) of this process's rows
  into global arrays sharded over the batch axes, replicated elsewhere.

  Args:
    local_meta: one array or a dict / tuple of arrays ``[B_local, ...]`` for
      the rows of :func:`process_batch_rows`, in that order.
    layout: the :class:`jax_cp.CPLayout`: its mesh and batch axes.
    global_batch_size: optional ``B``; when given, ``B_local`` is checked
      against it.

  Returns:
    Global arrays ``[B, ...]`` in the container of ``local_meta``.
  """
  mesh, batch_axis = _layout_mesh(layout, "make_global_metadata")
  axes = _batch_axes(mesh, batch_axis)
  items, rebuild = _as_items(local_meta)
  b_local = _local_batch_size(items, "metadata")
  shards, n = _local_batch_shards(mesh, axes, None)
  b = _infer_global_batch(b_local, shards, n, global_batch_size, batch_axis)
  locate = _row_locator(_rows_of_shards(shards, n, b))
  out = []
  for _, x in items:
    shape = (b,) + x.shape[1:]
    sharding = NamedSharding(mesh, P(_batch_entry(axes)))
    out.append(_assemble(shape, sharding,
                         lambda idx, x=x: x[locate(idx[0], b)]))
  return rebuild(out)


# ------------------------------------------------------------------ the API


def _check_tokens(items, cuP: np.ndarray, seq_dim: int, batched: bool):
  if not np.issubdtype(cuP.dtype, np.integer):
    raise ValueError(f"cu_seqlens_padded must hold integers, got {cuP.dtype}")
  if batched and seq_dim < 1:
    raise ValueError(f"with rows [B_local, T, ...] and cu_seqlens_padded "
                     f"[B_local, N+1], seq_dim must be >= 1, got {seq_dim}")
  for name, x in items:
    if x.ndim <= seq_dim:
      raise ValueError(f"local_rows{name} has shape {x.shape}: no token dim "
                       f"seq_dim={seq_dim} (the default is 1 for rows "
                       "[B_local, T, ...] with metadata [B_local, N+1], 0 "
                       "for [T, ...] with [N+1])")
    if batched and x.shape[0] != cuP.shape[0]:
      raise ValueError(
          f"local_rows{name} has {x.shape[0]} rows but cu_seqlens_padded "
          f"has {cuP.shape[0]}: pass the metadata of exactly these rows")
  totals = {x.shape[seq_dim] for _, x in items}
  if len(totals) > 1:
    raise ValueError(f"the arrays have different token counts along "
                     f"seq_dim={seq_dim}: "
                     f"{ {name: x.shape[seq_dim] for name, x in items} }")
  total = totals.pop()
  try:
    validation.check_cu_seqlens_padded(cuP, total)
  except ValueError as e:
    raise ValueError(f"local rows of {total} tokens along seq_dim={seq_dim} "
                     f"do not match their metadata: {e}") from None
  return total


def make_global_batch(local_rows: Any, cu_seqlens_padded: ArrayLike,
                      layout: CPLayout, *,
                      cu_seqlens: ArrayLike | None = None,
                      seq_dim: int | None = None,
                      global_batch_size: int | None = None) -> CPBatch:
  """Global CP-sharded arrays from this process's packed rows.

  Without CP (a layout with ``cp_axis=None``) the rows stay whole and in
  physical order: sharded over the batch axes of the layout's mesh (data
  parallel), or without a mesh put whole on this process's first device
  (``jax.local_devices()[0]``), e.g. for a model evaluated on one device.

  For each device this process owns, the device's batch shard and cp rank
  are read from the mesh; its tokens are cut from the local rows on the host
  with :func:`jax_cp.data.get_batch_on_this_cp_rank` and put on it; the pieces
  form global arrays with ``jax.make_array_from_single_device_arrays``.

  Args:
    local_rows: one array or a dict / tuple / list of arrays (``input_ids``,
      ``labels``, ``position_ids``, ...), numpy (host) ``[B_local, T, ...]``:
      the whole rows listed by :func:`process_batch_rows` (the rows of every
      batch shard any of this process's devices holds, increasing global row
      order). With 1-D metadata ``[N+1]`` (no batch dim), ``[T, ...]``
      arrays; the layout's ``batch_axis`` must then be ``None``.
    cu_seqlens_padded: int ``[B_local, N+1]``: the metadata of those rows,
      in physical order (never reordered).
    layout: the :class:`jax_cp.CPLayout`, with its ``mesh`` (a
      ``jax.sharding.Mesh``, Explicit or Auto axes, spanning the devices of
      every process; optional without CP), ``cp_axis`` (``None``: no CP),
      ``batch_axis`` (``None`` replicates the rows over every non-cp axis),
      strategy and ``max_seqlen`` (checked here against the longest
      document; slots that hold no token, such as the padding after a
      row's last document, never count when ``cu_seqlens`` is given:
      :func:`jax_cp.cp.validation.document_spans`).
    cu_seqlens: optional int ``[B_local, N+1]``, the valid-length metadata of
      the same rows; checked here against ``cu_seqlens_padded`` (same shape,
      starts at 0, no document longer than its padded slot; in
      multi-process runs ``cp_attention`` sees only the global, sharded
      metadata and cannot check the values) and assembled into the batch.
      Attention needs it.
    seq_dim: the token dim of the arrays; default (None): 1 with batched
      metadata (``[B_local, T, ...]``), 0 with ``[N+1]`` (``[T, ...]``), as
      every data function that takes ``seq_dim``.
    global_batch_size: optional ``B``; when given the number of local rows is
      checked against it (without it ``B`` is inferred from ``B_local``, which
      cannot catch a process passing the rows of other processes too).

  Returns:
    A :class:`jax_cp.CPBatch`: the arrays ``[B, T, ...]`` in
    :func:`jax_cp.data.reorder_for_cp` layout with sharding ``P(batch_axis,
    cp_axis)`` on ``(0, seq_dim)`` (without CP: in physical order,
    ``P(batch_axis)``), in the container of ``local_rows``; the
    int32 metadata ``[B, N+1]`` (``cu_seqlens_padded``, and ``cu_seqlens``
    when given), sharded over ``batch_axis``, replicated over the cp axis;
    and the layout. Pass the batch to the attention and the modules: they
    check that their layout matches it. With a ``max_seqlen``, the batch
    records that its metadata were checked against it
    (``checked_max_seqlen``), so attention given it compiles no fallback
    branch even under ``jit`` (:class:`jax_cp.CPBatch`).

  Raises:
    ValueError: the row count is not what this process's devices hold, a
      token length differs from ``cu_seqlens_padded[..., -1]``, the layout
      breaks the strategy's rules (``T % cp``, DUAL_CHUNK_SWAP's ``2*cp``
      divisibility), ``max_seqlen`` is exceeded, ``cu_seqlens`` disagrees
      with ``cu_seqlens_padded``, an axis is unknown, or a layout with CP
      (or with a ``batch_axis``) has no mesh.
  """
  layout = check_layout(layout, "make_global_batch")
  mesh, cp_axis, batch_axis = layout.mesh, layout.cp_axis, layout.batch_axis
  on_one_device = mesh is None and cp_axis is None
  if on_one_device and batch_axis is not None:
    raise ValueError(f"make_global_batch: batch_axis={batch_axis!r} needs "
                     "the layout's mesh")
  if not on_one_device and not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError("make_global_batch needs the layout's mesh, a "
                     f"jax.sharding.Mesh (got {mesh!r})")
  max_seqlen = layout.max_seqlen
  for ax in layout.cp_axes:
    validation.check_mesh_axis(mesh, ax, "cp_axis")
  axes = () if on_one_device else _batch_axes(mesh, batch_axis, cp_axis)
  cp = math.prod(mesh.shape[ax] for ax in layout.cp_axes)
  items, rebuild = _as_items(local_rows)
  if not items:
    raise ValueError("local_rows holds no arrays")
  cuP = np.asarray(cu_seqlens_padded)
  if cuP.ndim not in (1, 2):
    raise ValueError(f"cu_seqlens_padded must be [B_local, N+1] (or [N+1] "
                     f"for unbatched rows), got shape {cuP.shape}")
  batched = cuP.ndim == 2
  if not batched and axes:
    raise ValueError(f"batch_axis={batch_axis!r} needs batched rows "
                     f"[B_local, T, ...] with cu_seqlens_padded [B_local, N+1]")
  seq_dim = token_dim(seq_dim, cuP)
  total = _check_tokens(items, cuP, seq_dim, batched)
  validation.check_divisible_tokens(total, cp)
  cu_host = None if cu_seqlens is None else np.asarray(cu_seqlens)
  if cu_host is not None:
    validation.check_cu_seqlens(cu_host, cuP)
  if max_seqlen is not None:
    check_max_seqlen_bound(cuP, max_seqlen, cu_host, layout)
  local_tokens = total // cp

  shards, n = (([0], 1) if on_one_device
               else _local_batch_shards(mesh, axes, None))
  b = (_infer_global_batch(cuP.shape[0], shards, n, global_batch_size,
                           batch_axis) if batched else None)
  locate = _row_locator(_rows_of_shards(shards, n, b)) if batched else None

  def rank_of(index) -> int:
    start, stop, _ = index[seq_dim].indices(total)
    assert stop - start == local_tokens and start % local_tokens == 0
    return start // local_tokens

  slices: dict[Any, tuple[np.ndarray, ...]] = {}

  def local_slices(index):
    """All tensors' pieces for one (row range, cp rank): computed once."""
    rows = locate(index[0], b) if batched else slice(None)
    key = (rows.start, rows.stop, rank_of(index))
    if key not in slices:
      slices[key] = (tuple(x[rows] for _, x in items) if cp_axis is None
                     else get_batch_on_this_cp_rank(
                         cuP[rows], *(x[rows] for _, x in items),
                         cp_rank=key[2], layout=layout, seq_dim=seq_dim,
                         cu_seqlens=None if cu_host is None
                         else cu_host[rows]))
    return slices[key]

  def sharding_of(spec):
    if on_one_device:
      return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, spec)

  out = []
  for i, (_, x) in enumerate(items):
    shape = ((b,) + x.shape[1:]) if batched else x.shape
    spec = [None] * x.ndim
    if batched:
      spec[0] = _batch_entry(axes)
    spec[seq_dim] = cp_axis
    out.append(_assemble(shape, sharding_of(P(*spec)),
                         lambda idx, i=i: local_slices(idx)[i]))
  meta_spec = P(_batch_entry(axes), None) if batched else P(None)
  meta_shape = (b, cuP.shape[1]) if batched else cuP.shape
  def global_meta(host):
    return _assemble(meta_shape, sharding_of(meta_spec),
                     lambda idx: host.astype(np.int32)[
                         locate(idx[0], b) if batched else slice(None)])

  return CPBatch(
      tensors=rebuild(out), cu_seqlens_padded=global_meta(cuP),
      cu_seqlens=(None if cu_seqlens is None
                  else global_meta(np.asarray(cu_seqlens))),
      layout=layout, checked_max_seqlen=max_seqlen, total_tokens=total)


__all__: Sequence[str] = ("make_global_batch",
                          "make_global_metadata", "process_batch_rows")
