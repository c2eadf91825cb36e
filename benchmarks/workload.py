"""What the benchmarks run on: packed rows, meshes, inputs and step programs.

* Rows: one packed THD row of exactly ``T`` tokens per document
  distribution (:data:`DISTS`), seeded so that every machine draws the same
  documents (:func:`pack_row`, :func:`make_row`, :class:`Row`), optionally
  reordered to balance NO_LOAD_BALANCE (:func:`balanced_row`). The
  ``stdlib_mix`` lengths come from ``data/stdlib_py_sizes.json``.
* Inputs: random q, k, v, dout generated on the devices, token axis sharded
  over the first ``cp`` devices (:func:`make_inputs`, :func:`abstract_args`).
* Programs: functions of ``(q, k, v, dout, cu, cuP)`` for a pass
  (:func:`with_pass` over :func:`cp_forward`, :func:`primitive_forward` or
  :func:`dense_forward`), and FLOPs counted exactly (:func:`flops`, by
  :func:`jax_cp.attention_flops`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from benchmarks.names import DISTS

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _stdlib_py_sizes() -> tuple[int, ...]:
  with open(os.path.join(_DATA, "stdlib_py_sizes.json")) as f:
    return tuple(json.load(f)["sizes"])


# Byte sizes of the non-empty .py files of CPython 3.12.1's standard library
# (see the data file's description).
STDLIB_PY_SIZES = _stdlib_py_sizes()


# ----------------------------------------------------------------- documents


def _rng(dist: str, tokens: int, seed: int) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(dist.encode()), tokens])


def document_lengths(dist: str, tokens: int, seed: int) -> Iterator[int]:
  """Endless stream of valid document lengths of a distribution."""
  if dist not in DISTS:
    raise ValueError(f"unknown distribution {dist!r}; expected one of "
                     f"{list(DISTS)}")
  rng = _rng(dist, tokens, seed)
  sizes = np.asarray(STDLIB_PY_SIZES)
  while True:
    if dist == "one_doc":
      yield tokens
    elif dist == "uniform_1k_8k":
      yield int(rng.integers(1024, 8192, endpoint=True))
    elif dist == "stdlib_mix":
      yield int(min(rng.choice(sizes), tokens))
    else:
      yield int(rng.integers(128, 1024, endpoint=True))


def pack_row(dist: str, tokens: int, multiple: int, seed: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
  """Packs documents into exactly ``tokens`` tokens.

  Every document is padded to a multiple of ``multiple``; the last one is
  trimmed so that the padded total is ``tokens`` (its valid length is cut to
  its padded length). The same seed gives the same documents whatever the
  padding, so the DUAL_CHUNK_SWAP and NO_LOAD_BALANCE rows hold the same
  documents up to the trimmed tail.

  Returns:
    ``(cu_seqlens, cu_seqlens_padded)``, int32 ``[N+1]``.
  """
  if tokens % multiple:
    raise ValueError(f"T={tokens} is not a multiple of {multiple}")
  lens, plens, total = [], [], 0
  for length in document_lengths(dist, tokens, seed):
    padded = -(-length // multiple) * multiple
    if total + padded >= tokens:
      padded = tokens - total
      lens.append(min(length, padded))
      plens.append(padded)
      break
    lens.append(length)
    plens.append(padded)
    total += padded
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  cuP = np.concatenate([[0], np.cumsum(plens)]).astype(np.int32)
  return cu, cuP


@dataclasses.dataclass(frozen=True)
class Row:
  """One packed row and the static facts the programs depend on.

  Attributes:
    dist: the document distribution.
    tokens: T.
    layout: ``"pad<m>"`` (documents padded to a multiple of m, for
      DUAL_CHUNK_SWAP) or ``"unpadded"``.
    cu: cu_seqlens ``[N+1]``.
    cuP: cu_seqlens_padded ``[N+1]``.
    max_seqlen: the static bound passed to the kernels (None: T).
  """

  dist: str
  tokens: int
  layout: str
  cu: np.ndarray
  cuP: np.ndarray
  max_seqlen: int | None

  @property
  def row_id(self) -> str:
    h = zlib.crc32(self.cu.tobytes() + self.cuP.tobytes())
    return f"{self.dist}-T{self.tokens}-{h:08x}"

  @property
  def num_docs(self) -> int:
    return len(self.cu) - 1

  @property
  def longest_padded_doc(self) -> int:
    return int(np.diff(self.cuP).max())

  @property
  def valid_tokens(self) -> int:
    return int(self.cu[-1])

  @property
  def pairs(self) -> int:
    """Causal (query, key) pairs: ``L(L+1)/2`` per document."""
    return self.window_pairs(None)

  def window_pairs(self, window: int | None) -> int:
    """Causal pairs inside a sliding window ``(window, 0)``: a query at
    position ``j`` sees ``min(j+1, window+1)`` keys (None: no window)."""
    return jax_cp.causal_pairs(self.cu,
                               None if window is None else (window, 0))


def make_row(dist: str, tokens: int, strategy: str, max_cp: int, bound: str,
             seed: int) -> Row:
  """The row of a distribution for a strategy: DUAL_CHUNK_SWAP pads every
  document to a multiple of ``2*max_cp`` (so every cp up to ``max_cp`` runs
  the same row). ``bound="auto"``: ``max_seqlen`` = longest padded
  document; ``"none"``: no bound."""
  multiple = 2 * max_cp if strategy == "dual_chunk_swap" else 1
  cu, cuP = pack_row(dist, tokens, multiple, seed)
  layout = f"pad{multiple}" if multiple > 1 else "unpadded"
  w = int(np.diff(cuP).max()) if bound == "auto" else None
  return Row(dist, tokens, layout, cu, cuP, w)


def balanced_row(row: Row, strategy: str, cp: int,
                 window: int | None = None) -> Row:
  """The row with its documents reordered by
  :func:`jax_cp.balance_document_order` for ``strategy`` at ``cp`` (and
  the window ``(window, 0)``): the same documents, each rank's contiguous
  chunk holding near-equal work. DUAL_CHUNK_SWAP: the same row."""
  order = jax_cp.balance_document_order(
      row.cu, row.cuP, cp, strategy,
      window_size=None if window is None else (window, 0))
  cu, cuP = jax_cp.permute_documents(order, row.cu, row.cuP)
  return dataclasses.replace(row, cu=cu, cuP=cuP)


def flops(row: Row, hq: int, head_dim: int, pass_name: str,
          window: int | None = None) -> float:
  """Hardware FLOPs of attention (:func:`jax_cp.attention_flops` with
  ``recompute=True``): ``4 * Hq * D * pairs`` forward, 3.5x that for
  forward+backward (the fused backward recomputes ``Q K^T``); only the
  pairs inside a sliding window ``(window, 0)`` when one is given."""
  return float(jax_cp.attention_flops(
      row.window_pairs(window), num_heads=hq, head_dim=head_dim,
      backward=pass_name == "fwd_bwd", recompute=True))


# ----------------------------------------------------------------- devices


def make_mesh(cp: int) -> jax.sharding.Mesh:
  """A 1-D ``("cp",)`` mesh over the first ``cp`` devices, Auto axes."""
  return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp],
                       axis_types=(AxisType.Auto,))


def _shardings(cp: int):
  mesh = make_mesh(cp)
  return NamedSharding(mesh, P("cp")), NamedSharding(mesh, P())


def abstract_args(cp: int, tokens: int, hq: int, hkv: int, d: int, dtype,
                  num_docs: int) -> tuple[jax.ShapeDtypeStruct, ...]:
  """Shapes of ``(q, k, v, dout, cu, cuP)``, for lowering."""
  sh, rep = _shardings(cp)
  s = lambda shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
  meta = jax.ShapeDtypeStruct((num_docs + 1,), jnp.int32, sharding=rep)
  return (s((tokens, hq, d)), s((tokens, hkv, d)), s((tokens, hkv, d)),
          s((tokens, hq, d)), meta, meta)


def make_inputs(cp: int, tokens: int, hq: int, hkv: int, d: int, dtype,
                seed: int, count: int = 2) -> list[tuple]:
  """``count`` sets of random (q, k, v, dout), token axis sharded over the
  first ``cp`` devices. Random tokens need no reorder_for_cp: any
  permutation of random data is random data of the same layout."""
  sh, _ = _shardings(cp)

  def gen(seed_):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed_), 4)
    return (jax.random.normal(kq, (tokens, hq, d), dtype),
            jax.random.normal(kk, (tokens, hkv, d), dtype),
            jax.random.normal(kv, (tokens, hkv, d), dtype),
            jax.random.normal(kd, (tokens, hq, d), dtype))

  gen = jax.jit(gen, out_shardings=(sh,) * 4)
  return [jax.block_until_ready(gen(np.uint32(seed + i)))
          for i in range(count)]


def row_metadata(cp: int, row: Row) -> tuple[jax.Array, jax.Array]:
  """``(cu, cuP)`` of a row, replicated over the first ``cp`` devices."""
  _, rep = _shardings(cp)
  return tuple(jax.device_put(x, rep) for x in (row.cu, row.cuP))


def arg_sets(cp: int, row: Row, hq: int, hkv: int, d: int, dtype,
             seed: int) -> list[tuple]:
  """Two input sets ``(q, k, v, dout, cu, cuP)`` for the programs of a
  row."""
  meta = row_metadata(cp, row)
  return [tuple(s) + meta for s in make_inputs(cp, row.tokens, hq, hkv, d,
                                               dtype, seed)]


# ----------------------------------------------------------------- programs


def with_pass(forward: Callable, pass_name: str) -> Callable:
  """Program of signature ``(q, k, v, dout, cu, cuP)`` for a pass: the
  forward, or ``jax.value_and_grad`` of ``sum(out * dout)`` with respect to
  q, k, v."""
  if pass_name == "fwd":
    return lambda q, k, v, dout, cu, cuP: forward(q, k, v, cu, cuP)

  def loss(q, k, v, dout, cu, cuP):
    out = forward(q, k, v, cu, cuP)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def cp_forward(mesh, strategy: str, backend: str, max_seqlen: int | None,
               communicate: bool = True, window_size=None,
               violation: str = "fallback",
               dcs_window_plan: str = "split") -> Callable:
  """``jax_cp.cp_attention`` over ``mesh``; ``communicate=False`` runs the
  same step with its exchange's collectives replaced by local copies
  (``cp_comm_type="local_copies"``); ``window_size``: a causal sliding
  window ``(left, 0)`` (None: plain causal); ``violation``: the layout's
  ``max_seqlen_violation`` (the library's default ``"fallback"`` puts a
  ``lax.cond`` in the step; the benchmark rows are built on the host, so
  ``"checked_on_host"`` is also right for them); ``dcs_window_plan``:
  DUAL_CHUNK_SWAP's windowed calls (``cp_attention``'s argument)."""
  comm = "all_gather" if communicate else "local_copies"

  def forward(q, k, v, cu, cuP):
    return jax_cp.cp_attention(q, k, v, cu, cuP, mesh=mesh, cp_axis="cp",
                               load_balancing_strategy=strategy,
                               cp_comm_type=comm, backend=backend,
                               max_seqlen=max_seqlen, window_size=window_size,
                               max_seqlen_violation=violation,
                               dcs_window_plan=dcs_window_plan)
  return forward


def primitive_forward(backend: str, max_seqlen: int | None,
                      window_size=None) -> Callable:
  """``jax_cp.fused_attention`` (no CP) over the row, top-left causal
  (within the sliding window ``window_size`` when given)."""
  def forward(q, k, v, cu, cuP):
    lens = cu[1:] - cu[:-1]
    offs = cuP[:-1]
    return jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type="causal_top_left",
        backend=backend, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
        window_size=window_size)
  return forward


def dense_forward(implementation: str | None, window_size=None) -> Callable:
  """``jax.nn.dot_product_attention`` on the whole row as one document
  (``local_window_size=window_size``)."""
  def forward(q, k, v, cu, cuP):
    del cu, cuP
    return jax.nn.dot_product_attention(q[None], k[None], v[None],
                                        is_causal=True,
                                        implementation=implementation,
                                        local_window_size=window_size)[0]
  return forward
