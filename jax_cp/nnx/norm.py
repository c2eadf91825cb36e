"""``RMSNorm`` for Flax NNX, with a lean gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_cp.modules.norms import rms_norm

Dtype = jnp.dtype | type
Initializer = jax.nn.initializers.Initializer


class RMSNorm(nnx.Module):
  """RMS normalisation over the last axis with a learned scale: the numbers
  and the parameter (``scale``, ``[num_features]``) of ``flax.nnx.RMSNorm``,
  with a gradient that keeps the input and one float32 number per token
  instead of float32 copies of the input
  (:func:`jax_cp.modules.norms.rms_norm`).

  Attributes:
    num_features: the size of the last axis.
    epsilon: added to the mean square.
    dtype: of the output; None: the input's and the scale's promoted dtype.
    param_dtype: of ``scale``.
    scale: the learned scale (``nnx.Param``).
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               scale_init: Initializer = nnx.initializers.ones,
               rngs: nnx.Rngs):
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.scale = nnx.Param(scale_init(rngs.params(), (num_features,),
                                      param_dtype))

  def __call__(self, x):
    """``x [..., num_features]`` normalised, in ``dtype``."""
    return rms_norm(x, self.scale[...], epsilon=self.epsilon,
                    dtype=self.dtype)
