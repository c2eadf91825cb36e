"""Linen attention modules over packed THD rows with context parallelism.

Every module takes one static ``layout`` field, a :class:`jax_cp.CPLayout`
(``None``: no CP), and hands it to its children. Two views (the layout's
``view``):

* **global view** (``view="global"``, the default): call the module under
  ``jit`` with a mesh (the layout's ``mesh`` or ``jax.set_mesh``). Token
  arrays hold the *whole* row in :func:`jax_cp.data.reorder_for_cp`
  layout, their token axis sharded over ``cp_axis``; attention opens its
  own ``shard_map``.
* **local view** (``view="local"``): call the module inside your own
  ``jax.shard_map``; token arrays hold this rank's chunk (as produced by
  :func:`jax_cp.data.get_batch_on_this_cp_rank`).

In both views ``cu_seqlens`` / ``cu_seqlens_padded`` are the *global* row
metadata ``[B, N+1]`` (``[N+1]`` for unbatched inputs), or a
:class:`jax_cp.CPBatch` in place of ``cu_seqlens``, whose layout must match
the module's; attention is :func:`jax_cp.cp_attention` with the module's
layout. Without a layout the row is attended whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_cp.attention.validation import check_window_size
from jax_cp.checkpoint_names import OUT_PROJ
from jax_cp.cp.layout import CPBatch, CPLayout
from jax_cp.modules import inputs, layer_chunks, settings
from jax_cp.modules.remat import call as remat_call
from jax_cp.modules.remat import remat_policy
from jax_cp.typing import Array, ArrayLike

Dtype = Any
Initializer = Callable[..., jax.Array]


class DotProductAttention(nn.Module):
  """Causal dot-product attention over packed documents, context parallel.

  See docs/concepts.md.

  No parameters. Queries ``[B, T, Hq, D]`` (or ``[T, Hq, D]``), keys and
  values ``[.., T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA); returns the
  attention output shaped like the queries. Records the strategy it used as
  an int under ``intermediates/cp_strategy_code`` when that collection is
  mutable (:func:`jax_cp.modules.settings.strategy_from_code` turns it back
  into the strategy).

  Attributes:
    attn_mask_type: ``"causal"`` (default) or ``"no_mask"``.
    window_size: ``None`` (default; plain causal) or a causal sliding window
      ``(left, 0)``: a query at document position ``i`` sees keys
      ``[i - left, i]``. Per module, so one model can mix local and global
      layers.
    softmax_scale: scale of ``q @ k^T`` (default ``1/sqrt(D)``).
    dtype: computation dtype; q, k, v are cast to it (default: unchanged).
    layout: the :class:`jax_cp.CPLayout` (static): cp axis and size,
      strategy, exchange, backend, ``max_seqlen``, mesh, batch/head axes and
      view. ``None``: no CP.
  """

  attn_mask_type: str = "causal"
  window_size: tuple[int, int] | None = None
  softmax_scale: float | None = None
  dtype: Dtype | None = None
  layout: CPLayout | None = None

  def __post_init__(self):
    inputs.module_layout(self.layout)
    check_window_size(self.window_size, self.attn_mask_type)
    super().__post_init__()

  @nn.compact
  def __call__(self, query: ArrayLike, key: ArrayLike, value: ArrayLike,
               cu_seqlens: CPBatch | ArrayLike,
               cu_seqlens_padded: ArrayLike | None = None) -> Array:
    """Attends packed queries to keys/values of the same documents.

    Args:
      query: ``[B, T, Hq, D]`` or ``[T, Hq, D]`` (T: the whole row in the
        global view, this rank's chunk in the local view).
      key: ``[.., T, Hkv, D]``.
      value: ``[.., T, Hkv, D]``.
      cu_seqlens: int ``[B, N+1]`` / ``[N+1]`` global valid lengths, or a
        :class:`jax_cp.CPBatch` holding both metadata arrays.
      cu_seqlens_padded: int ``[B, N+1]`` / ``[N+1]`` global padded lengths
        (omitted with a batch).

    Returns:
      ``[.., T, Hq, D]`` in the layout of ``query``; 0 on padding tokens.
    """
    out, layout = inputs.dot_product_attention(
        self.layout, query, key, value, cu_seqlens, cu_seqlens_padded,
        dtype=self.dtype, attn_mask_type=self.attn_mask_type,
        window_size=self.window_size, softmax_scale=self.softmax_scale)
    self.sow("intermediates", "cp_strategy_code",
             jnp.int32(settings.STRATEGY_CODES[layout.strategy]))
    return out


class MultiHeadAttention(nn.Module):
  """Self-attention with Q/K/V/out projections, GQA and rotary embeddings,
  over packed documents, context parallel.

  See docs/concepts.md.

  ``x [B, T, E] -> [B, T, out_features or E]`` (also ``[T, E]``). Rotary
  position embeddings use ``position_ids`` (per-document positions in the
  layout of ``x``); when omitted they are derived from
  ``cu_seqlens_padded``.

  Attributes:
    num_heads: number of query heads.
    num_kv_heads: number of key/value heads (GQA/MQA); must divide
      ``num_heads``. Default: ``num_heads``.
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
    layout: the :class:`jax_cp.CPLayout` (static; ``None``: no CP), passed
      to :class:`DotProductAttention` unchanged.
    remat: ``"none"`` (default), a preset name or a ``jax.checkpoint``
      policy: what the backward keeps of the block's activations
      (:func:`jax_cp.remat_policy`); the block runs under ``nn.remat``
      with that policy otherwise.
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  out_features: int | None = None
  rope_theta: float | None = 10000.0
  use_bias: bool = False
  softmax_scale: float | None = None
  attn_mask_type: str = "causal"
  window_size: tuple[int, int] | None = None
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  layout: CPLayout | None = None
  remat: str | Callable = "none"

  def __post_init__(self):
    inputs.module_layout(self.layout)
    check_window_size(self.window_size, self.attn_mask_type)
    remat_policy(self.remat)
    # The field holds the resolved count, as the NNX module's attribute.
    self.num_kv_heads = settings.num_kv_heads(
        self.num_heads, self.num_kv_heads)
    super().__post_init__()

  def __call__(self, x: ArrayLike, cu_seqlens: CPBatch | ArrayLike,
               cu_seqlens_padded: ArrayLike | None = None,
               position_ids: ArrayLike | None = None) -> Array:
    """Projects, rotates, attends (context parallel) and projects back.

    Args:
      x: ``[B, T, E]`` or ``[T, E]``: the whole row in ``reorder_for_cp``
        layout (global view) or this rank's chunk (local view).
      cu_seqlens: int ``[B, N+1]`` / ``[N+1]`` global valid lengths, or a
        :class:`jax_cp.CPBatch` holding both metadata arrays.
      cu_seqlens_padded: int ``[B, N+1]`` / ``[N+1]`` global padded lengths
        (omitted with a batch).
      position_ids: int ``[B, T]`` / ``[T]`` per-document positions in the
        layout of ``x``; default: derived from ``cu_seqlens_padded``.

    Returns:
      ``[.., T, out_features]``.
    """
    _, position_ids = inputs.call_inputs(
        self.layout, x.shape, cu_seqlens, cu_seqlens_padded, position_ids,
        "MultiHeadAttention", self.rope_theta)
    body = lambda module, x, pos: module._attend(x, cu_seqlens,
                                                 cu_seqlens_padded, pos)
    return remat_call(nn.remat, self.remat, body, self, x, position_ids)

  @nn.compact
  def _attend(self, x, cu_seqlens, cu_seqlens_padded, position_ids,
              window=None):
    """The block; with a layer chunk's ``window``
    (:class:`jax_cp.modules.layer_chunks.Window`) ``x`` is the window's
    tokens, the output its chunk's (the last ``window.queries``), and the
    metadata are not read."""
    features = x.shape[-1]
    head_dim = settings.head_features(features, self.num_heads, self.head_dim)
    dense = lambda heads, name: nn.DenseGeneral(
        (heads, head_dim), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        bias_init=self.bias_init, name=name)
    xq = x if window is None else x[..., -window.queries:, :]
    q = dense(self.num_heads, "query")(xq)
    k = dense(self.num_kv_heads, "key")(x)
    v = dense(self.num_kv_heads, "value")(x)
    q, k, v = inputs.rotate_qkv(q, k, v, self.rope_theta, position_ids)
    if window is not None:
      if self.dtype is not None:
        q, k, v = (a.astype(self.dtype) for a in (q, k, v))
      out = layer_chunks.attend_window(
          inputs.module_layout(self.layout), q, k, v, window,
          window_size=self.window_size, softmax_scale=self.softmax_scale)
    else:
      out = DotProductAttention(attn_mask_type=self.attn_mask_type,
                                window_size=self.window_size,
                                softmax_scale=self.softmax_scale,
                                dtype=self.dtype, layout=self.layout,
                                name="attention")(q, k, v, cu_seqlens,
                                                  cu_seqlens_padded)
    out = nn.DenseGeneral(self.out_features or features, axis=(-2, -1),
                          use_bias=self.use_bias, dtype=self.dtype,
                          param_dtype=self.param_dtype,
                          kernel_init=self.kernel_init,
                          bias_init=self.bias_init, name="out")(out)
    return checkpoint_name(out, OUT_PROJ)
