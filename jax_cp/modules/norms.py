"""RMS normalisation whose gradient keeps the input and one float32 number
per token.

``y = x * rsqrt(mean(x**2) + epsilon) * scale`` over the last axis, in
float32 whatever the input dtype, returned in ``dtype``: the numbers of
Flax's ``RMSNorm`` (``force_float32_reductions``, the default). Written as
plain JAX, its gradient would keep float32 copies of the input's size
(the float32 input, the broadcast ``rsqrt * scale`` and their product):
three ``[T, E]`` float32 buffers per norm, live in the backward of a
rematerialized layer next to everything else (a CPU compile of the 16 ×
2048 model's step shows them at the peak). As a ``custom_vjp`` it keeps
``x`` in its own dtype and ``rsqrt(mean(x**2) + epsilon)`` (``[.., 1]``
float32), and its backward forms ``dx`` and ``dscale`` from them in one
pass:

``xhat = x * r``, ``g = dy * scale``,
``dx = r * (g - xhat * mean(g * xhat))``, ``dscale = sum(dy * xhat)``

over the tokens (``sum`` over every axis but the last).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_cp.modules.vma import vary_like

_F32 = jnp.float32


def _rstd(xf, epsilon: float):
  return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epsilon)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, scale, epsilon: float, dtype):
  xf = x.astype(_F32)
  return (xf * (_rstd(xf, epsilon) * scale.astype(_F32))).astype(dtype)


def _rms_norm_fwd(x, scale, epsilon, dtype):
  xf = x.astype(_F32)
  r = _rstd(xf, epsilon)
  return (xf * (r * scale.astype(_F32))).astype(dtype), (x, r, scale)


def _rms_norm_bwd(epsilon, dtype, res, dy):
  del epsilon, dtype
  x, r, scale = res
  xhat = x.astype(_F32) * r
  g = dy.astype(_F32)
  gs = g * scale.astype(_F32)
  dx = r * (gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
  dscale = jnp.sum((g * xhat).reshape(-1, x.shape[-1]), axis=0)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, scale, *, epsilon: float = 1e-6, dtype=None):
  """RMS normalisation of ``x`` over its last axis, times ``scale``.

  Args:
    x: ``[..., E]``.
    scale: ``[E]``.
    epsilon: added to the mean square.
    dtype: of the result; None: ``x``'s and ``scale``'s promoted dtype (as
      Flax's norms infer it).

  Returns:
    ``[..., E]`` in ``dtype``, formed in float32.

  Raises:
    ValueError: ``scale`` is not ``[E]``.
  """
  if scale.shape != x.shape[-1:]:
    raise ValueError(f"scale must have shape {x.shape[-1:]} (the last axis "
                     f"of x), got {scale.shape}")
  dtype = jnp.result_type(x, scale) if dtype is None else jnp.dtype(dtype)
  return _rms_norm(x, vary_like(scale, x), float(epsilon), dtype)
