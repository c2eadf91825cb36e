"""Context-parallel settings shared by the linen modules of ``jax_cp.flax``.

Every module of this package declares the same static CP fields (listed in
:data:`CP_FIELDS`). A parent hands *all* of them to its children through
:func:`cp_settings`, so a setting chosen once on the outermost module reaches
:func:`jax_cp.cp_attention` unchanged; a child never falls back to its own
default when a parent set a value.

This module also holds the input checks that run at trace time, before any
projection or attention kernel.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import numpy as np

from jax_cp import checks
from jax_cp.strategy import CPLoadBalancingStrategy, as_strategy

# The static CP fields every module of ``jax_cp.flax`` declares.
CP_FIELDS: Tuple[str, ...] = (
    "cp_axis", "cp_strategy", "cp_comm_type", "attn_backend", "max_seqlen",
    "mesh", "batch_axis", "local_view")

# Int codes ``DotProductAttention`` sows into "intermediates" (strings cannot
# be sown): the position of the strategy in the enum.
STRATEGY_CODES: Dict[CPLoadBalancingStrategy, int] = {
    s: i for i, s in enumerate(CPLoadBalancingStrategy)}


def strategy_from_code(code: Any) -> CPLoadBalancingStrategy:
  """Inverse of :data:`STRATEGY_CODES` (accepts a sown array)."""
  return list(CPLoadBalancingStrategy)[int(np.asarray(code).reshape(-1)[0])]


def strategy_of(module) -> CPLoadBalancingStrategy:
  """The module's ``cp_strategy`` as the enum (strings converted)."""
  return as_strategy(module.cp_strategy, "cp_strategy")


def cp_settings(module) -> Dict[str, Any]:
  """All CP fields of ``module`` as keyword arguments for a child module
  (the strategy already converted to the enum)."""
  out = {name: getattr(module, name) for name in CP_FIELDS}
  out["cp_strategy"] = strategy_of(module)
  return out


def validate_fields(module) -> None:
  """Checks the static CP fields at construction time.

  Raises:
    ValueError: unknown ``cp_strategy`` string, unsupported ``cp_comm_type``,
      a bad ``max_seqlen``, ``local_view=True`` without ``cp_axis``...
  """
  strategy_of(module)
  if module.cp_comm_type not in checks.CP_COMM_TYPES:
    raise ValueError(f"cp_comm_type={module.cp_comm_type!r} is not supported; "
                     f"jax_cp implements {list(checks.CP_COMM_TYPES)}")
  if module.cp_axis is not None and not isinstance(module.cp_axis, str):
    raise ValueError(f"cp_axis must be a mesh axis name or None, got "
                     f"{module.cp_axis!r}")
  if not isinstance(module.attn_backend, str):
    raise ValueError(f"attn_backend must be a string, got "
                     f"{module.attn_backend!r}")
  w = module.max_seqlen
  if w is not None and (isinstance(w, bool) or not isinstance(
      w, (int, np.integer)) or w < 1):
    raise ValueError(f"max_seqlen must be None or a positive int, got {w!r}")


def _batch_axes(batch_axis) -> Tuple[str, ...]:
  if batch_axis is None:
    return ()
  return (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis)


def _context_mesh(module):
  if module.mesh is not None:
    return module.mesh
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    raise ValueError(
        f"cp_axis={module.cp_axis!r} with local_view=False needs a mesh: set "
        "the module's `mesh` field or call it under `with jax.set_mesh(mesh):`"
        " (or set local_view=True inside your own shard_map)")
  return mesh


def cp_size_of(module) -> int:
  """The size of the module's cp axis (1 without CP), checking that the axis
  exists where the module runs.

  Raises:
    ValueError: ``cp_axis`` (or ``batch_axis``) is not an axis of the mesh
      (global view), or not bound by an enclosing ``shard_map`` (local view).
  """
  if module.cp_axis is None:
    return 1
  if module.local_view:
    try:
      return int(jax.lax.axis_size(module.cp_axis))
    except NameError:
      raise ValueError(
          f"cp_axis={module.cp_axis!r} is not bound: a module with "
          "local_view=True must be called inside a jax.shard_map over a mesh "
          "that has this axis") from None
  mesh = _context_mesh(module)
  checks.check_mesh_axis(mesh, module.cp_axis, "cp_axis")
  for ax in _batch_axes(module.batch_axis):
    checks.check_mesh_axis(mesh, ax, "batch_axis")
  return int(mesh.shape[module.cp_axis])


def check_tokens(module, n_tokens: int, cu_seqlens_padded,
                 argname: str) -> int:
  """Checks that ``n_tokens`` (the module's token axis) fits the global row
  metadata and returns the cp size.

  Global view (and no CP): ``n_tokens`` is the whole row and must equal
  ``cu_seqlens_padded[..., -1]``. Local view: ``n_tokens`` is this rank's
  chunk and ``n_tokens * cp_size`` must. Values are compared only when the
  metadata is concrete; shapes are always checked.

  Raises:
    ValueError: naming ``cu_seqlens_padded`` (length mismatch), ``cp_axis``
      or ``batch_axis`` (not on the mesh).
  """
  cp = cp_size_of(module)
  if np.ndim(cu_seqlens_padded) not in (1, 2):
    raise ValueError(f"cu_seqlens_padded must be [N+1] or [B, N+1], got shape "
                     f"{np.shape(cu_seqlens_padded)}")
  local = module.local_view and module.cp_axis is not None
  total = n_tokens * cp if local else n_tokens
  cuP = checks.concrete(cu_seqlens_padded)
  if cuP is not None and cuP.size:
    ends = np.unique(cuP.reshape(-1, cuP.shape[-1])[:, -1])
    if ends.size != 1 or int(ends[0]) != total:
      if local:
        what = (f"{argname} has {n_tokens} tokens per rank, i.e. "
                f"{n_tokens} x cp_size {cp} = {total} in the row")
      else:
        what = f"{argname} has {total} tokens"
      raise ValueError(
          f"{what}, but cu_seqlens_padded[..., -1] is {ends.tolist()}: the "
          "token count must equal the padded row length "
          f"(local_view={module.local_view}, cp_axis={module.cp_axis!r})")
  return cp


def check_position_ids(position_ids, x_shape, argname: str = "x") -> None:
  if position_ids is not None and tuple(np.shape(position_ids)) != tuple(
      x_shape[:-1]):
    raise ValueError(f"position_ids must have the shape of {argname} without "
                     f"its feature dim, {tuple(x_shape[:-1])}; got "
                     f"{tuple(np.shape(position_ids))}")

