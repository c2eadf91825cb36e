"""Flax NNX attention modules over packed THD rows with context parallelism.

The NNX counterparts of :mod:`jax_cp.flax.attention`: the same math, the
same parameter names and shapes (a checkpoint converts with
:mod:`jax_cp.nnx.convert`). The layout, a :class:`jax_cp.CPLayout`, is
static module configuration (a plain attribute, not an ``nnx.Variable``):
``nnx.split`` puts it in the graph definition, so ``nnx.jit`` and
``nnx.value_and_grad`` trace one program per layout and forward and
backward see the same one. Views as in the Linen modules: ``"global"``
under ``jit`` with a mesh, ``"local"`` inside the caller's ``shard_map``;
without a layout, no CP. Attention is :func:`jax_cp.cp_attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
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
default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class DotProductAttention(nnx.Module):
  """Causal dot-product attention over packed documents, context parallel.

  See docs/concepts.md.

  No parameters. Queries ``[B, T, Hq, D]`` (or ``[T, Hq, D]``), keys and
  values ``[.., T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA); returns the
  attention output shaped like the queries. Records the strategy it used as
  an int as ``nnx.Intermediate`` ``cp_strategy_code`` when called under
  ``nnx.capture(..., nnx.Intermediate)`` (the NNX form of a mutable Linen
  collection; outside it nothing is recorded and the module's state is
  unchanged); :func:`jax_cp.modules.settings.strategy_from_code` turns it
  back into the strategy.

  Args:
    attn_mask_type: ``"causal"`` (default) or ``"no_mask"``.
    window_size: ``None`` (default; plain causal) or a causal sliding window
      ``(left, 0)``: a query at document position ``i`` sees keys
      ``[i - left, i]``. Per module, so one model can mix local and global
      layers.
    softmax_scale: scale of ``q @ k^T`` (default ``1/sqrt(D)``).
    dtype: computation dtype; q, k, v are cast to it (default: unchanged).
    layout: the :class:`jax_cp.CPLayout` (``None``: no CP).
  """

  def __init__(self, *, attn_mask_type: str = "causal",
               window_size: tuple[int, int] | None = None,
               softmax_scale: float | None = None,
               dtype: Dtype | None = None,
               layout: CPLayout | None = None):
    inputs.module_layout(layout)
    check_window_size(window_size, attn_mask_type)
    self.attn_mask_type = attn_mask_type
    self.window_size = None if window_size is None else tuple(window_size)
    self.softmax_scale = softmax_scale
    self.dtype = dtype
    self.layout = layout

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
    if hasattr(self, "__captures__"):   # set by nnx.capture for the call
      self.sow(nnx.Intermediate, "cp_strategy_code",
               jnp.int32(settings.STRATEGY_CODES[layout.strategy]))
    return out


class MultiHeadAttention(nnx.Module):
  """Self-attention with Q/K/V/out projections, GQA and rotary embeddings,
  over packed documents, context parallel.

  See docs/concepts.md.

  ``x [B, T, in_features] -> [B, T, out_features or in_features]`` (also
  ``[T, E]``). Parameters ``query``/``key``/``value`` (kernels ``[E, H,
  D]``) and ``out`` (``[H, D, E_out]``), as in
  :class:`jax_cp.flax.MultiHeadAttention`.

  Args:
    num_heads: number of query heads.
    in_features: features of ``x`` (``E``).
    num_kv_heads: number of key/value heads (GQA/MQA); must divide
      ``num_heads``. Default: ``num_heads``.
    head_dim: per-head features (default ``in_features // num_heads``).
    out_features: output features (default ``in_features``).
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
    layout: the :class:`jax_cp.CPLayout` (``None``: no CP), passed to the
      :class:`DotProductAttention` unchanged.
    remat: ``"none"`` (default), a preset name or a ``jax.checkpoint``
      policy: what the backward keeps of the block's activations
      (:func:`jax_cp.remat_policy`); the block runs under ``nnx.remat``
      with that policy otherwise.
    rngs: the random streams of the initializers.
  """

  def __init__(self, num_heads: int, in_features: int, *,
               num_kv_heads: int | None = None,
               head_dim: int | None = None,
               out_features: int | None = None,
               rope_theta: float | None = 10000.0,
               use_bias: bool = False,
               softmax_scale: float | None = None,
               attn_mask_type: str = "causal",
               window_size: tuple[int, int] | None = None,
               dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = default_bias_init,
               layout: CPLayout | None = None,
               remat: str | Callable = "none",
               rngs: nnx.Rngs):
    inputs.module_layout(layout)
    remat_policy(remat)
    self.remat = remat
    self.num_heads = num_heads
    self.num_kv_heads = settings.num_kv_heads(num_heads, num_kv_heads)
    self.in_features = in_features
    self.head_dim = settings.head_features(in_features, num_heads, head_dim)
    self.out_features = out_features or in_features
    self.rope_theta = rope_theta
    self.layout = layout
    dense = lambda heads: nnx.LinearGeneral(
        in_features, (heads, self.head_dim), use_bias=use_bias, dtype=dtype,
        param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, rngs=rngs)
    self.query = dense(num_heads)
    self.key = dense(self.num_kv_heads)
    self.value = dense(self.num_kv_heads)
    self.attention = DotProductAttention(
        attn_mask_type=attn_mask_type, window_size=window_size,
        softmax_scale=softmax_scale, dtype=dtype, layout=layout)
    self.out = nnx.LinearGeneral(
        (num_heads, self.head_dim), self.out_features, axis=(-2, -1),
        use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)

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
    if x.shape[-1] != self.in_features:
      raise ValueError(f"x has {x.shape[-1]} features, the module was built "
                       f"for in_features={self.in_features}")
    body = lambda module, x, pos: module._attend(x, cu_seqlens,
                                                 cu_seqlens_padded, pos)
    return remat_call(nnx.remat, self.remat, body, self, x, position_ids)

  def _attend(self, x, cu_seqlens, cu_seqlens_padded, position_ids,
              window=None):
    """The block; with a layer chunk's ``window``
    (:class:`jax_cp.modules.layer_chunks.Window`) ``x`` is the window's
    tokens, the output its chunk's (the last ``window.queries``), and the
    metadata are not read."""
    xq = x if window is None else x[..., -window.queries:, :]
    q, k, v = inputs.rotate_qkv(self.query(xq), self.key(x), self.value(x),
                                self.rope_theta, position_ids)
    if window is None:
      out = self.attention(q, k, v, cu_seqlens, cu_seqlens_padded)
    else:
      dpa = self.attention
      if dpa.dtype is not None:
        q, k, v = (a.astype(dpa.dtype) for a in (q, k, v))
      out = layer_chunks.attend_window(
          inputs.module_layout(self.layout), q, k, v, window,
          window_size=dpa.window_size, softmax_scale=dpa.softmax_scale)
    return checkpoint_name(self.out(out), OUT_PROJ)
