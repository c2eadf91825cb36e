"""A backward in sub-calls over whole GQA head groups.

Attention is independent per KV head and the query heads that share it
(query head ``h`` reads KV head ``h // (Hq / Hkv)``), so the gradients of
one call equal those of ``n`` calls, for any ``n`` dividing ``Hkv``: call
``g`` takes query heads ``[g * Hq / n, (g + 1) * Hq / n)`` of q, out, dout,
lse (and dq) and KV heads ``[g * Hkv / n, (g + 1) * Hkv / n)`` of k and v
(and dk, dv). Every sub-call writes its own heads of dq, dk and dv; none
accumulates into another's.

A backend whose backward needs scratch memory in proportion to the heads
of a call (the cuDNN backward's float32 buffers,
:mod:`jax_cp.attention.cudnn_workspace`) uses this to bound it:
:func:`~jax_cp.attention.cudnn_workspace.backward_head_groups` picks the
smallest ``n`` that fits (:func:`backward_within_scratch_limit` does
both), :func:`backward_in_head_groups` runs the
sub-calls one after another in a ``lax.scan``, so only one group's
slices of the inputs (copies of ``1/n`` of q, k, v, out, dout and lse)
and one sub-call's scratch are live at a time. The results are written
in place over q, k and v (over ``dq_into`` for dq), group by group: no
zero-filled gradient buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_cp.attention import cudnn_workspace, kv_slices


def backward_in_head_groups(backward: Callable, groups: int, q, k, v, out,
                            lse, dout, seg, *, dq_into=None, **kwargs):
  """``backward(q, k, v, out, lse, dout, seg, **kwargs)`` as ``groups``
  sub-calls over whole GQA head groups (the module docstring).

  Args:
    backward: a backend's backward of one call (the contract of
      :mod:`jax_cp.attention.backend`).
    groups: the number of sub-calls; must divide the KV heads.
    q, k, v, out, lse, dout, seg: as for ``backward``.
    dq_into: as the in-place contract's ``dq_into``: each sub-call gets its
      heads of it and writes its covered rows; every other element keeps
      ``dq_into``'s value.
    **kwargs: passed on to every sub-call (mask, scale, window_left).

  Returns:
    ``(dq, dk, dv)``, equal to one call's.

  Raises:
    ValueError: ``groups`` does not divide the KV heads.
  """
  hq, hkv = q.shape[1], k.shape[1]
  if isinstance(groups, bool) or not isinstance(groups, int) or \
      groups < 1 or hkv % groups:
    raise ValueError(f"groups={groups!r} must be a positive int dividing the "
                     f"KV heads ({hkv})")
  if groups == 1:
    extra = {} if dq_into is None else dict(dq_into=dq_into)
    return backward(q, k, v, out, lse, dout, seg, **kwargs, **extra)
  gq, gkv = hq // groups, hkv // groups
  heads = lambda x, g, n: jax.lax.dynamic_slice_in_dim(x, g * n, n, axis=1)
  put = lambda x, part, g, n: jax.lax.dynamic_update_slice_in_dim(
      x, part.astype(x.dtype), g * n, axis=1)

  # The loop's carry starts as (q or dq_into, k, v) and each sub-call
  # writes its gradients over its own heads there, after reading them: the
  # heads of later groups still hold their inputs. So the loop needs no
  # zero-filled dq, dk and dv (XLA makes such buffers ahead of time and
  # keeps every layer's until its backward runs), and where q, k and v die
  # with the backward it works in their buffers.
  def one_group(carry, g):
    bq, bk, bv = carry
    q_g = heads(q if dq_into is not None else bq, g, gq)
    extra = {} if dq_into is None else dict(dq_into=heads(bq, g, gq))
    dq_g, dk_g, dv_g = backward(
        q_g, heads(bk, g, gkv), heads(bv, g, gkv),
        heads(out, g, gq), heads(lse, g, gq), heads(dout, g, gq), seg,
        **kwargs, **extra)
    return (put(bq, dq_g, g, gq), put(bk, dk_g, g, gkv),
            put(bv, dv_g, g, gkv)), None

  init = (q if dq_into is None else dq_into, k, v)
  (dq, dk, dv), _ = jax.lax.scan(one_group, init,
                                 jnp.arange(groups, dtype=jnp.int32))
  return dq, dk, dv


def backward_within_scratch_limit(backward: Callable, q, k, v, out, lse, dout,
                                  seg, *, max_seqlen_q: int, mask: str,
                                  window_left: int = -1, dq_into=None,
                                  deterministic: bool = False,
                                  max_seqlen_kv: int | None = None,
                                  **kwargs):
  """``backward`` in as many head-group sub-calls as the cuDNN backward's
  scratch for these shapes needs to stay within
  :func:`~jax_cp.attention.cudnn_workspace.backward_scratch_limit`
  (:func:`~jax_cp.attention.cudnn_workspace.backward_split`; one call
  below it), each over ranges of its K/V rows
  (:mod:`jax_cp.attention.kv_slices`) where even one KV head's exceeds it
  (not with a window or tiled segments). ``backward`` takes its static
  bounds from the segments it is given; ``max_seqlen_q``: the call's
  bound on a segment's query rows; the rest as for
  :func:`backward_in_head_groups`. ``deterministic``: the sub-calls run
  the deterministic algorithm (``backward(..., deterministic=True)``),
  whose dP buffer the split bounds too, with ``max_seqlen_kv`` the call's
  bound on a segment's K/V rows (``ValueError`` where no split fits,
  :func:`~jax_cp.attention.cudnn_workspace.backward_split`).
  """
  (tq, hq, d), (tkv, hkv, dv) = q.shape, v.shape
  mode = {}
  if deterministic:
    mode = dict(deterministic=True, max_seqlen_kv=max_seqlen_kv or tkv)
    kwargs = dict(kwargs, deterministic=True)
  groups, slices = cudnn_workspace.backward_split(
      tq, tkv, hq, hkv, d, head_dim_v=dv, segments=seg.q_lens.shape[0],
      max_seqlen_q=max_seqlen_q,
      kv_slices=window_left < 0 and not seg.tiled, **mode)
  if slices > 1:
    backward = functools.partial(kv_slices.backward_in_kv_slices, backward,
                                 slices)
  return backward_in_head_groups(backward, groups, q, k, v, out, lse, dout,
                                 seg, dq_into=dq_into, mask=mask,
                                 window_left=window_left, **kwargs)
