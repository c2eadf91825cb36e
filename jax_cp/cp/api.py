"""Context-parallel attention over packed THD rows: :func:`cp_attention`.

The layout's view decides where it runs: the global view places q, k, v
in the sharding the ``shard_map`` expects and opens it on the layout's (or
the context) mesh; the local view runs on this rank's chunk inside the
caller's ``shard_map``. Without CP (``cp_axis=None``) every row is
attended whole, on each device's rows where there is a mesh. Either way
the arguments are validated and one
:class:`~jax_cp.cp.config.CPConfig` built (:func:`~jax_cp.cp.config.
make_config`) before any tracing of the per-rank work, which lives in
:mod:`jax_cp.cp.vjp` (the ``custom_vjp``), planned by
:mod:`jax_cp.cp.strategies.call_plan`. docs/concepts.md describes the
layout and the strategies, docs/internals.md the plans and the exchange.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp.cp import guard, validation
from jax_cp.cp.config import CPConfig, make_config
from jax_cp.cp.layout import CPBatch, CPLayout, check_layout
from jax_cp.cp.vjp import cp_attention_vjp
from jax_cp.typing import Array, ArrayLike, WindowSize


def cp_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                 metadata: CPBatch | tuple[ArrayLike, ArrayLike], *,
                 layout: CPLayout | None = None,
                 attn_mask_type: str = "causal",
                 window_size: WindowSize = None,
                 softmax_scale: float | None = None) -> Array:
  """Causal (or unmasked) attention within the documents of packed rows,
  context parallel.

  See docs/concepts.md.

  Args:
    q: ``[B, T, Hq, D]`` or ``[T, Hq, D]``: in the global view the whole
      rows in :func:`jax_cp.data.reorder_for_cp` layout, token axis sharded
      over ``cp_axis``; in the local view this rank's chunk (``T / cp``
      tokens, :func:`jax_cp.data.get_batch_on_this_cp_rank`).
    k, v: ``[.., T, Hkv, D]``, same layout, ``Hq % Hkv == 0`` (GQA/MQA).
    metadata: the rows' metadata: a :class:`jax_cp.CPBatch`, or the pair
      ``(cu_seqlens, cu_seqlens_padded)`` of int ``[B, N+1]`` (``[N+1]``)
      arrays of the whole rows in physical order (replicated over the cp
      axis; may be traced).
    layout: the :class:`jax_cp.CPLayout`; default: the batch's. A batch
      is checked against it (the same token placement).
    attn_mask_type: ``"causal"`` or ``"no_mask"`` (DUAL_CHUNK_SWAP only),
      within each document.
    window_size: ``None`` or a causal sliding window ``(left, 0)``: a
      query at document position ``i`` sees keys ``[i - left, i]``.
    softmax_scale: defaults to ``1/sqrt(D)``.

  Returns:
    The output, shaped, typed and laid out like ``q``; 0 on padding.
    Differentiable in q, k, v. Padding tokens reach no valid output or
    gradient, whatever q, k, v or the output's cotangent hold there (NaN
    and infinities included); their gradients are 0.

  Raises:
    ValueError: before any kernel runs, for a missing layout, a batch of
      another layout, metadata that break the strategy's rules or the
      layout's ``max_seqlen`` (when concrete), or any argument the checks
      of :func:`jax_cp.cp.config.make_config` reject.
  """
  layout, cu_seqlens, cu_seqlens_padded, trusted = unpack(
      metadata, layout, "cp_attention")
  if isinstance(metadata, CPBatch):
    total = q.shape[-3] * (layout.resolve_cp_size() if layout.is_local
                           else 1)
    metadata.check_tokens(total, q.shape[0] if q.ndim == 4 else None,
                          "cp_attention")
  config = functools.partial(
      make_config, layout, q, k, v, cu_seqlens, cu_seqlens_padded,
      attn_mask_type=attn_mask_type, softmax_scale=softmax_scale,
      window_size=window_size, trusted=trusted)
  sizes = layout.resolve_axis_sizes()
  cp = math.prod(sizes)
  if not layout.runs_in_own_shard_map():
    cfg = config(cp_size=cp, total_tokens=q.shape[-3] * cp,
                 axis_sizes=sizes)
    return run_local(cfg, q, k, v, cu_seqlens, cu_seqlens_padded)
  mesh = layout.context_mesh()
  validation.check_batch_axis_rank(layout.batch_axis, q.shape)
  # Validated once, on the global shapes; the shard_map body reuses it.
  cfg = config(cp_size=cp, total_tokens=q.shape[-3],
               platform=_platform(mesh), axis_sizes=sizes,
               head_shards=1 if layout.head_axis is None else
               int(mesh.shape[layout.head_axis]))
  if layout.head_axis is not None:
    validation.check_head_axis_divides(
        layout.head_axis, mesh.shape[layout.head_axis], q.shape, k.shape)
  x_spec, m_spec = specs(q.ndim, layout)
  args = (q, k, v, jnp.asarray(cu_seqlens, jnp.int32),
          jnp.asarray(cu_seqlens_padded, jnp.int32))
  program = _global_program
  if not any(isinstance(x, jax.core.Tracer) for x in args):
    # Called eagerly: one compiled program per config, mesh and shapes,
    # not the shard_map's operations dispatched one by one.
    program = _eager_global_program
  return program(*args, cfg=cfg, mesh=mesh, x_spec=x_spec, m_spec=m_spec)


def _global_program(q, k, v, cu_seqlens, cu_seqlens_padded, *,
                    cfg: CPConfig, mesh, x_spec, m_spec):
  """The global view's ``shard_map`` over the layout's mesh."""
  args = [place(x, mesh, spec) for x, spec in (
      (q, x_spec), (k, x_spec), (v, x_spec),
      (cu_seqlens, m_spec), (cu_seqlens_padded, m_spec))]
  return jax.shard_map(functools.partial(run_local, cfg), mesh=mesh,
                       in_specs=(x_spec, x_spec, x_spec, m_spec, m_spec),
                       out_specs=x_spec, check_vma=False)(*args)


_eager_global_program = jax.jit(
    _global_program, static_argnames=("cfg", "mesh", "x_spec", "m_spec"))


def unpack(metadata: Any, layout: CPLayout | None, what: str
           ) -> tuple[CPLayout, Any, Any, bool]:
  """``(layout, cu_seqlens, cu_seqlens_padded, trusted)`` of a call given
  ``metadata`` (a :class:`CPBatch` or the pair of arrays) and ``layout``
  (None: the batch's); ``trusted``: a batch checked on the host against
  the layout's bound."""
  if isinstance(metadata, CPBatch):
    layout = metadata.layout if layout is None else check_layout(layout,
                                                                 what)
    cu, cuP = metadata.metadata(layout, f"the batch given to {what}")
    return layout, cu, cuP, metadata.checked_for(layout)
  if layout is None:
    raise ValueError(
        f"{what} needs a layout: pass layout=jax_cp.CPLayout(...), or a "
        "jax_cp.CPBatch as the metadata (it carries its layout)")
  check_layout(layout, what)
  if not isinstance(metadata, (tuple, list)) or len(metadata) != 2:
    raise ValueError(
        f"{what}: metadata must be a jax_cp.CPBatch or the pair "
        f"(cu_seqlens, cu_seqlens_padded), got {type(metadata).__name__}")
  cu, cuP = metadata
  if cu is None or cuP is None:
    raise ValueError(f"{what} needs both cu_seqlens and cu_seqlens_padded")
  return layout, cu, cuP, False


def _as_batched(q, k, v, cu, cuP):
  if q.ndim == 4:
    return q, k, v, cu, cuP, False
  return q[None], k[None], v[None], cu[None], cuP[None], True


def run_local(cfg: CPConfig, q, k, v, cu_seqlens, cu_seqlens_padded):
  """The per-rank attention on local arrays, with a validated config."""
  q4, k4, v4, cu, cuP, squeeze = _as_batched(
      q, k, v, jnp.asarray(cu_seqlens, jnp.int32),
      jnp.asarray(cu_seqlens_padded, jnp.int32))
  out = _attend(cfg, q4, k4, v4, cu, cuP)
  return out[0] if squeeze else out


def _attend(cfg: CPConfig, q, k, v, cu, cuP):
  """Batched per-rank attention: an all-to-all exchange scatters the
  heads and runs its inner program on them (docs/internals.md, All-to-all
  exchanges); every other exchange runs inside the ``custom_vjp``."""
  if cfg.inner is not None:
    (q, k, v), order = cfg.exchange.to_heads(q, k, v, cuP)
    out = _attend(cfg.inner, q, k, v, cu, cuP)
    return cfg.exchange.from_heads(out, order)
  k, v = guard.poison(cfg, cu, cuP, k, v)
  return cp_attention_vjp(q, k, v, cu, cuP, cfg)


def _platform(mesh) -> str | None:
  """The platform of the mesh's devices ("cpu", "gpu", ...), if known."""
  try:
    return mesh.devices.flat[0].platform
  except Exception:  # pylint: disable=broad-except  (an AbstractMesh)
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)


def specs(ndim: int, layout: CPLayout):
  """The ``PartitionSpec`` of q/k/v and of the row metadata in the global
  view of ``layout``."""
  axes = layout.batch_axes
  bspec = None if not axes else axes if len(axes) > 1 else axes[0]
  if ndim == 4:
    return (P(bspec, layout.cp_axis, layout.head_axis, None),
            P(bspec, None))
  return P(layout.cp_axis, layout.head_axis, None), P(None)


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
