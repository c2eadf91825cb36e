"""Padding tokens: rows of the packed buffers that belong to no document.

No valid output may depend on them, but a kernel that reads them can
carry what they hold into valid rows: a masked probability (0) times a
NaN or an infinity is NaN, in a dense masked matmul (the xla backend), in
a tile of a ragged kernel that runs past its segment, or in cuDNN's dense
graph of tiled calls, which reads every row. So the attention entry
points (:func:`jax_cp.fused_attention`, :func:`jax_cp.cp_attention`, a
layer chunk's :func:`~jax_cp.attention.decompose.chunk_attention.
chunk_attention`)
replace q, k and v by 0 on their padding rows before any backend call,
with one ``where`` per array, and do the same to the output's cotangent
in the backward (its padding rows multiply into dK/dV the same way);
docs/internals.md, Padding tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_cp.attention.backend import Segments


def zero_rows(valid, *arrays):
  """``arrays`` (``[..., T, H, D]``) with 0 on the tokens where ``valid``
  (bool ``[..., T]``) is False; ``arrays`` unchanged when ``valid`` is
  None. A ``where``, not a product: it also clears NaN and infinities."""
  if valid is None:
    return arrays
  keep = valid[..., None, None]
  return tuple(jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in arrays)


def covered_rows(offsets, lens, tokens: int):
  """bool ``[tokens]``: the rows inside some segment ``[offsets[i],
  offsets[i] + lens[i])`` (int32 ``[S]``, inside ``[0, tokens]``; the
  ranges may overlap). Costs ``O(S + tokens)``: a scatter of the ranges'
  ends and a cumulative sum."""
  edges = jnp.zeros((tokens + 1,), jnp.int32)
  edges = edges.at[offsets].add(1).at[offsets + lens].add(-1)
  return jnp.cumsum(edges[:-1]) > 0


def segment_rows(seg: Segments, q_tokens: int, kv_tokens: int):
  """``(q_valid [q_tokens], kv_valid [kv_tokens])``: the Q rows some
  segment covers and the K/V rows some segment with Q rows reads (a
  segment without Q rows reads nothing)."""
  kv_lens = jnp.where(seg.q_lens > 0, seg.kv_lens, 0)
  return (covered_rows(seg.q_offsets, seg.q_lens, q_tokens),
          covered_rows(seg.kv_offsets, kv_lens, kv_tokens))


def _host_covered(offsets, lens, tokens: int) -> bool:
  """Whether concrete ``[B, N]`` (or ``[N]``) segments cover every row of
  their rows of ``tokens`` tokens."""
  offsets = np.atleast_2d(offsets).astype(np.int64)
  lens = np.atleast_2d(lens).astype(np.int64)
  for off, n in zip(offsets, lens):
    edges = np.zeros(tokens + 1, np.int64)
    np.add.at(edges, np.clip(off, 0, tokens), 1)
    np.add.at(edges, np.clip(off + n, 0, tokens), -1)
    if not np.all(np.cumsum(edges[:-1]) > 0):
      return False
  return True


def may_hold_padding(q_lens, kv_lens, q_offsets, kv_offsets, q_tokens: int,
                     kv_tokens: int) -> bool:
  """False when concrete segment metadata (numpy ``[B, N]`` or ``[N]``)
  show that every Q row is covered and every K/V row read, so there is
  nothing to clear; True otherwise (traced metadata included)."""
  arrays = [None if x is None else np.asarray(x)
            for x in (q_lens, kv_lens, q_offsets, kv_offsets)]
  if any(x is None for x in arrays):
    return True
  ql, kl, qo, ko = arrays
  kl = np.where(ql > 0, kl, 0)
  return not (_host_covered(qo, ql, q_tokens)
              and _host_covered(ko, kl, kv_tokens))
