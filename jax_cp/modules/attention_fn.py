"""A drop-in ``attention_fn`` for Flax's own multi-head attention modules.

``flax.nnx.MultiHeadAttention(..., attention_fn=cp_attention_fn(layout))``
and ``flax.linen.MultiHeadDotProductAttention(...,
attention_fn=cp_attention_fn(layout))`` run packed CP attention: the
packing metadata arrive as the module's ``mask`` argument, a
:class:`jax_cp.CPBatch` (``mha(x, mask=batch)``), whose layout is checked
against ``layout``. Flax builds the projections; the attention itself is
:func:`jax_cp.cp_attention` with the layout (or the batch's), causal
within each document.
"""

from __future__ import annotations

from collections.abc import Callable

from jax_cp.attention.validation import check_window_size
from jax_cp.cp.api import cp_attention
from jax_cp.cp.layout import CPBatch, CPLayout, check_layout


def cp_attention_fn(layout: CPLayout | None = None, *,
                    attn_mask_type: str = "causal",
                    window_size: tuple[int, int] | None = None,
                    softmax_scale: float | None = None) -> Callable:
  """An ``attention_fn`` for Flax's multi-head attention modules.

  See docs/concepts.md.

  Args:
    layout: the :class:`jax_cp.CPLayout` of the tokens. ``None``: the
      layout of the batch given as ``mask``.
    attn_mask_type: ``"causal"`` (default) or ``"no_mask"``, within each
      document.
    window_size: ``None`` or a causal sliding window ``(left, 0)``: a query
      at document position ``i`` sees keys ``[i - left, i]``.
    softmax_scale: scale of ``q @ k^T`` (default ``1/sqrt(D)``).

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` with
    Flax's signature, where ``mask`` must be a :class:`jax_cp.CPBatch`
    holding ``cu_seqlens`` and ``cu_seqlens_padded``. ``dtype`` casts q, k,
    v; ``is_causal`` and ``precision`` are not used (the mask type is
    ``attn_mask_type``; the backend picks its precision).

  Raises:
    ValueError (when called): no metadata (``mask`` None), a mask array
      instead of a batch, a batch of another layout, a ``bias``, active
      dropout, or sown attention weights, none of which packed CP attention
      supports.
  """
  if layout is not None:
    check_layout(layout, "cp_attention_fn")
  check_window_size(window_size, attn_mask_type)

  def attention_fn(query, key, value, bias=None, mask=None,
                   broadcast_dropout: bool = True, dropout_rng=None,
                   dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype=None, precision=None, module=None,
                   is_causal: bool = False, **unsupported):
    del broadcast_dropout, dropout_rng, precision, is_causal
    if mask is None:
      raise ValueError(
          "cp_attention_fn needs the packing metadata: call the attention "
          "module with mask=batch, a jax_cp.CPBatch holding cu_seqlens and "
          "cu_seqlens_padded (e.g. from jax_cp.data.make_global_batch)")
    if not isinstance(mask, CPBatch):
      raise ValueError(
          f"cp_attention_fn takes the packing metadata as mask, a "
          f"jax_cp.CPBatch; got {type(mask).__name__}. Packed attention "
          "builds its document mask from cu_seqlens/cu_seqlens_padded")
    if bias is not None:
      raise ValueError("cp_attention_fn does not support an attention bias")
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError("cp_attention_fn does not support attention dropout "
                       f"(dropout_rate={dropout_rate}); use dropout_rate=0 "
                       "or deterministic=True")
    if module is not None:
      raise ValueError("cp_attention_fn cannot sow attention weights "
                       "(sow_weights=True): it never forms them")
    given = {k: v for k, v in unsupported.items() if v is not None}
    if given:
      raise ValueError(f"cp_attention_fn does not support {sorted(given)}")
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    return cp_attention(query, key, value, mask, layout=layout,
                        attn_mask_type=attn_mask_type,
                        window_size=window_size, softmax_scale=softmax_scale)

  return attention_fn
