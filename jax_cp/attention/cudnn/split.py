"""The cuDNN backward within its scratch bound: a call whose workspace
(:mod:`jax_cp.attention.cudnn.workspace`) would exceed the bound runs as
sub-calls over whole GQA head groups (:mod:`jax_cp.attention.head_groups`)
and, where even one KV head's would, each over ranges of its K/V rows
(:mod:`jax_cp.attention.cudnn.kv_slices`); the results are one call's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jax_cp.attention.cudnn import kv_slices, workspace
from jax_cp.attention.head_groups import backward_in_head_groups


def backward_within_scratch_limit(backward: Callable, q, k, v, out, lse, dout,
                                  seg, *, max_seqlen_q: int, mask: str,
                                  window_left: int = -1, dq_into=None,
                                  deterministic: bool = False,
                                  max_seqlen_kv: int | None = None,
                                  scratch_limit: float | None = None,
                                  **kwargs):
  """``backward`` in as many head-group sub-calls as the cuDNN backward's
  scratch for these shapes needs to stay within ``scratch_limit`` bytes
  (:func:`~jax_cp.attention.cudnn.workspace.backward_split`; one call
  below it; None: :func:`~jax_cp.attention.cudnn.workspace.
  backward_scratch_limit`, the environment's), each over ranges of its
  K/V rows (:mod:`jax_cp.attention.cudnn.kv_slices`) where even one KV
  head's exceeds it (not with a window or tiled segments). ``backward``
  takes its static bounds from the segments it is given;
  ``max_seqlen_q``: the call's bound on a segment's query rows; the rest
  as for :func:`~jax_cp.attention.head_groups.backward_in_head_groups`.
  ``deterministic``: the sub-calls run the deterministic algorithm
  (``backward(..., deterministic=True)``), whose dP buffer the split
  bounds too, with ``max_seqlen_kv`` the call's bound on a segment's K/V
  rows (``ValueError`` where no split fits,
  :func:`~jax_cp.attention.cudnn.workspace.backward_split`).
  """
  (tq, hq, d), (tkv, hkv, dv) = q.shape, v.shape
  mode = {}
  if deterministic:
    mode = dict(deterministic=True, max_seqlen_kv=max_seqlen_kv or tkv)
    kwargs = dict(kwargs, deterministic=True)
  groups, slices = workspace.backward_split(
      tq, tkv, hq, hkv, d, head_dim_v=dv, segments=seg.q_lens.shape[0],
      max_seqlen_q=max_seqlen_q, limit=scratch_limit,
      kv_slices=window_left < 0 and not seg.tiled, **mode)
  if slices > 1:
    backward = functools.partial(kv_slices.backward_in_kv_slices, backward,
                                 slices)
  return backward_in_head_groups(backward, groups, q, k, v, out, lse, dout,
                                 seg, dq_into=dq_into, mask=mask,
                                 window_left=window_left, **kwargs)
