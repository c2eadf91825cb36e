"""``RMSNorm`` for Flax linen, with a lean gradient."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_cp.modules.norms import rms_norm

Dtype = jnp.dtype | type
Initializer = jax.nn.initializers.Initializer


class RMSNorm(nn.Module):
  """RMS normalisation over the last axis with a learned scale: the numbers
  and the parameter (``scale``, ``[E]``) of ``flax.linen.RMSNorm``, with a
  gradient that keeps the input and one float32 number per token instead
  of float32 copies of the input (:func:`jax_cp.modules.norms.rms_norm`).

  Attributes:
    epsilon: added to the mean square.
    dtype: of the output; None: the input's and the scale's promoted dtype.
    param_dtype: of ``scale``.
    scale_init: its initializer (ones).
  """

  epsilon: float = 1e-6
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  scale_init: Initializer = nn.initializers.ones

  @nn.compact
  def __call__(self, x):
    """``x [..., E]`` normalised, in ``dtype``."""
    scale = self.param("scale", self.scale_init, (x.shape[-1],),
                       self.param_dtype)
    return rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype)
