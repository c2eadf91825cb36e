"""The checks and calls every module runs, in Linen and NNX alike: the
layout and the metadata of a call, the token count, the position ids,
rotary embedding of queries and keys, and the attention call.
Framework-neutral: nothing here imports Flax.

Every module holds one static ``layout`` field, a :class:`jax_cp.CPLayout`
(``None``: no CP). A parent hands its layout to its children, so a layout
chosen once on the outermost module reaches :func:`jax_cp.cp_attention`
unchanged. The checks here run before any projection or attention kernel.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_cp import checkpoint_names as names
from jax_cp.attention.validation import concrete
from jax_cp.cp import partition
from jax_cp.cp.api import cp_attention
from jax_cp.cp.layout import (
  NO_CP,
  CPBatch,
  CPLayout,
  check_layout,
  unpack_metadata,
)
from jax_cp.modules import rotary


def module_layout(layout: CPLayout | None) -> CPLayout:
  """A module's layout: ``layout`` checked, or without one
  :data:`jax_cp.cp.layout.NO_CP` (the whole row on one device).

  Raises:
    ValueError: ``layout`` is not a :class:`jax_cp.CPLayout`.
  """
  return NO_CP if layout is None else check_layout(layout, "the module")


def metadata(layout: CPLayout, cu_seqlens, cu_seqlens_padded, what: str
             ) -> tuple[Any, Any]:
  """``(cu_seqlens, cu_seqlens_padded)`` of a module call, from the arrays
  or from a :class:`jax_cp.CPBatch` (whose layout must match the module's).
  """
  return unpack_metadata(cu_seqlens, cu_seqlens_padded, layout, what)


def check_tokens(layout: CPLayout, n_tokens: int, cu_seqlens_padded,
                 argname: str, batch: Any = None) -> int:
  """Checks that ``n_tokens`` (the module's token axis) fits the global row
  metadata and returns the cp size.

  Global view (and no CP): ``n_tokens`` is the whole row and must equal
  ``cu_seqlens_padded[..., -1]``. Local view: ``n_tokens`` is this rank's
  chunk and ``n_tokens * cp_size`` must. Values are compared when the
  metadata is concrete; a :class:`jax_cp.CPBatch` given as ``batch``
  compares its static token count also under ``jit``
  (:meth:`jax_cp.CPBatch.check_tokens`); shapes are always checked.

  Raises:
    ValueError: naming ``cu_seqlens_padded`` (length mismatch), ``cp_axis``
      or ``batch_axis`` (not on the mesh, or not bound).
  """
  cp = layout.resolve_cp_size()
  if np.ndim(cu_seqlens_padded) not in (1, 2):
    raise ValueError(f"cu_seqlens_padded must be [N+1] or [B, N+1], got shape "
                     f"{np.shape(cu_seqlens_padded)}")
  total = n_tokens * cp if layout.is_local else n_tokens
  if isinstance(batch, CPBatch):
    batch.check_tokens(total, None, argname)
  cuP = concrete(cu_seqlens_padded)
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
  metadata (:func:`jax_cp.data.get_position_ids` with the layout)."""
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
  layout = module_layout(layout)
  batch = cu_seqlens
  cu_seqlens, cu_seqlens_padded = metadata(
      layout, cu_seqlens, cu_seqlens_padded, f"{what}'s batch")
  cp_size = check_tokens(layout, x_shape[-2], cu_seqlens_padded, "x", batch)
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
  return (checkpoint_name(q, names.QUERY_PROJ),
          checkpoint_name(k, names.KEY_PROJ),
          checkpoint_name(v, names.VALUE_PROJ))


def attend(layout: CPLayout, query, key, value, cu_seqlens,
           cu_seqlens_padded, **kwargs):
  """Attention of a module: :func:`jax_cp.cp_attention` on the module's
  metadata (a :class:`jax_cp.CPBatch` in ``cu_seqlens``, whose host check
  it keeps, or the two arrays) with the module's layout."""
  metadata = (cu_seqlens if isinstance(cu_seqlens, CPBatch)
              else (cu_seqlens, cu_seqlens_padded))
  return cp_attention(query, key, value, metadata, layout=layout, **kwargs)


def dot_product_attention(layout: CPLayout | None, query, key, value,
                          cu_seqlens, cu_seqlens_padded, *, dtype,
                          **kwargs) -> tuple[Any, CPLayout]:
  """The call of a ``DotProductAttention`` module, Linen and NNX alike:
  ``(out, layout)``. The layout checked (:func:`module_layout`), the
  metadata unpacked from a batch (:func:`metadata`) and the query's tokens
  checked against them (:func:`check_tokens`); ``query``, ``key`` and
  ``value`` cast to ``dtype`` (unchanged when None); then :func:`attend`
  with ``kwargs`` on the caller's own metadata (a batch keeps its host
  check)."""
  layout = module_layout(layout)
  _, cuP = metadata(layout, cu_seqlens, cu_seqlens_padded,
                    "DotProductAttention's batch")
  check_tokens(layout, query.shape[-3], cuP, "query", cu_seqlens)
  if dtype is not None:
    query, key, value = (x.astype(dtype) for x in (query, key, value))
  return attend(layout, query, key, value, cu_seqlens, cu_seqlens_padded,
                **kwargs), layout
