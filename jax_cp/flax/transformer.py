"""A pre-norm transformer layer over packed documents, context parallel."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_cp.attention.validation import check_window_size
from jax_cp.checkpoint_names import MLPWO
from jax_cp.cp.layout import CPBatch, CPLayout
from jax_cp.flax.attention import Dtype, Initializer, MultiHeadAttention
from jax_cp.modules import inputs, layer_chunks, settings, token_chunks
from jax_cp.modules.remat import call as remat_call
from jax_cp.modules.remat import layer_input, remat_policy
from jax_cp.typing import Array, ArrayLike


class MlpBlock(nn.Module):
  """Position-wise feed-forward block ``E -> mlp_dim -> E``; with a
  ``"swiglu"``/``"geglu"`` activation the hidden layer is gated.

  See docs/long_rows.md.

  Attributes:
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
  """

  mlp_dim: int
  activation: str = "gelu"
  use_bias: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  layout: CPLayout | None = None
  chunk_size: int | None = None

  def __post_init__(self):
    settings.check_activation(self.activation)
    token_chunks.check_chunk_size(self.chunk_size, "chunk_size", auto=False)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: ArrayLike, *, pin: Callable | None = None
               ) -> Array:
    """``[.., T, E] -> [.., T, E]``; ``pin``: the sharding constraint of
    the hidden activations and the output (default: the layout's
    :meth:`jax_cp.CPLayout.shard_tokens`; a chunk of a chunked
    :class:`TransformerLayer` passes its own)."""
    dense = lambda n, name: nn.Dense(
        n, use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init, name=name)
    layers = {"up": dense(self.mlp_dim, "up"),
              "down": dense(x.shape[-1], "down")}
    if self.activation in settings.GATED:
      layers["gate"] = dense(self.mlp_dim, "gate")
    layout = inputs.module_layout(self.layout)

    def apply(layers, x, pin):
      h = settings.mlp_hidden(self.activation, lambda: layers["up"](x),
                            lambda: layers["gate"](x), pin)
      return checkpoint_name(pin(layers["down"](h)), MLPWO)

    if pin is not None or self.chunk_size is None:
      return apply(layers, x, pin or layout.shard_tokens)
    cp = layout.resolve_cp_size()
    if self.chunk_size >= x.shape[-2] // token_chunks.token_groups(layout, cp):
      return apply(layers, x, layout.shard_tokens)
    if self.is_initializing():    # creates the parameters on one token
      apply(layers, jnp.zeros((1, x.shape[-1]), x.dtype), lambda v: v)
    unbound = {k: m.unbind() for k, m in layers.items()}
    fn = lambda xc, pin: apply(
        {k: functools.partial(m.apply, v) for k, (m, v) in unbound.items()},
        xc, pin)
    return token_chunks.map_token_chunks(fn, x, self.chunk_size, layout, cp)


class TransformerLayer(nn.Module):
  """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

  Causal self-attention over packed documents with rotary embeddings and
  GQA; context parallel through the ``layout`` field, which the layer
  passes unchanged to its :class:`MultiHeadAttention` (and on to
  :class:`DotProductAttention`): setting it here is enough. No dropout.

  Attributes:
    num_heads: number of query heads.
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
    layout: the :class:`jax_cp.CPLayout` (static; ``None``: no CP): its
      view ``"global"`` runs under ``jit`` with a mesh, ``"local"`` inside
      the caller's ``shard_map``.
    remat: ``"none"`` (default), a preset name (``"save_context"``,
      ``"minimal"``, ``"minimal_with_context"``, ``"full"``) or a
      ``jax.checkpoint`` policy: what the backward keeps of the layer's
      activations (:func:`jax_cp.remat_policy`). The layer runs under
      ``nn.remat`` with that policy otherwise.
    mlp_chunk_size: the position-wise part (the pre-MLP norm, the MLP and
      its residual add) over chunks of this many of each rank's tokens, one
      chunk's MLP activations live at a time, forward and backward
      (:func:`jax_cp.modules.token_chunks.map_token_chunks`). ``"auto"``
      (default): whole rows under ``remat="none"`` or up to 8192 tokens per
      rank, else chunks of at least 8192 tokens
      (:func:`jax_cp.modules.token_chunks.mlp_chunk_tokens`); None: whole
      rows; a positive int: tokens per chunk.
    layer_chunk_size: None (default: the row at once) or a positive int:
      the whole layer over chunks of this many tokens of the row, each
      reading a halo of the ``max_seqlen - 1`` tokens before it (a sliding
      window's ``left``, when shorter), so the layer keeps per token only
      its input, output and their cotangents
      (:mod:`jax_cp.modules.layer_chunks`). Replaces ``mlp_chunk_size``.
      One rank only (cp size 1); needs the layout's ``max_seqlen`` or a
      window, and a chunk of at least the halo.

  docs/long_rows.md says when to choose each of ``remat``,
  ``mlp_chunk_size`` and ``layer_chunk_size``, and what they cost.
  """

  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  mlp_dim: int | None = None
  mlp_activation: str = "gelu"
  norm_type: str = "rmsnorm"
  norm_epsilon: float = 1e-6
  rope_theta: float | None = 10000.0
  window_size: tuple[int, int] | None = None
  use_bias: bool = False
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = nn.initializers.lecun_normal()
  layout: CPLayout | None = None
  remat: str | Callable = "none"
  mlp_chunk_size: int | str | None = "auto"
  layer_chunk_size: int | None = None

  def __post_init__(self):
    inputs.module_layout(self.layout)
    check_window_size(self.window_size, "causal")
    remat_policy(self.remat)
    token_chunks.check_chunk_size(self.mlp_chunk_size, "mlp_chunk_size")
    token_chunks.check_chunk_size(self.layer_chunk_size, "layer_chunk_size",
                            auto=False)
    settings.check_norm_type(self.norm_type)
    super().__post_init__()

  def _norm(self, name: str) -> Callable:
    cls = nn.RMSNorm if self.norm_type == "rmsnorm" else nn.LayerNorm
    return cls(epsilon=self.norm_epsilon, dtype=self.dtype,
               param_dtype=self.param_dtype, name=name)

  def __call__(self, x: ArrayLike, cu_seqlens: CPBatch | ArrayLike,
               cu_seqlens_padded: ArrayLike | None = None,
               position_ids: ArrayLike | None = None) -> Array:
    """Applies the layer.

    Args:
      x: ``[B, T, E]`` (or ``[T, E]``): the whole row in
        :func:`jax_cp.data.reorder_for_cp` layout sharded over ``cp_axis``
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
        "TransformerLayer", self.rope_theta)
    body = lambda module, x, pos: module._layer(
        layout, x, cu_seqlens, cu_seqlens_padded, pos)
    return remat_call(nn.remat, self.remat, body, self, x, position_ids)

  @nn.compact
  def _layer(self, layout, x, cu_seqlens, cu_seqlens_padded, position_ids):
    x = layer_input(x)
    attn = MultiHeadAttention(
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        rope_theta=self.rope_theta, window_size=self.window_size,
        use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, kernel_init=self.kernel_init,
        layout=self.layout, name="attention")
    pre_attention_norm = self._norm("pre_attention_norm")
    mlp = MlpBlock(self.mlp_dim or 4 * x.shape[-1],
                   activation=self.mlp_activation, use_bias=self.use_bias,
                   dtype=self.dtype, param_dtype=self.param_dtype,
                   kernel_init=self.kernel_init, layout=self.layout,
                   name="mlp")
    norm = self._norm("pre_mlp_norm")
    plan = layer_chunks.layer_chunk_plan(self.layer_chunk_size, layout, x.shape,
                                   self.window_size)
    if plan is not None:
      return self._chunked(layout, plan, x, cu_seqlens, cu_seqlens_padded,
                           position_ids, pre_attention_norm, attn, norm,
                           mlp)
    h = x + layout.shard_tokens(attn(pre_attention_norm(x), cu_seqlens,
                                     cu_seqlens_padded, position_ids))
    cp = layout.resolve_cp_size()
    mlp_dim = mlp.mlp_dim * (2 if mlp.activation in settings.GATED else 1)
    chunk = token_chunks.mlp_chunk_tokens(
        self.mlp_chunk_size, self.remat,
        h.shape[-2] // token_chunks.token_groups(layout, cp), h.shape[-1],
        mlp_dim)
    if chunk is None:
      return h + mlp(norm(h))
    if self.is_initializing():    # creates the parameters on one token
      mlp(norm(jnp.zeros((1, h.shape[-1]), h.dtype)), pin=lambda v: v)
    (norm_u, norm_v), (mlp_u, mlp_v) = norm.unbind(), mlp.unbind()

    def position_wise(hc, pin):
      return hc + mlp_u.apply(mlp_v, norm_u.apply(norm_v, hc), pin=pin)

    return token_chunks.map_token_chunks(position_wise, h, chunk, layout, cp)

  def _chunked(self, layout, plan, x, cu_seqlens, cu_seqlens_padded,
               position_ids, *modules):
    """The layer over the chunks of ``plan`` (``layer_chunk_size``)."""
    if self.is_initializing():          # creates the parameters
      norm1, attn, norm2, mlp = modules
      window = layer_chunks.init_window(x)
      pos = None if position_ids is None else position_ids[..., :1]
      h = x[..., :1, :] + attn._attend(norm1(x[..., :1, :]), None, None, pos,
                                       window)
      mlp(norm2(h), pin=lambda v: v)
    (n1_u, n1_v), (a_u, a_v), (n2_u, n2_v), (m_u, m_v) = (
        m.unbind() for m in modules)
    pin = layout.shard_tokens

    def make_fn(window):
      def fn(xw, pos):
        a = a_u.apply(a_v, n1_u.apply(n1_v, xw), None, None, pos, window,
                      method=MultiHeadAttention._attend)
        h = xw[..., -window.queries:, :] + pin(a)
        return h + m_u.apply(m_v, n2_u.apply(n2_v, h), pin=pin)
      return fn

    return layer_chunks.run_layer_chunks(make_fn, layout, x, position_ids,
                                   cu_seqlens, cu_seqlens_padded, plan)
