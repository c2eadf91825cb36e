"""Context-parallel attention over packed THD rows: the public API.

Two entry points:

* :func:`cp_attention_local` runs *inside* the caller's ``shard_map`` on the
  local chunk of every tensor (``[Tl, H, D]`` or ``[B, Tl, H, D]``).
* :func:`cp_attention` is the global view: it takes arrays whose token axis
  is sharded over the cp mesh axis (in :func:`jax_cp.reorder_for_cp` layout),
  places them in the sharding the ``shard_map`` expects and opens it on the
  given or the context mesh.

Both validate their arguments and build one :class:`~jax_cp.cp_config.CPConfig`
(:func:`~jax_cp.cp_config.make_config`) before any tracing of the per-rank
work, which lives in :mod:`jax_cp.cp_vjp` (the ``custom_vjp``), planned by
:mod:`jax_cp.call_plan`. docs/design.md describes the strategies, the call
plans and the exchange.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp import checks, seqlen_guard
from jax_cp.cp_config import CPConfig, make_config
from jax_cp.cp_vjp import cp_attention_vjp
from jax_cp.layout import CPBatch, CPLayout, unpack_metadata


def _as_batched(q, k, v, cu, cuP):
  if q.ndim == 4:
    return q, k, v, cu, cuP, False
  return q[None], k[None], v[None], cu[None], cuP[None], True


def cp_attention_local(q, k, v, cu_seqlens, cu_seqlens_padded=None, *,
                       layout: CPLayout | None = None,
                       attn_mask_type: str = "causal",
                       softmax_scale: float | None = None,
                       window_size=None,
                       split_causal_backward: bool | None = None,
                       dcs_window_plan: str = "split",
                       **layout_kwargs):
  """CP attention on this rank's chunk, inside the caller's ``shard_map``.

  Args:
    q: local queries ``[Tl, Hq, D]`` or ``[B, Tl, Hq, D]`` (``Tl = T/cp``), in
      the layout of :func:`jax_cp.get_batch_on_this_cp_rank` with the same
      :class:`jax_cp.CPLayout`.
    k, v: local keys/values ``[.., Tl, Hkv, D]``, ``Hq % Hkv == 0``.
    cu_seqlens, cu_seqlens_padded: the *global* row metadata ``[N+1]`` or
      ``[B, N+1]`` (replicated over the cp axis; may be traced). Or a
      :class:`jax_cp.CPBatch` in place of ``cu_seqlens`` (and no
      ``cu_seqlens_padded``): its metadata, its layout checked against
      ``layout`` (and used when ``layout`` is not given).
    layout: the :class:`jax_cp.CPLayout`: ``cp_axis`` (``None``: no CP),
      strategy, ``comm_type`` (``"all_gather"``, or ``"local_copies"``: the
      same exchange with every collective replaced by a local copy of the
      same shape, no communication, wrong results for cp > 1, to time a
      step without its communication), ``backend`` (``"auto"``,
      ``"cudnn"``, ``"xla"``) and ``max_seqlen`` (static bound on every
      padded document length, None = T; kernels size their grids by it and
      NO_LOAD_BALANCE exchanges only the ``max_seqlen - 1`` tokens before
      each chunk; concrete metadata with a longer document raises
      ``ValueError``, traced metadata is checked in the step, as the
      layout's ``max_seqlen_violation`` says: ``"fallback"``, the default,
      runs a step that breaks the bound as with ``max_seqlen=None``, right
      and slower, chosen in-graph by a ``lax.cond`` on the metadata (none
      where the bounded program is exact anyway, e.g. DUAL_CHUNK_SWAP on
      the xla backend); ``"error"``, a ``jax.experimental.checkify`` check
      (wrap the step in ``checkify.checkify``; JAX's checkify fails while
      tracing where an error would flow into a later ``shard_map``, see the
      README); ``"checked_on_host"``, no ``cond`` (on GPU each ``cond`` makes
      the host wait for the device; a broken bound still makes the outputs
      NaN, :func:`jax_cp.seqlen_guard.poison`) for a pipeline
      that checks its batches on the host, as
      :func:`jax_cp.make_global_batch` does).
    attn_mask_type: ``"causal"`` or ``"no_mask"`` (DUAL_CHUNK_SWAP only).
    softmax_scale: defaults to ``1/sqrt(D)``.
    window_size: ``None``/``(-1, 0)`` (plain causal) or a causal sliding
      window ``(left, 0)``, ``left >= 0``: a query at document position
      ``i`` sees keys ``[i - left, i]``. Both strategies; NO_LOAD_BALANCE
      then receives only ``min(left, max_seqlen - 1)`` halo tokens through
      ``ppermute`` (with or without ``max_seqlen``), DUAL_CHUNK_SWAP still
      all-gathers (docs/design.md, Sliding window).
    split_causal_backward: run the backward of DUAL_CHUNK_SWAP's
      bottom-right causal blocks as an unmasked rectangle plus a top-left
      triangle (faster with cuDNN 9.19 for large blocks; never with a
      sliding window). Default: on for cudnn, off otherwise. Same result
      either way. NO_LOAD_BALANCE runs no bottom-right call: its
      straddling document is always split where the chunk starts.
    dcs_window_plan: DUAL_CHUNK_SWAP's calls with a window (docs/design.md,
      Call plans): ``"split"`` (default: a top-left band per chunk, and
      unmasked and top-left calls over compact buffers of the keys before
      it, each way), ``"split_backward"``
      (the forward as one banded bottom-right call) or ``"bottom_right"``
      (banded bottom-right calls each way, whose cuDNN 9.19 backward is
      about 11x slower: warns on cudnn). Same result each way; for
      measurements.
    **layout_kwargs: the keyword form of ``layout``, exclusive with it:
      ``cp_axis`` (default ``"cp"``), ``load_balancing_strategy``,
      ``cp_comm_type``, ``backend``, ``max_seqlen``,
      ``max_seqlen_violation``, ``cp_size``.

  Returns:
    The local output, shaped and typed like ``q``.

  Raises:
    ValueError: ``layout`` and keyword settings together, a batch laid out
      with another layout, or any input the checks of
      :func:`jax_cp.cp_config.make_config` reject.
  """
  layout, cu_seqlens, cu_seqlens_padded = _layout_and_metadata(
      "cp_attention_local", layout, layout_kwargs, cu_seqlens,
      cu_seqlens_padded)
  cp_axis = layout.cp_axis
  cp_size = 1 if cp_axis is None else _bound_axis_size(cp_axis)
  if layout.cp_size is not None and cp_size != layout.cp_size:
    raise ValueError(f"the layout's cp_size={layout.cp_size} disagrees with "
                     f"the size {cp_size} of axis {cp_axis!r} here")
  cfg = _config(layout, q, k, v, cu_seqlens, cu_seqlens_padded, cp_size,
                total_tokens=q.shape[-3] * cp_size,
                attn_mask_type=attn_mask_type, softmax_scale=softmax_scale,
                window_size=window_size,
                split_causal_backward=split_causal_backward,
                dcs_window_plan=dcs_window_plan)
  return _run_local(cfg, q, k, v, cu_seqlens, cu_seqlens_padded)


def _config(layout: CPLayout, q, k, v, cu_seqlens, cu_seqlens_padded,
            cp_size: int, *, total_tokens: int, attn_mask_type: str,
            softmax_scale: float | None, window_size,
            split_causal_backward: bool | None,
            dcs_window_plan: str = "split",
            platform: str | None = None) -> CPConfig:
  """The validated config of one call: the layout's settings plus the
  call's own (mask, scale, window, backward split, windowed plan)."""
  checks.check_qkv_dtypes(q.dtype, k.dtype, v.dtype)
  return make_config(
      q.shape, k.shape, v.shape, q.dtype, cu_seqlens, cu_seqlens_padded,
      cp_size=cp_size, cp_axis=layout.cp_axis,
      load_balancing_strategy=layout.strategy,
      cp_comm_type=layout.comm_type, attn_mask_type=attn_mask_type,
      softmax_scale=softmax_scale, backend=layout.backend,
      max_seqlen=layout.max_seqlen, window_size=window_size,
      split_causal_backward=split_causal_backward,
      total_tokens=total_tokens, platform=platform,
      max_seqlen_violation=layout.max_seqlen_violation,
      dcs_window_plan=dcs_window_plan)


