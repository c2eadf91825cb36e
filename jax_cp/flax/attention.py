"""Linen attention modules over packed THD rows with context parallelism.

Two ways to run them (the ``local_view`` field):

* **global view** (``local_view=False``, the default): call the module under
  ``jit`` with a mesh (the ``mesh`` field or ``jax.set_mesh``). Token arrays
  hold the *whole* row in :func:`jax_cp.reorder_for_cp` layout, their token
  axis sharded over ``cp_axis``; attention goes through
  :func:`jax_cp.cp_attention`, which opens its own ``shard_map``.
* **local view** (``local_view=True``): call the module inside your own
  ``jax.shard_map``; token arrays hold this rank's chunk (as produced by
  :func:`jax_cp.get_batch_on_this_cp_rank`) and attention goes through
  :func:`jax_cp.cp_attention_local`.

In both views ``cu_seqlens`` / ``cu_seqlens_padded`` are the *global* row
metadata ``[B, N+1]`` (``[N+1]`` for unbatched inputs). With
``cp_axis=None`` there is no CP: the row is attended whole, through
:func:`jax_cp.cp_attention_local` with ``cp_axis=None``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_cp import checks, partition
from jax_cp import context_parallel as _cp
from jax_cp.flax import settings
from jax_cp.flax.rotary import apply_rotary
from jax_cp.strategy import DEFAULT_STRATEGY, CPLoadBalancingStrategy

Dtype = Any
Initializer = Callable[..., jax.Array]
MeshLike = Union[jax.sharding.Mesh, jax.sharding.AbstractMesh]


class DotProductAttention(nn.Module):
  """Causal dot-product attention over packed documents, context parallel.

  No parameters. Queries ``[B, T, Hq, D]`` (or ``[T, Hq, D]``), keys and
  values ``[.., T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA); returns the
  attention output shaped like the queries. Records the strategy it used as
  an int (:data:`jax_cp.flax.settings.STRATEGY_CODES`) under
  ``intermediates/cp_strategy_code`` when that collection is mutable.

  Attributes:
    attn_mask_type: ``"causal"`` (default) or ``"no_mask"``.
    window_size: ``None`` (default; plain causal) or a causal sliding window
      ``(left, 0)``: a query at document position ``i`` sees keys
      ``[i - left, i]``. Per module, so one model can mix local and global
      layers.
    softmax_scale: scale of ``q @ k^T`` (default ``1/sqrt(D)``).
    dtype: computation dtype; q, k, v are cast to it (default: unchanged).
    cp_axis: the mesh axis the token dim is split over; ``None``: no CP.
    cp_strategy: :class:`jax_cp.CPLoadBalancingStrategy` or its string
      (default DUAL_CHUNK_SWAP); an unknown string raises ``ValueError``.
    cp_comm_type: K/V exchange, ``"all_gather"``.
    attn_backend: varlen attention backend: ``"auto"``, ``"xla"``,
      ``"cudnn"``.
    max_seqlen: static bound on the longest padded document (None = the
      row length); kernels size their grids by it.
    mesh: mesh of the global view; ``None`` takes the context mesh
      (``jax.set_mesh``). Ignored in the local view.
    batch_axis: mesh axis (or axes) the batch dim is sharded over in the
      global view (data parallel); ignored in the local view.
    local_view: ``False``: global view under ``jit`` with a mesh, through
      :func:`jax_cp.cp_attention`. ``True``: called inside the caller's
      ``shard_map`` on local chunks, through
      :func:`jax_cp.cp_attention_local`.
  """

  attn_mask_type: str = "causal"
  window_size: Optional[Tuple[int, int]] = None
  softmax_scale: Optional[float] = None
  dtype: Optional[Dtype] = None
  cp_axis: Optional[str] = None
  cp_strategy: Union[CPLoadBalancingStrategy, str] = DEFAULT_STRATEGY
  cp_comm_type: str = "all_gather"
  attn_backend: str = "auto"
  max_seqlen: Optional[int] = None
  mesh: Optional[MeshLike] = None
  batch_axis: Union[str, Tuple[str, ...], None] = None
  local_view: bool = False

  def __post_init__(self):
    settings.validate_fields(self)
    checks.check_window_size(self.window_size, self.attn_mask_type)
    super().__post_init__()

  @nn.compact
  def __call__(self, query, key, value, cu_seqlens, cu_seqlens_padded):
    """Attends packed queries to keys/values of the same documents.

    Args:
      query: ``[B, T, Hq, D]`` or ``[T, Hq, D]`` (T: the whole row in the
        global view, this rank's chunk in the local view).
      key: ``[.., T, Hkv, D]``.
      value: ``[.., T, Hkv, D]``.
      cu_seqlens: int ``[B, N+1]`` / ``[N+1]`` global valid lengths.
      cu_seqlens_padded: int ``[B, N+1]`` / ``[N+1]`` global padded lengths.

    Returns:
      ``[.., T, Hq, D]`` in the layout of ``query``; 0 on padding tokens.
    """
    strategy = settings.strategy_of(self)
    settings.check_tokens(self, query.shape[-3], cu_seqlens_padded, "query")
    self.sow("intermediates", "cp_strategy_code",
             jnp.int32(settings.STRATEGY_CODES[strategy]))
    if self.dtype is not None:
      query, key, value = (x.astype(self.dtype) for x in (query, key, value))
    kwargs = dict(load_balancing_strategy=strategy,
                  cp_comm_type=self.cp_comm_type,
                  attn_mask_type=self.attn_mask_type,
                  window_size=self.window_size,
                  softmax_scale=self.softmax_scale,
                  backend=self.attn_backend, max_seqlen=self.max_seqlen)
    if self.cp_axis is None or self.local_view:
      return _cp.cp_attention_local(query, key, value, cu_seqlens,
                                    cu_seqlens_padded, cp_axis=self.cp_axis,
                                    **kwargs)
    return _cp.cp_attention(query, key, value, cu_seqlens, cu_seqlens_padded,
                            mesh=self.mesh, cp_axis=self.cp_axis,
                            batch_axis=self.batch_axis, **kwargs)


def default_position_ids(module, cu_seqlens_padded, n_tokens: int,
                         cp_size: int):
  """Per-document positions in the module's token layout, from the metadata.

  Global view: :func:`jax_cp.get_position_ids` permuted by
  :func:`jax_cp.reorder_for_cp`; local view: this rank's slice
  (:func:`jax_cp.get_batch_on_this_cp_rank` with the traced rank).
  """
  strategy = settings.strategy_of(module)
  local = module.local_view and module.cp_axis is not None
  total = n_tokens * cp_size if local else n_tokens
  cuP = jnp.asarray(cu_seqlens_padded, jnp.int32)
  pos = partition.get_position_ids(cuP, total_tokens=total)
  seq_dim = pos.ndim - 1
  if cp_size == 1:
    return pos
  if local:
    rank = jax.lax.axis_index(module.cp_axis)
    return partition.get_batch_on_this_cp_rank(
        cuP, pos, cp_size=cp_size, cp_rank=rank,
        load_balancing_strategy=strategy, seq_dim=seq_dim)[0]
  return partition.reorder_for_cp(pos, cuP, cp_size, strategy,
                                  seq_dim=seq_dim)


class MultiHeadAttention(nn.Module):
  """Self-attention with Q/K/V/out projections, GQA and rotary embeddings,
  over packed documents, context parallel.

  ``x [B, T, E] -> [B, T, out_features or E]`` (also ``[T, E]``). Rotary
  position embeddings use ``position_ids`` (per-document positions in the
  layout of ``x``); when omitted they are derived from
  ``cu_seqlens_padded``.

  Attributes:
    num_heads: number of query heads.
    num_kv_heads: number of key/value heads (GQA/MQA); must divide
      ``num_heads``. Default: ``num_heads``.
    num_gqa_groups: alias of ``num_kv_heads`` (TransformerEngine's name);
      set at most one of the two (or both to the same value).
    head_dim: per-head features (default ``E // num_heads``).
    out_features: output features (default ``E``).
    rope_theta: rotary base; ``None`` disables rotary embeddings.
    use_bias: whether the projections have biases.
    softmax_scale: attention scale (default ``1/sqrt(head_dim)``).
    attn_mask_type: ``"causal"`` (default) or ``"no_mask"``.
    window_size: ``None`` or a causal sliding window ``(left, 0)``, as in
      :class:`DotProductAttention`.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    kernel_init: initializer of the projection kernels.
    bias_init: initializer of the projection biases.
    cp_axis, cp_strategy, cp_comm_type, attn_backend, max_seqlen, mesh,
      batch_axis, local_view: CP settings, as in
      :class:`DotProductAttention`, passed to it unchanged.
  """

  num_heads: int
  num_kv_heads: Optional[int] = None
  num_gqa_groups: Optional[int] = None
  head_dim: Optional[int] = None
  out_features: Optional[int] = None
  rope_theta: Optional[float] = 10000.0
  use_bias: bool = False
  softmax_scale: Optional[float] = None
  attn_mask_type: str = "causal"
  window_size: Optional[Tuple[int, int]] = None
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  cp_axis: Optional[str] = None
  cp_strategy: Union[CPLoadBalancingStrategy, str] = DEFAULT_STRATEGY
  cp_comm_type: str = "all_gather"
  attn_backend: str = "auto"
  max_seqlen: Optional[int] = None
  mesh: Optional[MeshLike] = None
  batch_axis: Union[str, Tuple[str, ...], None] = None
  local_view: bool = False

  def __post_init__(self):
    settings.validate_fields(self)
    checks.check_window_size(self.window_size, self.attn_mask_type)
    self.kv_heads  # noqa: B018  (reading the property validates the heads)
    super().__post_init__()

  @property
  def kv_heads(self) -> int:
    """The number of key/value heads (``num_kv_heads``/``num_gqa_groups``)."""
    a, b = self.num_kv_heads, self.num_gqa_groups
    if a is not None and b is not None and a != b:
      raise ValueError(f"num_kv_heads={a} and its alias num_gqa_groups={b} "
                       "disagree; set one of them")
    kv = a if a is not None else b if b is not None else self.num_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(f"num_kv_heads={kv} must divide num_heads="
                       f"{self.num_heads}")
    return kv

  @nn.compact
  def __call__(self, x, cu_seqlens, cu_seqlens_padded, position_ids=None):
    """Projects, rotates, attends (context parallel) and projects back.

    Args:
      x: ``[B, T, E]`` or ``[T, E]``: the whole row in ``reorder_for_cp``
        layout (global view) or this rank's chunk (local view).
      cu_seqlens: int ``[B, N+1]`` / ``[N+1]`` global valid lengths.
      cu_seqlens_padded: int ``[B, N+1]`` / ``[N+1]`` global padded lengths.
      position_ids: int ``[B, T]`` / ``[T]`` per-document positions in the
        layout of ``x``; default: derived from ``cu_seqlens_padded``.

    Returns:
      ``[.., T, out_features]``.
    """
    cp_size = settings.check_tokens(self, x.shape[-2], cu_seqlens_padded, "x")
    settings.check_position_ids(position_ids, x.shape)
    features = x.shape[-1]
    head_dim = self.head_dim or features // self.num_heads
    if head_dim < 1:
      raise ValueError(f"head_dim must be positive; got E={features} with "
                       f"num_heads={self.num_heads}")
    dense = lambda heads, name: nn.DenseGeneral(
        (heads, head_dim), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, name=name)
    q = dense(self.num_heads, "query")(x)
    k = dense(self.kv_heads, "key")(x)
    v = dense(self.kv_heads, "value")(x)
    if self.rope_theta is not None:
      if position_ids is None:
        position_ids = default_position_ids(self, cu_seqlens_padded,
                                            x.shape[-2], cp_size)
      q = apply_rotary(q, position_ids, self.rope_theta)
      k = apply_rotary(k, position_ids, self.rope_theta)
    out = DotProductAttention(attn_mask_type=self.attn_mask_type,
                              window_size=self.window_size,
                              softmax_scale=self.softmax_scale,
                              dtype=self.dtype,
                              **settings.cp_settings(self),
                              name="attention")(q, k, v, cu_seqlens,
                                                cu_seqlens_padded)
    return nn.DenseGeneral(self.out_features or features, axis=(-2, -1),
                           use_bias=self.use_bias, dtype=self.dtype,
                           param_dtype=self.param_dtype,
                           kernel_init=self.kernel_init,
                           bias_init=self.bias_init, name="out")(out)
