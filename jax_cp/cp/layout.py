"""One static object for the token layout of a CP run, and batches that
carry it (docs/concepts.md).

:class:`CPLayout` holds every setting that decides where the tokens of a
packed row live and how attention exchanges them: the cp mesh axis (and the
mesh), the cp size, the load-balancing strategy, the ``max_seqlen`` bound,
the attention backend, the batch and head mesh axes, the view
(``"global"``: whole rows under ``jit`` with a mesh; ``"local"``: this
rank's chunk inside a ``shard_map``) and how K/V travel between ranks
(``comm_type``). It is validated once, when built, is
frozen and hashable (a static argument of ``jax.jit`` and static module
configuration), and every function that produces or consumes the layout
takes it: the data functions of :mod:`jax_cp.data`,
:func:`jax_cp.cp_attention`, the modules of :mod:`jax_cp.flax` and
:mod:`jax_cp.nnx`. Built once and passed everywhere, it cannot partition
with one strategy and attend with another.

:class:`CPBatch` is a pytree of packed rows and their metadata with the
layout as static data. A consumer given a batch made with a different
layout raises ``ValueError`` (:meth:`CPLayout.check_matches`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jax_cp.attention.determinism import check_deterministic
from jax_cp.attention.validation import concrete
from jax_cp.cp import validation
from jax_cp.cp.strategies.load_balancing import (
  DEFAULT_STRATEGY,
  CPLoadBalancingStrategy,
  as_strategy,
)

MeshLike = jax.sharding.Mesh | jax.sharding.AbstractMesh
VIEWS = ("global", "local")
#: Values of :attr:`CPLayout.comm_type`.
COMM_TYPES = ("all_gather", "ring", "all_to_all", "all_to_all+ring")

# The fields that decide which tokens a rank holds: two layouts that agree
# on them partition a row identically.
_TOKEN_FIELDS = ("cp_axis", "strategy", "cp_size")


def _axes(value, argname: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    axes = (value,)
  elif isinstance(value, (tuple, list)):
    axes = tuple(value)
  else:
    axes = (value,)
  for ax in axes:
    if not isinstance(ax, str):
      raise ValueError(f"{argname} must be a mesh axis name or a tuple of "
                       f"names, got {value!r}")
  return axes


def _axes_size(mesh, axes: tuple[str, ...]) -> int:
  """The product of the sizes of mesh axes ``axes``."""
  return math.prod(int(mesh.shape[ax]) for ax in axes)


def _optional_bound(value, argname: str) -> int | None:
  """``value`` as an int, checked to be None or a positive int."""
  if value is not None and (isinstance(value, bool) or not isinstance(
      value, (int, np.integer)) or value < 1):
    raise ValueError(f"{argname} must be None or a positive int, got "
                     f"{value!r}")
  return None if value is None else int(value)


@dataclasses.dataclass(frozen=True)
class CPLayout:
  """The token layout and exchange of a context-parallel run.

  Build it once (``CPLayout(mesh=mesh, strategy="no_load_balance", ...)``)
  and hand the same object to the data loading, the attention calls and the
  modules. Arguments are validated by the constructor; strings are
  converted (``strategy`` to :class:`jax_cp.CPLoadBalancingStrategy`, a list
  of batch axes to a tuple), so equal settings give equal, equally hashed
  layouts. docs/concepts.md describes the layout; docs/max_seqlen.md the
  bound.

  Attributes:
    cp_axis: the mesh axis the token dim is split over, or a tuple of two
      ``(outer, inner)`` (rank ``outer * inner_size + inner``); ``None``:
      no CP (every row attended whole on one rank).
    cp_size: the size of ``cp_axis``. Taken from ``mesh`` when that is
      given (and then checked against it); needed by host-side data
      functions without a mesh; otherwise read from the context mesh or the
      enclosing ``shard_map`` when attention runs (:meth:`resolve_cp_size`).
    strategy: the load-balancing strategy (:class:`CPLoadBalancingStrategy`
      or its string), default DUAL_CHUNK_SWAP.
    max_seqlen: static bound on every padded document length (``None``: the
      row length): kernels are sized by it and NO_LOAD_BALANCE exchanges
      only the ``max_seqlen - 1`` tokens before each chunk. Concrete
      metadata with a longer document raise ``ValueError``; a batch checked
      on the host runs the bounded program alone; raw traced metadata get
      an in-graph fallback (docs/max_seqlen.md).
    backend: varlen attention backend: ``"auto"``, ``"xla"`` or ``"cudnn"``.
      ``"auto"`` runs cuDNN on a GPU where the extension is built and q/k/v
      are bfloat16 or float16, else ``"xla"`` (float32 inputs on a GPU: with
      one logged line saying so); ``"cudnn"`` takes bfloat16 or float16
      only (``ValueError`` otherwise).
    mesh: the mesh of the global view; ``None`` takes the context mesh
      (``jax.set_mesh``) where one is needed.
    batch_axis: mesh axis (or tuple of axes) the batch dim is sharded over
      (data parallel), global view.
    head_axis: mesh axis the heads are sharded over (tensor parallel),
      global view.
    view: ``"global"``: arrays hold whole rows in
      :func:`jax_cp.data.reorder_for_cp` order, sharded over ``cp_axis``, and
      attention opens its own ``shard_map``. ``"local"``: arrays hold this
      rank's chunk (:func:`jax_cp.data.get_batch_on_this_cp_rank`) inside the
      caller's ``shard_map``.
    comm_type: how K/V travel between the ranks of ``cp_axis``:
      ``"all_gather"`` (default) gathers every rank's K/V once per step
      (NO_LOAD_BALANCE with a ``max_seqlen`` bound or a window only the
      halo before each chunk); ``"ring"`` passes them around the ring in
      ``cp`` steps of one chunk each, merging each step's attention by
      log-sum-exp, so no buffer of a rank grows with the whole row
      (docs/long_rows.md, Ring exchange). The ring takes no window under
      DUAL_CHUNK_SWAP, nor one of ``(cp-1) * T/cp`` or more tokens under
      NO_LOAD_BALANCE (``ValueError``). ``"all_to_all"`` (Ulysses) trades
      tokens for heads: each rank gets the whole row for ``Hq/cp`` query
      heads and the K/V heads they use, attends it in one call and sends
      the output back (needs ``Hq % cp == 0`` and ``Hkv`` a multiple or a
      divisor of cp). ``"all_to_all+ring"`` (hierarchical) takes
      ``cp_axis=(outer, inner)``: the all-to-all over the inner axis, the
      ring over the outer (docs/long_rows.md, All-to-all exchanges).
    deterministic: the deterministic mode (docs/determinism.md): ``True``
      runs every kernel and every gradient sum of the attention in a fixed
      order, so a step gives the same bits run to run (cuDNN's
      deterministic backward, the all-gather's gradients summed rank by
      rank), at a cost in time and scratch memory; ``False`` the fastest
      kernels; ``None`` (default) follows XLA's flag
      ``--xla_gpu_exclude_nondeterministic_ops`` (or
      ``--xla_gpu_deterministic_ops``).
  """

  cp_axis: str | tuple[str, ...] | None = "cp"
  cp_size: int | None = None
  strategy: CPLoadBalancingStrategy | str = DEFAULT_STRATEGY
  max_seqlen: int | None = None
  backend: str = "auto"
  mesh: MeshLike | None = None
  batch_axis: str | tuple[str, ...] | None = None
  head_axis: str | None = None
  view: str = "global"
  comm_type: str = "all_gather"
  deterministic: bool | None = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("strategy", as_strategy(self.strategy, "strategy"))
    if self.cp_axis is not None:
      cp_axes = _axes(self.cp_axis, "cp_axis")
      if not cp_axes or len(set(cp_axes)) != len(cp_axes):
        raise ValueError(f"cp_axis must be a mesh axis name, a tuple of "
                         f"distinct names or None, got {self.cp_axis!r}")
      set_("cp_axis", cp_axes[0] if len(cp_axes) == 1 else cp_axes)
    if not isinstance(self.backend, str):
      raise ValueError(f"backend must be a string, got {self.backend!r}")
    set_("max_seqlen", _optional_bound(self.max_seqlen, "max_seqlen"))
    if self.comm_type not in COMM_TYPES:
      raise ValueError(f"comm_type={self.comm_type!r} is not one of "
                       f"{list(COMM_TYPES)}")
    if self.view not in VIEWS:
      raise ValueError(f"view={self.view!r} is not one of {list(VIEWS)}")
    check_deterministic(self.deterministic)
    batch = _axes(self.batch_axis, "batch_axis")
    set_("batch_axis", None if not batch else
         batch[0] if len(batch) == 1 else batch)
    if self.head_axis is not None and not isinstance(self.head_axis, str):
      raise ValueError(f"head_axis must be a mesh axis name or None, got "
                       f"{self.head_axis!r}")
    size = self.cp_size
    if size is not None:
      validation.check_cp_size(size)
      set_("cp_size", int(size))
    if self.cp_axis is None:
      if size not in (None, 1):
        raise ValueError(f"cp_size={size} needs a cp_axis; cp_axis=None "
                         "means no CP (cp_size 1)")
      set_("cp_size", 1)
    validation.check_comm_axes(self.comm_type, self.cp_axes)
    if self.mesh is not None:
      for ax in self.cp_axes:
        validation.check_mesh_axis(self.mesh, ax, "cp_axis")
      for ax in batch:
        validation.check_mesh_axis(self.mesh, ax, "batch_axis")
      validation.check_mesh_axis(self.mesh, self.head_axis, "head_axis")
      if self.cp_axis is not None:
        on_mesh = _axes_size(self.mesh, self.cp_axes)
        if size is not None and int(size) != on_mesh:
          raise ValueError(f"cp_size={size} disagrees with the mesh, whose "
                           f"axis {self.cp_axis!r} has size {on_mesh}")
        set_("cp_size", on_mesh)

  def replace(self, **changes: Any) -> CPLayout:
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  # -------------------------------------------------------------- queries

  @property
  def is_local(self) -> bool:
    """True when arrays hold this rank's chunk (local view with CP)."""
    return self.view == "local" and self.cp_axis is not None

  @property
  def cp_axes(self) -> tuple[str, ...]:
    """``cp_axis`` as a tuple (empty without CP): ``(outer, inner)`` for a
    cp axis of two mesh axes, the inner one the minor (rank ``outer *
    inner_size + inner``)."""
    return _axes(self.cp_axis, "cp_axis")

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """``batch_axis`` as a tuple (empty without data parallelism)."""
    return _axes(self.batch_axis, "batch_axis")

  def context_mesh(self) -> MeshLike:
    """``mesh``, or the context mesh (``jax.set_mesh``).

    Raises:
      ValueError: neither is set.
    """
    if self.mesh is not None:
      return self.mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError(
          f"the global view of cp_axis={self.cp_axis!r} needs a mesh: build "
          "the CPLayout with mesh=... or run under `with jax.set_mesh(mesh):`"
          " (or use view='local' inside your own shard_map)")
    return mesh

  def mesh_if_any(self) -> MeshLike | None:
    """``mesh``, or the context mesh, or None where there is neither."""
    if self.mesh is not None:
      return self.mesh
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh

  def runs_in_own_shard_map(self) -> bool:
    """Whether attention opens its own ``shard_map``: in the global view,
    with CP, or without CP where a mesh shards the rows (their batch or
    head axes); not in the local view, nor without CP and without a
    mesh."""
    if self.is_local:
      return False
    return self.cp_axis is not None or self.mesh_if_any() is not None

  def resolve_cp_size(self) -> int:
    """The cp size where the layout is used, checking the axis exists there.

    Local view: the size of ``cp_axis`` in the enclosing ``shard_map``;
    global view: its size on ``mesh`` or the context mesh (the product of
    the sizes of a tuple of axes). Either is checked against ``cp_size``
    when that is set.

    Raises:
      ValueError: ``cp_axis`` is not bound (local view) or not on the mesh
        (global view), or its size disagrees with ``cp_size``.
    """
    return math.prod(self.resolve_axis_sizes())

  def resolve_axis_sizes(self) -> tuple[int, ...]:
    """The size of each axis of :attr:`cp_axes` where the layout is used
    (``()`` without CP); checked as :meth:`resolve_cp_size` says."""
    if self.cp_axis is None:
      mesh = self.mesh_if_any()
      if mesh is not None:
        for ax in self.batch_axes:
          validation.check_mesh_axis(mesh, ax, "batch_axis")
        validation.check_mesh_axis(mesh, self.head_axis, "head_axis")
      return ()
    if self.is_local:
      try:
        sizes = tuple(int(jax.lax.axis_size(ax)) for ax in self.cp_axes)
      except NameError:
        raise ValueError(
            f"cp_axis={self.cp_axis!r} is not bound: a layout with "
            "view='local' is used inside a jax.shard_map over a mesh that "
            "has this axis") from None
    else:
      mesh = self.context_mesh()
      for ax in self.cp_axes:
        validation.check_mesh_axis(mesh, ax, "cp_axis")
      for ax in self.batch_axes:
        validation.check_mesh_axis(mesh, ax, "batch_axis")
      validation.check_mesh_axis(mesh, self.head_axis, "head_axis")
      sizes = tuple(int(mesh.shape[ax]) for ax in self.cp_axes)
    size = math.prod(sizes)
    if self.cp_size is not None and size != self.cp_size:
      raise ValueError(f"the layout's cp_size={self.cp_size} disagrees with "
                       f"the size {size} of axis {self.cp_axis!r} here")
    return sizes

  def shard_tokens(self, x, seq_dim: int | None = None):
    """``x`` constrained to keep its token axis sharded over ``cp_axis``
    (and, for ``[B, T, ...]``, its batch axis over ``batch_axis``); its
    other axes are left to XLA.

    ``seq_dim`` is the token axis: by default 0 for ``[T, E]`` and 1 for
    arrays of 3 or more dims (``[B, T, E]``, ``[B, T, H, D]``); pass
    ``seq_dim=0`` for an unbatched ``[T, H, D]``. Whole rows of the
    global view.

    Without this, XLA's partitioner may all-gather the tokens of an
    activation to shard a matmul's output features over the cp axis
    instead (an FSDP-sharded MLP at data=1 x cp=2 gets an all-gather of
    its input and an all-reduce of its gradient per layer); pinned, it
    gathers the weight. ``x`` itself in the local view, without CP, or
    where ``cp_axis`` is an ``Explicit`` mesh axis (the sharding is then
    part of ``x``'s type and the partitioner chooses nothing).
    """
    if seq_dim is None:
      seq_dim = 0 if x.ndim < 3 else 1
    if not 0 <= seq_dim < x.ndim:
      raise ValueError(f"seq_dim={seq_dim} is not an axis of x with shape "
                       f"{tuple(x.shape)}")
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    spec = [free] * x.ndim
    spec[seq_dim] = self.cp_axis
    if seq_dim == 1:
      spec[0] = self.batch_axes or None
    return self.constrain(x, tuple(spec))

  def constrain(self, x, spec: tuple):
    """``x`` under ``with_sharding_constraint(PartitionSpec(*spec))`` (on
    this layout's mesh when it has one), where the token sharding is the
    partitioner's to choose: in the global view, with CP, on an ``Auto``
    ``cp_axis``; ``x`` itself otherwise. The one rule behind
    :meth:`shard_tokens` and the modules' per-chunk constraints."""
    if self.cp_axis is None or self.is_local:
      return x
    mesh = self.context_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(types.get(ax) != jax.sharding.AxisType.Auto
           for ax in self.cp_axes):
      return x
    spec = jax.sharding.PartitionSpec(*spec)
    if self.mesh is not None:
      spec = jax.sharding.NamedSharding(self.mesh, spec)
    return jax.lax.with_sharding_constraint(x, spec)

  def token_fields(self) -> dict[str, Any]:
    """The settings that decide which tokens each rank holds."""
    return {name: getattr(self, name) for name in _TOKEN_FIELDS}

  def check_matches(self, other: CPLayout, what: str) -> None:
    """Raises unless ``other`` puts every token where this layout does.

    Two layouts match when they have the same ``cp_axis`` and strategy and
    their cp sizes agree (where both are known); the exchange, backend or
    bounds may differ.

    Raises:
      ValueError: naming ``what`` and the fields that differ.
    """
    if not isinstance(other, CPLayout):
      raise ValueError(f"{what} carries no CPLayout (got "
                       f"{type(other).__name__})")
    if self.cp_axis is None and other.cp_axis is None:
      return
    mine, theirs = self.token_fields(), other.token_fields()
    if mine["cp_size"] is None or theirs["cp_size"] is None:
      mine.pop("cp_size")
      theirs.pop("cp_size")
    bad = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    if bad:
      detail = ", ".join(f"{k}: {a!s} here, {b!s} in the data"
                         for k, (a, b) in bad.items())
      raise ValueError(
          f"{what} was laid out with another CPLayout ({detail}); partition "
          "the data and attend with the same layout")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CPBatch:
  """Packed rows in a CP layout, with their metadata and the layout.

  A pytree: the arrays are leaves, ``layout`` is static (auxiliary) data,
  so a batch passes through ``jit``, ``shard_map`` and the modules and
  keeps its layout. :func:`jax_cp.data.make_global_batch` returns one; pass it
  where the row metadata is expected (``cp_attention(q, k, v, batch)``,
  ``layer(x, batch)``, ``MultiHeadAttention(attention_fn=...)(x,
  mask=batch)``): the metadata are read from it and its layout is checked
  against the consumer's (:meth:`CPLayout.check_matches`).

  **Checked on the host.** A batch whose metadata were checked against the
  layout's ``max_seqlen`` on the host (:func:`jax_cp.data.make_global_batch`,
  :meth:`check_on_host`) records the bound in ``checked_max_seqlen``,
  static data that survives ``jit``: attention given the batch, traced or
  not, runs the bounded program alone (:meth:`checked_for`), with no
  fallback branch and none of its memory. The record is a promise about
  the values of the metadata leaves, and pytree operations keep static
  data whatever leaves they are given (``jax.tree.map``,
  ``tree_unflatten``, ``dataclasses.replace``), so a batch whose metadata
  change after the check keeps it. Attention guards against that: it still
  evaluates the bound on the traced metadata (a few integer ops) and makes
  the outputs and gradients NaN where it is broken, never a silent wrong
  answer. To change the metadata, build a new ``CPBatch`` (unchecked) and
  call :meth:`check_on_host` on it. docs/max_seqlen.md has the whole
  mechanism.

  Attributes:
    tensors: the token arrays (one array, or a dict / tuple of arrays) in
      the layout, or None when the batch carries only metadata.
    cu_seqlens_padded: int ``[B, N+1]`` (or ``[N+1]``) cumulative padded
      document lengths of the rows, in physical order.
    cu_seqlens: int, same shape: cumulative valid lengths (None when not
      given; attention then needs it).
    layout: the :class:`CPLayout` the tensors are in (static; keyword
      only, never assumed).
    checked_max_seqlen: the bound every document of the metadata was
      checked against on the host (static; None: not checked;
      :func:`jax_cp.cp.validation.document_spans` says what counts).
    total_tokens: ``T``, the tokens of each whole row (static; None: not
      known). :func:`jax_cp.data.make_global_batch` records it, and a batch
      built with concrete ``cu_seqlens_padded`` reads it from them; under
      ``jit`` it is what attention checks the token count of q, k and v
      against (:meth:`check_tokens`), since traced metadata cannot be.
  """

  tensors: Any
  cu_seqlens_padded: Any
  cu_seqlens: Any = None
  layout: CPLayout = dataclasses.field(kw_only=True,
                                       metadata=dict(static=True))
  checked_max_seqlen: int | None = dataclasses.field(
      default=None, kw_only=True, metadata=dict(static=True))
  total_tokens: int | None = dataclasses.field(
      default=None, kw_only=True, metadata=dict(static=True))

  def __post_init__(self):
    if not isinstance(self.layout, CPLayout):
      raise ValueError(f"CPBatch.layout must be a CPLayout, got "
                       f"{type(self.layout).__name__}")
    object.__setattr__(self, "checked_max_seqlen", _optional_bound(
        self.checked_max_seqlen, "checked_max_seqlen"))
    total = self.total_tokens
    if total is None:
      total = _row_tokens(self.cu_seqlens_padded)
    object.__setattr__(self, "total_tokens", _optional_bound(
        total, "total_tokens"))

  def check_tokens(self, total_tokens: int, batch_size: int | None,
                   what: str) -> None:
    """Raises unless inputs of ``total_tokens`` tokens per whole row (and
    ``batch_size`` rows, when given) are the batch's: its static token
    count and the rows of its metadata, checked at trace time, so also
    under ``jit`` where the metadata values are not known.

    Raises:
      ValueError: naming both token counts (or row counts).
    """
    if self.total_tokens is not None and total_tokens != self.total_tokens:
      raise ValueError(
          f"{what}: the inputs have {total_tokens} tokens per row (the whole "
          f"row, over every cp rank), but the batch's rows have "
          f"{self.total_tokens}; q, k and v must be the batch's tokens")
    rows = np.shape(self.cu_seqlens_padded)
    if batch_size is not None and len(rows) == 2 and rows[0] != batch_size:
      raise ValueError(
          f"{what}: the inputs have {batch_size} rows, the batch's metadata "
          f"{rows[0]} (cu_seqlens_padded {rows})")

  def check_on_host(self, max_seqlen: int | None = None) -> CPBatch:
    """This batch, recording that its metadata hold no padded document
    longer than ``max_seqlen`` (default: the layout's), checked now on
    the host.

    Raises:
      ValueError: no bound (neither ``max_seqlen`` nor the layout's), the
        metadata are traced (not on the host), or a padded document is
        longer than the bound.
    """
    w = self.layout.max_seqlen if max_seqlen is None else max_seqlen
    if w is None:
      raise ValueError("check_on_host needs a bound: max_seqlen=, or a "
                       "layout with max_seqlen")
    cuP = concrete(self.cu_seqlens_padded)
    if cuP is None:
      raise ValueError("check_on_host needs concrete cu_seqlens_padded (on "
                       "the host, outside jit); these are traced")
    validation.check_cu_seqlens_padded(cuP)
    cu = None
    if self.cu_seqlens is not None:
      cu = concrete(self.cu_seqlens)
      if cu is None:
        raise ValueError("check_on_host needs concrete cu_seqlens (on the "
                         "host, outside jit); these are traced")
      validation.check_cu_seqlens(cu, cuP)
    layout = self.layout
    # An unknown cp size takes the stricter rule (that of cp > 1).
    cp = layout.cp_size if layout.cp_size is not None else (
        1 if layout.cp_axis is None else 2)
    validation.check_max_seqlen_bound(cuP, w, cu, layout.strategy, cp)
    return dataclasses.replace(self, checked_max_seqlen=w)

  def checked_for(self, layout: CPLayout) -> bool:
    """Whether the metadata were checked on the host against a bound no
    larger than ``layout.max_seqlen``: attention with ``layout`` then
    trusts the bound (no fallback branch)."""
    return (self.checked_max_seqlen is not None
            and layout.max_seqlen is not None
            and self.checked_max_seqlen <= layout.max_seqlen)

  def metadata(self, layout: CPLayout | None, what: str
               ) -> tuple[Any, Any]:
    """``(cu_seqlens, cu_seqlens_padded)`` for a consumer with ``layout``
    (None: no layout to check against).

    Raises:
      ValueError: the batch has no ``cu_seqlens``, or was laid out with a
        layout that does not match ``layout``.
    """
    if layout is not None:
      layout.check_matches(self.layout, what)
    if self.cu_seqlens is None:
      raise ValueError(f"{what} has no cu_seqlens: attention needs the "
                       "valid lengths (make_global_batch(..., cu_seqlens=...)"
                       " or CPBatch(cu_seqlens=...))")
    return self.cu_seqlens, self.cu_seqlens_padded