def _layout_and_metadata(what, layout, layout_kwargs, cu_seqlens,
                         cu_seqlens_padded):
  """The call's layout (given, built from the keywords, or the batch's) and
  its row metadata (arrays, or those of a :class:`CPBatch`)."""
  if isinstance(cu_seqlens, CPBatch) and layout is None and not layout_kwargs:
    layout = cu_seqlens.layout
  layout = CPLayout.build(layout, what, **layout_kwargs)
  cu, cuP = unpack_metadata(cu_seqlens, cu_seqlens_padded, layout, what)
  return layout.for_batch(cu_seqlens), cu, cuP


def _bound_axis_size(cp_axis: str) -> int:
  try:
    return int(jax.lax.axis_size(cp_axis))
  except NameError:
    raise ValueError(
        f"cp_axis={cp_axis!r} is not bound: cp_attention_local runs inside a "
        "jax.shard_map over a mesh that has this axis (cp_attention is the "
        "global view)") from None


def _run_local(cfg: CPConfig, q, k, v, cu_seqlens, cu_seqlens_padded):
  """The per-rank attention on local arrays, with a validated config."""
  q4, k4, v4, cu, cuP, squeeze = _as_batched(
      q, k, v, jnp.asarray(cu_seqlens, jnp.int32),
      jnp.asarray(cu_seqlens_padded, jnp.int32))
  # Inside the shard_map: checkify carries an error from one such
  # shard_map into the next (a layer after this one), not one raised
  # outside into it.
  seqlen_guard.check(cfg, cuP)
  k4, v4 = seqlen_guard.poison(cfg, cuP, k4, v4)
  out = cp_attention_vjp(q4, k4, v4, cu, cuP, cfg)
  return out[0] if squeeze else out


