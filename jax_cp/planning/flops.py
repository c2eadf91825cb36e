"""FLOP counts of attention and of a decoder's training step over packed
documents: one counter for the MFU of a training run and the TFLOP/s of the
benchmarks.

The convention is the usual one of model FLOP utilisation (MFU): the FLOPs
the model needs, 2 per multiply-add, nothing recomputed.

* **Matmuls**: ``6`` FLOPs per matmul parameter per token: the forward
  (``2``) and the backward's two products, the input gradient and the
  weight gradient (``4``). Every position of the rows counts, padding
  included (the projections run on it).
* **Attention**, per layer: a document of ``L`` valid tokens has ``pairs =
  L (L + 1) / 2`` causal (query, key) pairs (with a sliding window ``(left,
  0)`` a query sees ``min(j + 1, left + 1)`` keys). The forward is ``4 *
  pairs * num_heads * head_dim`` (``Q K^T`` and ``P V``); the backward
  :data:`BACKWARD_FACTOR` = 2 times the forward (``dP``, ``dV``, ``dQ``,
  ``dK``: four matmuls), so forward + backward is ``12 * pairs * num_heads
  * head_dim``.

Hardware FLOPs: the fused backward of FlashAttention and cuDNN recomputes
``Q K^T`` from the saved log-sum-exp instead of storing the probabilities,
five matmuls, :data:`RECOMPUTE_BACKWARD_FACTOR` = 2.5 times the forward.
``recompute=True`` counts that work (the FLOPs the GPU executes, e.g. for
an attention kernel's TFLOP/s); the MFU of a training step uses the default
``recompute=False``.

Everything here is numpy on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_cp.attention.validation import check_window_size
from jax_cp.planning.pairs import range_pairs
from jax_cp.typing import ArrayLike, WindowSize

#: Attention backward FLOPs / forward FLOPs, MFU convention (no recompute).
BACKWARD_FACTOR = 2.0
#: The same with the recompute of ``Q K^T`` that fused backwards run.
RECOMPUTE_BACKWARD_FACTOR = 2.5
#: FLOPs per matmul parameter per token of forward + backward.
MATMUL_FLOPS_PER_PARAM = 6


def _check_int(value: Any, name: str, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def causal_pairs(cu_seqlens: ArrayLike, window_size: WindowSize = None
                 ) -> int:
  """Causal (query, key) pairs of every document of a batch.

  Args:
    cu_seqlens: int ``[N+1]`` or ``[B, N+1]`` cumulative valid lengths
      (host array).
    window_size: ``None`` or a causal sliding window ``(left, 0)``.

  Returns:
    ``sum L (L + 1) / 2`` over the documents, or with a window ``sum_j
    min(j + 1, left + 1)``.

  Raises:
    ValueError: ``cu_seqlens`` decreases, or a bad ``window_size``.
  """
  left = check_window_size(window_size, "causal")
  lens = np.diff(np.asarray(cu_seqlens, np.int64), axis=-1)
  if (lens < 0).any():
    raise ValueError("cu_seqlens must be non-decreasing along its last axis")
  return int(range_pairs(0, lens, left).sum())


def attention_flops(pairs: int | ArrayLike, *, num_heads: int,
                    head_dim: int, backward: bool = True,
                    recompute: bool = False) -> float | np.ndarray:
  """FLOPs of causal attention over ``pairs`` (query, key) pairs, one layer.

  Args:
    pairs: int, or an int array (e.g. per rank): causal pairs
      (:func:`causal_pairs`).
    num_heads: query heads.
    head_dim: features per head.
    backward: forward + backward (default), or the forward alone.
    recompute: count the backward's recompute of ``Q K^T`` (hardware
      FLOPs of fused kernels, :data:`RECOMPUTE_BACKWARD_FACTOR`) instead of
      the MFU convention (:data:`BACKWARD_FACTOR`).

  Returns:
    ``4 * pairs * num_heads * head_dim`` for the forward (integers stay
    integers), times ``1 + factor`` (a float) with the backward.
  """
  hq = _check_int(num_heads, "num_heads")
  d = _check_int(head_dim, "head_dim")
  if isinstance(pairs, np.integer):
    pairs = int(pairs)
  elif isinstance(pairs, np.ndarray) and np.issubdtype(pairs.dtype,
                                                        np.integer):
    # Python ints: numpy's int64 wraps past 9.2e18 (16M tokens of one
    # document at 128 heads of 128 already does).
    pairs = pairs.astype(object)
  fwd = pairs * (4 * hq * d)
  if not backward:
    return fwd
  factor = RECOMPUTE_BACKWARD_FACTOR if recompute else BACKWARD_FACTOR
  return fwd * (1.0 + factor)


def model_flops(cu_seqlens: ArrayLike, *, tokens: int, matmul_params: int,
                num_layers: int, num_heads: int, head_dim: int,
                window_size: WindowSize = None,
                recompute: bool = False) -> float:
  """Model FLOPs of one training step (forward + backward) of a decoder.

  ``6 * matmul_params * tokens`` plus :func:`attention_flops` of the batch's
  documents in each of ``num_layers`` layers (see the module docstring).

  Args:
    cu_seqlens: int ``[B, N+1]`` (or ``[N+1]``) cumulative valid lengths of
      the step's rows (host array).
    tokens: every position of the step's rows, ``B * T``.
    matmul_params: parameters that take part in matmuls (usually all but
      the embedding table).
    num_layers: attention layers.
    num_heads: query heads per layer.
    head_dim: features per head.
    window_size: ``None`` or every layer's causal window ``(left, 0)``.
    recompute: count the attention backward's recompute (hardware FLOPs).

  Returns:
    The FLOPs, a float.
  """
  tokens = _check_int(tokens, "tokens", 0)
  matmul_params = _check_int(matmul_params, "matmul_params", 0)
  layers = _check_int(num_layers, "num_layers")
  attn = attention_flops(causal_pairs(cu_seqlens, window_size),
                         num_heads=num_heads, head_dim=head_dim,
                         recompute=recompute)
  return float(MATMUL_FLOPS_PER_PARAM * matmul_params * tokens
               + layers * attn)


__all__ = ("BACKWARD_FACTOR", "MATMUL_FLOPS_PER_PARAM",
           "RECOMPUTE_BACKWARD_FACTOR", "attention_flops", "causal_pairs",
           "model_flops")