def _row_tokens(cu_seqlens_padded) -> int | None:
  """``cu_seqlens_padded[..., -1]`` of concrete metadata, else None."""
  try:
    cuP = concrete(cu_seqlens_padded)
  except Exception:  # pylint: disable=broad-except  (tree sentinels)
    return None
  if cuP is None or not cuP.size or cuP.ndim not in (1, 2):
    return None
  return int(cuP.reshape(-1)[-1]) or None


def check_layout(layout: Any, what: str) -> CPLayout:
  """``layout``, checked to be a :class:`CPLayout`; ``what`` names the
  caller in the error."""
  if not isinstance(layout, CPLayout):
    raise ValueError(f"{what}: layout must be a jax_cp.CPLayout, got "
                     f"{type(layout).__name__} {layout!r}")
  return layout


def unpack_metadata(cu_seqlens, cu_seqlens_padded, layout: CPLayout | None,
                    what: str) -> tuple[Any, Any]:
  """The row metadata of a call that takes ``(cu_seqlens,
  cu_seqlens_padded)`` arrays or a :class:`CPBatch` in place of
  ``cu_seqlens``.

  Raises:
    ValueError: a batch together with ``cu_seqlens_padded``, a batch with
      another layout or without ``cu_seqlens``, or missing metadata.
  """
  if isinstance(cu_seqlens, CPBatch):
    if cu_seqlens_padded is not None:
      raise ValueError(f"{what}: pass a CPBatch alone, without "
                       "cu_seqlens_padded (the batch holds it)")
    return cu_seqlens.metadata(layout, what)
  if cu_seqlens is None or cu_seqlens_padded is None:
    raise ValueError(f"{what} needs the packing metadata: cu_seqlens and "
                     "cu_seqlens_padded arrays, or a jax_cp.CPBatch")
  return cu_seqlens, cu_seqlens_padded


NO_CP = CPLayout(cp_axis=None)
