"""A pre-norm transformer layer over packed documents, context parallel,
as a Flax NNX module (the counterpart of :mod:`jax_cp.flax.transformer`)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_cp.checkpoint_names import MLPWO
from jax_cp.cp.layout import CPBatch, CPLayout
from jax_cp.modules import inputs, layer_chunks, settings, token_chunks
from jax_cp.modules.remat import call as remat_call
from jax_cp.modules.remat import layer_input, remat_policy
from jax_cp.nnx.attention import (
  Dtype,
  Initializer,
  MultiHeadAttention,
  default_kernel_init,
)
from jax_cp.typing import Array, ArrayLike


class MlpBlock(nnx.Module):
  """Position-wise feed-forward block ``E -> mlp_dim -> E``; with a
  ``"swiglu"``/``"geglu"`` activation the hidden layer is gated.

  See docs/long_rows.md.

  Parameters ``up``, ``down`` (and ``gate`` when gated), as in
  :class:`jax_cp.flax.MlpBlock`.

  Args:
    in_features: features of the input (and output).
    mlp_dim: hidden features.
    activation: ``"gelu"``, ``"relu"``, ``"silu"``, ``"swiglu"`` or
      ``"geglu"``.
    use_bias: whether the dense layers have biases.
    dtype: computation dtype.
    param_dtype: dtype of the parameters.
    kernel_init: initializer of the kernels.
    layout: the :class:`jax_cp.CPLayout` of ``x`` (``None``: no CP); in
      the global view the hidden activations keep the tokens' sharding
      (:meth:`jax_cp.CPLayout.shard_tokens`). No parameters depend on it.
    chunk_size: None (default: all tokens at once) or a positive int: the
      block runs over at most this many of each rank's tokens at a time
      (a shorter last chunk takes the rest), in a loop whose backward
      re-runs each chunk's forward, so one chunk's hidden activations are
      live at a time, forward and backward, as
      :func:`jax_cp.modules.token_chunks.map_token_chunks`.
    rngs: the random streams of the initializers.
  """

  def __init__(self, in_features: int, mlp_dim: int, *,
               activation: str = "gelu", use_bias: bool = False,
               dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               layout: CPLayout | None = None,
               chunk_size: int | None = None,
               rngs: nnx.Rngs):
    settings.check_activation(activation)
    token_chunks.check_chunk_size(chunk_size, "chunk_size", auto=False)
    self.chunk_size = chunk_size
    self.layout = inputs.module_layout(layout) if layout is not None \
        else None
    self.activation = activation
    dense = lambda i, o: nnx.Linear(
        i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, rngs=rngs)
    if activation in settings.GATED:
      self.gate = dense(in_features, mlp_dim)
    self.up = dense(in_features, mlp_dim)
    self.down = dense(mlp_dim, in_features)

  def __call__(self, x: ArrayLike, *, pin: Callable | None = None
               ) -> Array:
    """``[.., T, E] -> [.., T, E]``; ``pin``: the sharding constraint of
    the hidden activations and the output (default: the layout's
    :meth:`jax_cp.CPLayout.shard_tokens`; a chunk of a chunked
    :class:`TransformerLayer` passes its own)."""
    layout = inputs.module_layout(self.layout)
    if pin is not None or self.chunk_size is None:
      return self._apply(x, pin or layout.shard_tokens)
    graphdef, state = nnx.split(self)
    fn = lambda xc, pin: nnx.merge(graphdef, state)._apply(xc, pin)
    return token_chunks.map_token_chunks(fn, x, self.chunk_size, layout,
                                   layout.resolve_cp_size())

  def _apply(self, x, pin):
    h = settings.mlp_hidden(self.activation, lambda: self.up(x),
                          lambda: self.gate(x), pin)
    return checkpoint_name(pin(self.down(h)), MLPWO)


class TransformerLayer(nnx.Module):
  """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

  See docs/long_rows.md.

  Causal self-attention over packed documents with rotary embeddings and
  GQA; context parallel through ``layout``, which the layer passes
  unchanged to its :class:`MultiHeadAttention` (and on to its
  :class:`jax_cp.nnx.DotProductAttention`). No dropout. Parameters
  ``pre_attention_norm``, ``attention``, ``pre_mlp_norm``, ``mlp``, as in
  :class:`jax_cp.flax.TransformerLayer`.

  Args:
    num_heads: number of query heads.
    in_features: features of ``x`` (``E``).
    num_kv_heads: number of key/value heads (default ``num_heads``).
    head_dim: per-head features (default ``E // num_heads``).
    mlp_dim: hidden features of the MLP (default ``4 * E``).
    mlp_activation: see :class:`MlpBlock`.
    norm_type: ``"rmsnorm"`` (default) or ``"layernorm"``.
    norm_epsilon: epsilon of the norms.
    rope_theta: rotary base; ``None`` disables rotary embeddings.
    window_size: ``None`` (global attention) or a causal sliding window
      ``(left, 0)`` for this layer: a query at document position ``i`` sees
      keys ``[i - left, i]`` (alternate it per layer for local/global
      models).
    use_bias: biases in the projections and the MLP.
    dtype: computation dtype.
    param_dtype: dtype of the parameters.
    kernel_init: initializer of all kernels.
    layout: the :class:`jax_cp.CPLayout` (``None``: no CP): its view
      ``"global"`` runs under ``jit`` with a mesh, ``"local"`` inside the
      caller's ``shard_map``.
    remat: ``"none"`` (default), a preset name or a ``jax.checkpoint``
      policy, as in :class:`jax_cp.flax.TransformerLayer`; the layer runs
      under ``nnx.remat`` with that policy otherwise.
    mlp_chunk_size: ``"auto"`` (default), None (whole rows) or a positive
      int: tokens per chunk (of each rank's) of the position-wise part,
      as in :class:`jax_cp.flax.TransformerLayer`.
    layer_chunk_size: None (default) or a positive int: tokens per chunk
      of the whole layer, each reading a halo of the tokens before it, as
      in :class:`jax_cp.flax.TransformerLayer`; one rank only.
    rngs: the random streams of the initializers.
  """

  def __init__(self, num_heads: int, in_features: int, *,
               num_kv_heads: int | None = None,
               head_dim: int | None = None,
               mlp_dim: int | None = None,
               mlp_activation: str = "gelu",
               norm_type: str = "rmsnorm",
               norm_epsilon: float = 1e-6,
               rope_theta: float | None = 10000.0,
               window_size: tuple[int, int] | None = None,
               use_bias: bool = False,
               dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32,
               kernel_init: Initializer = default_kernel_init,
               layout: CPLayout | None = None,
               remat: str | Callable = "none",
               mlp_chunk_size: int | str | None = "auto",
               layer_chunk_size: int | None = None,
               rngs: nnx.Rngs):
    inputs.module_layout(layout)
    settings.check_norm_type(norm_type)
    remat_policy(remat)
    token_chunks.check_chunk_size(mlp_chunk_size, "mlp_chunk_size")
    token_chunks.check_chunk_size(layer_chunk_size, "layer_chunk_size",
                                  auto=False)
    self.layout = layout
    self.remat = remat
    self.mlp_chunk_size = mlp_chunk_size
    self.layer_chunk_size = layer_chunk_size
    norm_cls = nnx.RMSNorm if norm_type == "rmsnorm" else nnx.LayerNorm
    norm = lambda: norm_cls(in_features, epsilon=norm_epsilon, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)
    self.pre_attention_norm = norm()
    self.attention = MultiHeadAttention(
        num_heads, in_features, num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta, window_size=window_size, use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype, kernel_init=kernel_init, layout=layout,
        rngs=rngs)
    self.pre_mlp_norm = norm()
    self.mlp = MlpBlock(in_features, mlp_dim or 4 * in_features,
                        activation=mlp_activation, use_bias=use_bias,
                        dtype=dtype, param_dtype=param_dtype,
                        kernel_init=kernel_init, layout=layout, rngs=rngs)

  def __call__(self, x: ArrayLike, cu_seqlens: CPBatch | ArrayLike,
               cu_seqlens_padded: ArrayLike | None = None,
               position_ids: ArrayLike | None = None) -> Array:
    """Applies the layer.

    Args:
      x: ``[B, T, E]`` (or ``[T, E]``): the whole row in
        :func:`jax_cp.data.reorder_for_cp` layout sharded over the cp axis
        (global view), or this rank's chunk (local view).
      cu_seqlens: int ``[B, N+1]`` global valid lengths, or a
        :class:`jax_cp.CPBatch` holding both metadata arrays.
      cu_seqlens_padded: int ``[B, N+1]`` global padded lengths (omitted
        with a batch).
      position_ids: int ``[B, T]`` per-document positions in the layout of
        ``x`` (default: derived from ``cu_seqlens_padded``).

    Returns:
      ``[B, T, E]``, same layout as ``x``.
    """
    layout, position_ids = inputs.call_inputs(
        self.layout, x.shape, cu_seqlens, cu_seqlens_padded, position_ids,
        "TransformerLayer", self.attention.rope_theta)
    body = lambda layer, x, pos: layer._layer(layout, x, cu_seqlens,
                                              cu_seqlens_padded, pos)
    return remat_call(nnx.remat, self.remat, body, self, x, position_ids)

  def _layer(self, layout, x, cu_seqlens, cu_seqlens_padded, position_ids):
    x = layer_input(x)
    plan = layer_chunks.layer_chunk_plan(self.layer_chunk_size, layout, x.shape,
                                   self.attention.attention.window_size)
    if plan is not None:
      return self._chunked(layout, plan, x, cu_seqlens, cu_seqlens_padded,
                           position_ids)
    h = x + layout.shard_tokens(self.attention(
        self.pre_attention_norm(x), cu_seqlens, cu_seqlens_padded,
        position_ids))
    cp = layout.resolve_cp_size()
    chunk = token_chunks.mlp_chunk_tokens(
        self.mlp_chunk_size, self.remat,
        h.shape[-2] // token_chunks.token_groups(layout, cp), h.shape[-1],
        self.mlp.up.out_features * (2 if self.mlp.activation in settings.GATED
                                    else 1))
    if chunk is None:
      return h + self.mlp(self.pre_mlp_norm(h))
    graphdef, state = nnx.split((self.pre_mlp_norm, self.mlp))

    def position_wise(hc, pin):
      norm, mlp = nnx.merge(graphdef, state)
      return hc + mlp(norm(hc), pin=pin)

    return token_chunks.map_token_chunks(position_wise, h, chunk, layout, cp)

  def _chunked(self, layout, plan, x, cu_seqlens, cu_seqlens_padded,
               position_ids):
    """The layer over the chunks of ``plan`` (``layer_chunk_size``)."""
    graphdef, state = nnx.split((self.pre_attention_norm, self.attention,
                                 self.pre_mlp_norm, self.mlp))
    pin = layout.shard_tokens

    def make_fn(window):
      def fn(xw, pos):
        norm1, attn, norm2, mlp = nnx.merge(graphdef, state)
        a = attn._attend(norm1(xw), None, None, pos, window)
        h = xw[..., -window.queries:, :] + pin(a)
        return h + mlp(norm2(h), pin=pin)
      return fn

    return layer_chunks.run_layer_chunks(make_fn, layout, x, position_ids,
                                   cu_seqlens, cu_seqlens_padded, plan)