def resolve_mesh(mesh):
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("cp_attention needs a mesh: pass mesh=... or set one "
                       "with `with jax.set_mesh(mesh):`")
  return mesh


def _platform(mesh) -> str | None:
  """The platform of the mesh's devices ("cpu", "gpu", ...), if known."""
  try:
    return mesh.devices.flat[0].platform
  except Exception:  # pylint: disable=broad-except  (an AbstractMesh)
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)


def cp_attention(q, k, v, cu_seqlens, cu_seqlens_padded=None, *,
                 layout: CPLayout | None = None,
                 attn_mask_type: str = "causal",
                 softmax_scale: float | None = None,
                 window_size=None,
                 split_causal_backward: bool | None = None,
                 dcs_window_plan: str = "split",
                 **layout_kwargs):
  """CP attention, global view: ``jit``-friendly over sharded arrays.

  Args:
    q: ``[T, Hq, D]`` or ``[B, T, Hq, D]`` in :func:`jax_cp.reorder_for_cp`
      layout (same :class:`jax_cp.CPLayout`), token axis sharded over
      ``cp_axis``.
    k, v: ``[.., T, Hkv, D]``, same layout.
    cu_seqlens, cu_seqlens_padded: ``[N+1]`` or ``[B, N+1]`` int metadata of
      the rows in physical order (not reordered); or a
      :class:`jax_cp.CPBatch` in place of ``cu_seqlens``.
    layout: the :class:`jax_cp.CPLayout`: its ``mesh`` (``None`` takes the
      context mesh, ``jax.set_mesh``), ``cp_axis``, ``batch_axis`` (the
      batch dim sharded over it, data parallel; needs 4-D inputs),
      ``head_axis`` (heads sharded over it, tensor parallel; needs ``Hkv``
      divisible by its size), strategy, exchange, backend, ``max_seqlen``.
    **layout_kwargs: its keyword form, exclusive with ``layout``: ``mesh``,
      ``cp_axis`` (default ``"cp"``), ``batch_axis``, ``head_axis``,
      ``load_balancing_strategy``, ``cp_comm_type``, ``backend``,
      ``max_seqlen``, ``max_seqlen_violation``.
    The other arguments are those of :func:`cp_attention_local`.

  Returns:
    The output, same shape, dtype and layout as ``q``. Differentiable in
    q, k, v.
  """
  layout, cu_seqlens, cu_seqlens_padded = _layout_and_metadata(
      "cp_attention", layout, layout_kwargs, cu_seqlens, cu_seqlens_padded)
  if layout.cp_axis is None:
    raise ValueError("cp_attention needs a cp_axis; attention without CP is "
                     "cp_attention_local with cp_axis=None")
  if layout.view == "local":
    raise ValueError("cp_attention is the global view; a layout with "
                     "view='local' goes to cp_attention_local inside your "
                     "shard_map")
  mesh = resolve_mesh(layout.mesh)
  cp_axis, batch_axis, head_axis = (layout.cp_axis, layout.batch_axis,
                                    layout.head_axis)
  checks.check_mesh_axis(mesh, cp_axis, "cp_axis")
  batch_axes = layout.batch_axes
  if layout.cp_size is not None and layout.cp_size != mesh.shape[cp_axis]:
    raise ValueError(f"the layout's cp_size={layout.cp_size} disagrees with "
                     f"the mesh, whose axis {cp_axis!r} has size "
                     f"{mesh.shape[cp_axis]}")
  for ax in batch_axes:
    checks.check_mesh_axis(mesh, ax, "batch_axis")
  checks.check_mesh_axis(mesh, head_axis, "head_axis")
  checks.check_batch_axis_rank(batch_axis if batch_axes else None, q.shape)
  # Validated once, on the global shapes; the shard_map body reuses it.
  cfg = _config(layout, q, k, v, cu_seqlens, cu_seqlens_padded,
                mesh.shape[cp_axis], total_tokens=q.shape[-3],
                attn_mask_type=attn_mask_type, softmax_scale=softmax_scale,
                window_size=window_size,
                split_causal_backward=split_causal_backward,
                dcs_window_plan=dcs_window_plan,
                platform=_platform(mesh))
  if head_axis is not None:
    checks.check_head_axis_divides(head_axis, mesh.shape[head_axis], q.shape,
                                   k.shape)
  x_spec, m_spec = specs(q.ndim, batch_axes, cp_axis, head_axis)
  args = [place(x, mesh, spec) for x, spec in (
      (q, x_spec), (k, x_spec), (v, x_spec),
      (jnp.asarray(cu_seqlens, jnp.int32), m_spec),
      (jnp.asarray(cu_seqlens_padded, jnp.int32), m_spec))]
  return jax.shard_map(functools.partial(_run_local, cfg), mesh=mesh,
                       in_specs=(x_spec, x_spec, x_spec, m_spec, m_spec),
                       out_specs=x_spec, check_vma=False)(*args)


def specs(ndim: int, batch_axes, cp_axis: str, head_axis: str | None):
  """The ``PartitionSpec`` of q/k/v and of the row metadata."""
  bspec = None
  if batch_axes:
    bspec = batch_axes if len(batch_axes) > 1 else batch_axes[0]
  if ndim == 4:
    return P(bspec, cp_axis, head_axis, None), P(bspec, None)
  return P(cp_axis, head_axis, None), P(None)


def place(x, mesh, spec):
  """Puts ``x`` in the sharding ``shard_map`` expects: ``jax.reshard`` on
  meshes with Explicit axes (it checks types), a sharding constraint on
  Auto ones (a no-op when already so)."""
  sharding = NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
  explicit = any(t == AxisType.Explicit
                 for t in getattr(mesh, "axis_types", ()))
  if explicit:
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)
