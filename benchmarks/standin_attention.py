"""An O(T) stand-in for attention, to plan a training step's memory on a CPU.

``bench_memory --device cpu --compile-only --backend standin`` compiles the
example's step with this backend in place of attention. It takes and
returns what a ``cudnn`` backend call does (q, k, v to out and lse; q, k,
v, out, lse, dout to dq, dk and dv), reads every input, and does only
elementwise work and sums over tokens or heads. XLA's plan then holds the
model's buffers and every attention call's inputs and outputs, as the
GPU's does around its cuDNN custom calls, but not the dense ``[Tq, Tkv]``
scores of the ``xla`` backend, which at long rows would dwarf the rest (or
not compile). Its backward is split over head groups and K/V slices where
the ``cudnn`` backend's would be, so the split's buffers are in the plan
too. The cuDNN
backward's workspace is in no XLA plan either way: ``bench_memory`` adds
it from the formula (:mod:`jax_cp.attention.cudnn.workspace`).

Its results are not attention: it is registered only by ``bench_memory``
for compile-only runs, never for a step that runs.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_cp.attention.backend import Backend, Segments, with_scratch_limit
from jax_cp.attention.cudnn import split, workspace
from jax_cp.attention.registry import register_backend

NAME = "standin"
#: Weight of the inputs a result only has to depend on (kept live, as a
#: kernel that reads them keeps them; XLA does not fold ``x * c`` to 0).
_TOUCH = 1e-30


def _grouped(x, heads_kv: int):
  """``[T, Hq, D]`` -> ``[T, Hkv, Hq / Hkv, D]`` (query heads by KV head)."""
  t, hq, d = x.shape
  return x.reshape(t, heads_kv, hq // heads_kv, d)


def forward(q, k, v, seg: Segments, *, mask: str, scale: float,
            window_left: int = -1):
  """``(out, lse)`` shaped as attention's, from every input (in q's dtype,
  with float32 sums: no float32 buffer of q's size)."""
  del seg, mask, window_left
  kv = (k.sum(axis=0, dtype=jnp.float32) + v.sum(axis=0, dtype=jnp.float32))
  kv = (kv / k.shape[0]).astype(q.dtype)                    # [Hkv, D]
  out = _grouped(q, k.shape[1]) * jnp.asarray(scale, q.dtype) + \
      kv[None, :, None, :]
  lse = q.sum(axis=-1, dtype=jnp.float32)
  return out.reshape(q.shape), lse


def backward(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
             scale: float, window_left: int = -1,
             scratch_limit: float = workspace.DEFAULT_BACKWARD_SCRATCH_LIMIT):
  """``(dq, dk, dv)`` shaped as attention's, from every input, in the
  sub-calls over head groups and K/V slices that the ``cudnn`` backend
  would run for these shapes and its ``scratch_limit``
  (:func:`jax_cp.attention.cudnn.split.backward_within_scratch_limit`),
  so the plan holds the split's buffers too."""
  return split.backward_within_scratch_limit(
      _backward_call, q, k, v, out, lse, dout, seg,
      max_seqlen_q=min(seg.max_seqlen_q, q.shape[0]), mask=mask, scale=scale,
      window_left=window_left, scratch_limit=scratch_limit)


def _backward_call(q, k, v, out, lse, dout, seg: Segments, *, mask: str,
                   scale: float, window_left: int = -1):
  """One call's ``(dq, dk, dv)``."""
  del seg, mask, window_left
  touch = jnp.asarray(_TOUCH, q.dtype)
  t = (dout * jnp.asarray(scale, q.dtype) + touch * (out + q)
       + touch * lse[..., None].astype(q.dtype))
  per_kv = _grouped(t, k.shape[1]).sum(axis=(0, 2), dtype=jnp.float32)
  per_kv = per_kv.astype(k.dtype)[None]                     # [1, Hkv, D]
  return t, k * touch + per_kv, v * touch + per_kv


def _configure(backend: Backend) -> Backend:
  """The cudnn backend's scratch bound, from the environment as it reads
  it where it is resolved."""
  return with_scratch_limit(backend, workspace.backward_scratch_limit())


#: Sized by the static bounds like cuDNN's kernels (``exact_past_bounds``
#: False), so the CP layer plans the same guards around it; the cudnn
#: backend's scratch bound, so the ring runs in the same head groups.
BACKEND = Backend(name=NAME, forward=forward, backward=backward,
                  is_available=lambda platform: True, exact_past_bounds=False,
                  scratch_limit=float(workspace.DEFAULT_BACKWARD_SCRATCH_LIMIT),
                  configure=_configure)


def register() -> None:
  """Adds the stand-in to the backend table (under :data:`NAME`)."""
  register_backend(BACKEND)
