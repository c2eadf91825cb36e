"""A backward in sub-calls over whole GQA head groups.

Attention is independent per KV head and the query heads that share it
(query head ``h`` reads KV head ``h // (Hq / Hkv)``), so the gradients of
one call equal those of ``n`` calls, for any ``n`` dividing ``Hkv``: call
``g`` takes query heads ``[g * Hq / n, (g + 1) * Hq / n)`` of q, out, dout,
lse (and dq) and KV heads ``[g * Hkv / n, (g + 1) * Hkv / n)`` of k and v
(and dk, dv). Every sub-call writes its own heads of dq, dk and dv; none
accumulates into another's.

Memory in proportion to the heads of a call is bounded this way: a
backend's backward scratch (the cuDNN backward's float32 buffers,
:func:`jax_cp.attention.cudnn.split.backward_within_scratch_limit`) and
the CP ring's float32 running buffers (:mod:`jax_cp.cp.exchange.ring`).
:func:`fewest_groups` picks the smallest ``n`` that fits a bound;
:func:`backward_in_head_groups` runs the sub-calls one after another in
a ``lax.scan``, so only one group's slices of the inputs (copies of
``1/n`` of q, k, v, out, dout and lse) and one sub-call's scratch are
live at a time. The results are written
in place over q, k and v (over ``dq_into`` for dq), group by group: no
zero-filled gradient buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def fewest_groups(heads_kv: int, fits: Callable[[int], bool]) -> int:
  """The smallest divisor ``n`` of ``heads_kv`` with ``fits(n)``, or
  ``heads_kv`` (one KV head per sub-call, the finest split) when none
  does."""
  for n in range(1, heads_kv + 1):
    if heads_kv % n == 0 and fits(n):
      return n
  return heads_kv


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
