"""The K/V buffers of a call that reads a received halo and the local chunk.

With the halo exchange (NO_LOAD_BALANCE with a ``max_seqlen`` bound), the
straddling document's call reads K/V rows from the halo received from the
predecessors followed by the local chunk. The buffer it reads, row ``r`` of
batch entry ``b``, is halo row ``r`` (``r < H0``) or local row ``r - H0``.
Only rows ``[first[b], first[b] + count[b])`` are ever read (the document's
KV range), so backends provide ``assemble_kv``: the ``cudnn`` backend copies
just those rows with one kernel, this module holds the contract's checks and
the portable ``jnp`` version, which concatenates everything.
"""

from __future__ import annotations

import jax.numpy as jnp


def check_assemble_kv(halo, k, v, rows: int | None, first, count) -> int:
  """``halo [B, H0, 2*Hkv, D]`` (K heads first), ``k = v [B, Tl, Hkv, D]``
  of one dtype, static ``0 <= rows <= H0 + Tl`` (None: ``H0 + Tl``),
  integer ``first`` and ``count`` ``[B]``. Returns ``rows``."""
  if k.ndim != 4 or v.shape != k.shape or halo.ndim != 4 or \
      halo.shape[0] != k.shape[0] or halo.shape[2] != 2 * k.shape[2] or \
      halo.shape[3] != k.shape[3]:
    raise ValueError(f"need halo [B, H0, 2*Hkv, D] and k = v [B, Tl, Hkv, "
                     f"D]; got halo {halo.shape}, k {k.shape}, v {v.shape}")
  if not halo.dtype == k.dtype == v.dtype:
    raise ValueError(f"halo, k and v must share a dtype; got {halo.dtype}, "
                     f"{k.dtype}, {v.dtype}")
  limit = halo.shape[1] + k.shape[1]
  if rows is None:
    rows = limit
  if not isinstance(rows, int) or not 0 <= rows <= limit:
    raise ValueError(f"rows must be a static int in [0, H0 + Tl] = [0, "
                     f"{limit}], got {rows!r}")
  for name, x in (("first", first), ("count", count)):
    if jnp.shape(x) != (k.shape[0],) or not jnp.issubdtype(
        jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must be an integer [B] = [{k.shape[0]}] "
                       f"array, got {jnp.result_type(x)} {jnp.shape(x)}")
  return rows


def assemble_kv_jnp(halo, k, v, rows: int | None = None, first=None,
                    count=None):
  """Portable ``assemble_kv``: every row of ``[halo; local]`` up to
  ``rows`` (``first``/``count`` are accepted and not needed). The local
  chunk is cut before concatenating, so nothing larger is materialised."""
  b = k.shape[0]
  if first is None:
    first = count = jnp.zeros((b,), jnp.int32)
  rows = check_assemble_kv(halo, k, v, rows, first, count)
  hk, h0 = k.shape[2], halo.shape[1]
  n = max(rows - h0, 0)
  return (jnp.concatenate([halo[:, :rows, :hk], k[:, :n]], axis=1),
          jnp.concatenate([halo[:, :rows, hk:], v[:, :n]], axis=1))
