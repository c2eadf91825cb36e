"""Speed of ``jax_cp.cp_attention`` on packed THD rows, in one command.

Quick preset (the issue's targets: T=64k, Hkv=8, four document mixes, cp
1/2/4, both strategies, forward and forward+backward)::

    python3 benchmarks/bench_cp.py --quick --out benchmarks/results

Everything is a flag (``--help``); ``benchmarks/README.md`` says what is
measured and how. In short, per configuration:

* a packed row of exactly ``T`` tokens (documents drawn from a distribution,
  the last one trimmed; DUAL_CHUNK_SWAP pads every document to a multiple of
  ``2*max(cp)`` so that every cp value runs the same row);
* the median over ``--reps`` host-clock timings (after ``--warmup`` calls,
  alternating two input sets) of the forward, or of ``jax.value_and_grad``
  of ``sum(out * dout)`` with respect to q, k, v: per call in blocks of
  calls dispatched back to back (``--timing pipelined``, the default: what
  a training loop sees), the slope of a block's time over its length
  (``steady``: the pipeline's fill and drain cancel) and of single calls
  each waited for (``synced``, adds the dispatch latency); all three are
  recorded;
* FLOPs counted exactly: ``4 * Hq * D * pairs`` forward with ``pairs =
  L(L+1)/2`` per document of ``L`` valid tokens (the issue's ``2*T^2*H*D``
  per document is the ``L^2/2`` approximation of the same), 3.5x that for
  forward+backward;
* the exchange cost two ways: *exposed* = step time minus the time of the
  same step compiled with the collectives replaced by local copies, and
  *standalone* = the all-gather (+ DUAL_CHUNK_SWAP reorder, + un-reorder and
  reduce-scatter of dK/dV for fwd+bwd) alone in the same ``shard_map``;
* references: ``jax.nn.dot_product_attention(..., implementation="cudnn")``
  on the one-document row, and ``jax_cp.fused_attention`` (the primitive, no
  CP) on every cp=1 row.

All programs are lowered first, compiled in parallel threads, then timed one
after the other; results are written after every measurement, so a run cut
short still leaves a valid JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import re
import statistics
import sys
import time
import traceback
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import partition  # noqa: E402

DISTS = ("one_doc", "uniform_1k_8k", "stdlib_mix", "short_128_1k")
STRATEGIES = ("dual_chunk_swap", "no_load_balance")
PASSES = ("fwd", "fwd_bwd")
_DIST_PRIORITY = ("one_doc", "short_128_1k", "uniform_1k_8k", "stdlib_mix")
FWD_BWD_FLOP_FACTOR = 3.5

FULL = dict(cp=[1, 2, 4], strategies=list(STRATEGIES), hkv=[8, 32],
            tokens=[16384, 32768, 65536, 131072], dists=list(DISTS),
            passes=list(PASSES))
QUICK = dict(cp=[1, 2, 4], strategies=list(STRATEGIES), hkv=[8],
             tokens=[65536], dists=list(DISTS), passes=list(PASSES))

# Sizes in bytes of the 683 non-empty .py files of CPython 3.12.1's standard
# library (Lib/, without test/, tests/, idle_test/ and site-packages),
# sorted. Embedded so that every machine draws the same documents.
STDLIB_PY_SIZES = (
    38, 38, 47, 58, 67, 70, 72, 82, 87, 88, 97, 97, 119, 124, 129, 143, 145,
    148, 154, 156, 159, 167, 227, 229, 231, 232, 248, 254, 257, 268, 289,
    308, 314, 320, 320, 327, 354, 396, 449, 451, 454, 454, 472, 476, 481,
    500, 506, 547, 557, 571, 590, 591, 606, 613, 644, 657, 689, 689, 702,
    703, 708, 743, 768, 790, 808, 821, 837, 880, 893, 914, 916, 930, 930,
    936, 946, 951, 960, 979, 984, 1003, 1005, 1011, 1015, 1019, 1019, 1023,
    1023, 1023, 1023, 1027, 1027, 1027, 1031, 1034, 1037, 1037, 1039, 1039,
    1044, 1051, 1051, 1053, 1053, 1059, 1059, 1061, 1061, 1061, 1066, 1069,
    1073, 1073, 1081, 1082, 1090, 1105, 1119, 1144, 1199, 1211, 1220, 1226,
    1248, 1256, 1264, 1277, 1289, 1289, 1291, 1299, 1302, 1304, 1305, 1315,
    1321, 1332, 1339, 1354, 1361, 1394, 1401, 1474, 1493, 1508, 1525, 1533,
    1535, 1548, 1558, 1582, 1590, 1598, 1605, 1608, 1619, 1635, 1697, 1717,
    1752, 1764, 1774, 1778, 1804, 1816, 1974, 1984, 1993, 2005, 2029, 2048,
    2051, 2062, 2068, 2084, 2086, 2100, 2129, 2166, 2204, 2221, 2230, 2249,
    2346, 2361, 2377, 2403, 2404, 2406, 2415, 2425, 2434, 2438, 2448, 2475,
    2479, 2495, 2501, 2517, 2543, 2576, 2616, 2660, 2672, 2694, 2746, 2765,
    2825, 2844, 2851, 2887, 2895, 2926, 2943, 2966, 3061, 3093, 3094, 3128,
    3174, 3180, 3196, 3216, 3238, 3256, 3339, 3342, 3343, 3344, 3367, 3369,
    3380, 3423, 3426, 3451, 3471, 3473, 3481, 3487, 3551, 3568, 3582, 3631,
    3640, 3726, 3735, 3760, 3855, 3861, 3871, 3913, 3938, 4014, 4019, 4021,
    4062, 4065, 4100, 4133, 4203, 4248, 4303, 4353, 4398, 4478, 4482, 4699,
    4774, 4775, 4876, 4975, 5024, 5052, 5060, 5096, 5129, 5132, 5171, 5203,
    5215, 5218, 5236, 5294, 5301, 5321, 5446, 5459, 5465, 5472, 5485, 5500,
    5552, 5565, 5567, 5629, 5634, 5681, 5684, 5690, 5715, 5882, 5884, 5893,
    5908, 5930, 5942, 5969, 5990, 5992, 5999, 6137, 6189, 6306, 6351, 6471,
    6513, 6538, 6556, 6569, 6623, 6690, 6766, 6777, 6808, 6882, 6883, 6922,
    6957, 7000, 7054, 7083, 7159, 7184, 7204, 7220, 7267, 7365, 7365, 7448,
    7488, 7526, 7543, 7612, 7614, 7717, 7737, 7754, 7827, 7837, 7856, 7974,
    8155, 8197, 8273, 8308, 8367, 8412, 8541, 8560, 8588, 8681, 8747, 8761,
    8869, 8884, 8909, 8978, 9047, 9242, 9279, 9333, 9349, 9354, 9424, 9445,
    9512, 9610, 9642, 9644, 9656, 9710, 9864, 9945, 10000, 10187, 10332,
    10352, 10383, 10409, 10588, 10695, 10722, 10753, 10833, 10965, 10993,
    11016, 11036, 11396, 11420, 11467, 11496, 11531, 11594, 11626, 11637,
    11644, 11673, 11753, 11786, 11847, 11853, 11854, 11957, 12055, 12134,
    12139, 12167, 12255, 12271, 12285, 12300, 12335, 12387, 12421, 12423,
    12466, 12473, 12499, 12505, 12595, 12624, 12814, 12834, 12844, 12854,
    12889, 12898, 12917, 13015, 13089, 13094, 13105, 13113, 13121, 13121,
    13156, 13174, 13176, 13193, 13212, 13271, 13277, 13353, 13361, 13364,
    13374, 13376, 13404, 13454, 13464, 13475, 13480, 13498, 13502, 13511,
    13512, 13513, 13519, 13557, 13568, 13589, 13633, 13652, 13661, 13686,
    13686, 13721, 13723, 13762, 13779, 13830, 13879, 13997, 14015, 14020,
    14072, 14118, 14132, 14163, 14210, 14653, 14783, 14873, 14939, 15036,
    15067, 15073, 15170, 15206, 15230, 15285, 15550, 15617, 15677, 15714,
    15777, 15970, 16080, 16315, 16368, 16386, 17054, 17063, 17564, 17821,
    18047, 18182, 18281, 18458, 18478, 18652, 18994, 19596, 19671, 19718,
    19864, 20190, 20338, 20482, 20507, 20603, 20819, 20863, 20907, 21010,
    21076, 21119, 21320, 21462, 21513, 21664, 21675, 21787, 22484, 22631,
    22717, 22769, 22796, 22833, 23024, 23093, 23301, 23582, 23699, 24064,
    24092, 24618, 24674, 24717, 24859, 25427, 26089, 27505, 27507, 27637,
    27851, 27974, 28132, 28342, 28726, 29125, 29215, 29289, 29656, 30209,
    30999, 31483, 31505, 32082, 32236, 32252, 32463, 32760, 32965, 33370,
    33385, 33663, 33850, 33908, 34015, 34105, 34211, 34252, 34396, 34416,
    34420, 34476, 34564, 34597, 34618, 34633, 34681, 34681, 34683, 35002,
    35693, 36467, 36556, 36822, 36870, 37361, 37395, 38057, 38126, 38387,
    39760, 41087, 41201, 41342, 41369, 43331, 43532, 44829, 46156, 47615,
    47995, 48032, 48516, 48617, 49331, 50227, 50634, 51105, 52379, 53124,
    53383, 53688, 56242, 56946, 57056, 57610, 57624, 59881, 60369, 61580,
    62297, 62533, 64165, 64718, 68140, 68768, 68984, 69104, 73426, 75012,
    75512, 77032, 77245, 77438, 78558, 78730, 80591, 83308, 83583, 86436,
    88448, 92088, 93436, 93486, 100832, 103157, 104428, 105314, 106398,
    106778, 106925, 109280, 115850, 126247, 146361, 172292, 229220, 797704,
)


# ----------------------------------------------------------------- documents


def _rng(dist: str, tokens: int, seed: int) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(dist.encode()), tokens])


def document_lengths(dist: str, tokens: int, seed: int):
  """Endless stream of valid document lengths of a distribution."""
  rng = _rng(dist, tokens, seed)
  sizes = np.asarray(STDLIB_PY_SIZES)
  while True:
    if dist == "one_doc":
      yield tokens
    elif dist == "uniform_1k_8k":
      yield int(rng.integers(1024, 8192, endpoint=True))
    elif dist == "stdlib_mix":
      yield int(min(rng.choice(sizes), tokens))
    elif dist == "short_128_1k":
      yield int(rng.integers(128, 1024, endpoint=True))
    else:
      raise ValueError(f"unknown distribution {dist!r}; expected one of "
                       f"{list(DISTS)}")


def pack_row(dist: str, tokens: int, multiple: int, seed: int = 0
             ) -> Tuple[np.ndarray, np.ndarray]:
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
  """One packed row and the static facts the programs depend on."""

  dist: str
  tokens: int
  layout: str                 # "pad<m>" (DUAL_CHUNK_SWAP) or "unpadded"
  cu: np.ndarray
  cuP: np.ndarray
  max_seqlen: Optional[int]   # the static bound passed to the kernels

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
    lens = np.diff(self.cu).astype(np.int64)
    return int((lens * (lens + 1) // 2).sum())


def make_row(dist: str, tokens: int, strategy: str, max_cp: int, bound: str,
             seed: int) -> Row:
  multiple = 2 * max_cp if strategy == "dual_chunk_swap" else 1
  cu, cuP = pack_row(dist, tokens, multiple, seed)
  layout = f"pad{multiple}" if multiple > 1 else "unpadded"
  w = int(np.diff(cuP).max()) if bound == "auto" else None
  return Row(dist, tokens, layout, cu, cuP, w)


# ----------------------------------------------------------------- programs


def make_mesh(cp: int):
  return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp],
                       axis_types=(AxisType.Auto,))


@contextlib.contextmanager
def collectives_replaced_by_local_copies():
  """While lowering: ``all_gather`` -> concatenation of local copies,
  ``psum_scatter`` -> local slice, ``ppermute`` -> identity. Same shapes,
  no communication: the "exchange removed" variant of a step."""
  lax = jax.lax
  saved = (lax.all_gather, lax.psum_scatter, lax.ppermute)

  def all_gather(x, axis_name, *, axis=0, tiled=False, **_):
    n = lax.axis_size(axis_name)
    return jax.tree.map(
        lambda a: (jnp.concatenate if tiled else jnp.stack)([a] * n,
                                                            axis=axis), x)

  def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False, **_):
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)

    def one(a):
      size = a.shape[scatter_dimension] // n
      out = lax.dynamic_slice_in_dim(a, i * size, size, scatter_dimension)
      return out if tiled else jnp.squeeze(out, scatter_dimension)
    return jax.tree.map(one, x)

  def ppermute(x, axis_name, perm, **_):
    del axis_name, perm
    return x

  lax.all_gather, lax.psum_scatter, lax.ppermute = (all_gather, psum_scatter,
                                                     ppermute)
  try:
    yield
  finally:
    lax.all_gather, lax.psum_scatter, lax.ppermute = saved


_COLLECTIVE_RE = re.compile(
    r"stablehlo\.(all_gather|reduce_scatter|collective_permute|all_to_all|"
    r"all_reduce)")


def _with_pass(forward: Callable, pass_name: str) -> Callable:
  """Program of signature ``(q, k, v, dout, cu, cuP)`` for a pass."""
  if pass_name == "fwd":
    return lambda q, k, v, dout, cu, cuP: forward(q, k, v, cu, cuP)

  def loss(q, k, v, dout, cu, cuP):
    out = forward(q, k, v, cu, cuP)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def cp_forward(mesh, strategy: str, backend: str, max_seqlen):
  def forward(q, k, v, cu, cuP):
    return jax_cp.cp_attention(q, k, v, cu, cuP, mesh=mesh, cp_axis="cp",
                               load_balancing_strategy=strategy,
                               backend=backend, max_seqlen=max_seqlen)
  return forward


def primitive_forward(backend: str, max_seqlen):
  def forward(q, k, v, cu, cuP):
    lens = cu[1:] - cu[:-1]
    offs = cuP[:-1]
    return jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type="causal_top_left",
        backend=backend, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
  return forward


def dense_forward(implementation: Optional[str]):
  def forward(q, k, v, cu, cuP):
    del cu, cuP
    return jax.nn.dot_product_attention(q[None], k[None], v[None],
                                        is_causal=True,
                                        implementation=implementation)[0]
  return forward


def core_exchange(strategy: str, cp: int, tokens: int, max_seqlen):
  """The core's static exchange choice (``jax_cp.kv_exchange``), or None
  when this jax_cp has no such module."""
  try:
    from jax_cp.kv_exchange import choose_exchange  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return choose_exchange(strategy == "no_load_balance", "cp", cp, tokens,
                         tokens if max_seqlen is None else max_seqlen)


def exchange_name(strategy: str, cp: int, tokens: int, max_seqlen) -> str:
  ex = core_exchange(strategy, cp, tokens, max_seqlen)
  if ex is None:
    return "all_gather (benchmark's copy)"
  if ex.kind == "halo":
    return f"halo ({ex.halo_tokens} tokens)"
  return ex.kind


def exchange_program(mesh, strategy: str, tokens: int, pass_name: str,
                     max_seqlen):
  """The K/V exchange of a step alone, in a ``shard_map`` like the core's.

  Uses the core's own exchange (``jax_cp.kv_exchange``: all-gather +
  DUAL_CHUNK_SWAP restore, or NO_LOAD_BALANCE's bounded halo) when present,
  else an all-gather (+ restore) written here. fwd+bwd adds the gradient
  path (un-restore + reduce-scatter, or the reverse halo permutes) on a
  buffer-sized dK|dV. XLA merges the backward's identical re-gather with the
  forward's, so it is not repeated here.
  """
  cp = mesh.shape["cp"]
  dcs = strategy == "dual_chunk_swap"
  ex = core_exchange(strategy, cp, tokens, max_seqlen)

  def local_core(k, v, cuP):
    kb, vb = ex.gather(k[None], v[None], cuP[None])
    out = jnp.concatenate([kb, vb], axis=2)
    if pass_name == "fwd":
      return out, jnp.zeros((1,), k.dtype)
    dk, dv = jax.lax.optimization_barrier((kb, vb))
    dk, dv = ex.scatter(dk, dv, cuP[None])
    return out, jnp.concatenate([dk, dv], axis=2)[0]

  def local_own(k, v, cuP):
    kv = jnp.concatenate([k, v], axis=1)
    g = jax.lax.all_gather(kv, "cp", axis=0, tiled=True)
    if dcs:
      idx = partition.gathered_to_sequence_index(cuP, cp, tokens)
      g = jnp.take(g, idx, axis=0)
    if pass_name == "fwd":
      return g[None], jnp.zeros((1,), kv.dtype)
    dkv = jax.lax.optimization_barrier(g)
    if dcs:
      pos = partition.sequence_to_gathered_index(cuP, cp, tokens)
      dkv = jnp.take(dkv, pos, axis=0)
    return g[None], jax.lax.psum_scatter(dkv, "cp", scatter_dimension=0,
                                         tiled=True)

  mapped = jax.shard_map(local_own if ex is None else local_core, mesh=mesh,
                         in_specs=(P("cp"), P("cp"), P()),
                         out_specs=(P("cp"), P("cp")), check_vma=False)
  return lambda q, k, v, dout, cu, cuP: mapped(k, v, cuP)


@dataclasses.dataclass
class Program:
  """One jitted program: lowered on the main thread, compiled in a pool."""

  key: Tuple
  build: Callable[[], Callable]
  cp: int
  num_docs: int
  no_collectives: bool = False
  lowered: Any = None
  future: Any = None
  error: Optional[str] = None
  note: Optional[str] = None
  lower_s: float = 0.0


@dataclasses.dataclass
class Measurement:
  record: Dict[str, Any]
  program: Program
  row: Row


# ----------------------------------------------------------------- inputs


def _shardings(cp: int):
  mesh = make_mesh(cp)
  return mesh, NamedSharding(mesh, P("cp")), NamedSharding(mesh, P())


def abstract_args(cp: int, tokens: int, hq: int, hkv: int, d: int, dtype,
                  num_docs: int):
  _, sh, rep = _shardings(cp)
  s = lambda shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
  meta = jax.ShapeDtypeStruct((num_docs + 1,), jnp.int32, sharding=rep)
  return (s((tokens, hq, d)), s((tokens, hkv, d)), s((tokens, hkv, d)),
          s((tokens, hq, d)), meta, meta)


def make_inputs(cp: int, tokens: int, hq: int, hkv: int, d: int, dtype,
                seed: int, count: int = 2):
  """``count`` sets of random (q, k, v, dout), token axis sharded over the
  first ``cp`` devices. Random tokens need no reorder_for_cp: any
  permutation of random data is random data of the same layout."""
  _, sh, _ = _shardings(cp)

  def gen(seed_):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed_), 4)
    return (jax.random.normal(kq, (tokens, hq, d), dtype),
            jax.random.normal(kk, (tokens, hkv, d), dtype),
            jax.random.normal(kv, (tokens, hkv, d), dtype),
            jax.random.normal(kd, (tokens, hq, d), dtype))

  gen = jax.jit(gen, out_shardings=(sh,) * 4)
  return [jax.block_until_ready(gen(np.uint32(seed + i)))
          for i in range(count)]


# ----------------------------------------------------------------- plan


def _flops(row: Row, hq: int, d: int, pass_name: str) -> float:
  f = 4.0 * hq * d * row.pairs
  return f * FWD_BWD_FLOP_FACTOR if pass_name == "fwd_bwd" else f


def build_plan(args) -> Tuple[Dict[Tuple, Program], List[Measurement]]:
  """All programs (deduplicated by key) and measurements, in run order."""
  programs: Dict[Tuple, Program] = {}
  plan: List[Measurement] = []
  seen = set()
  max_cp = max(args.cp)
  dtype = jnp.dtype(args.dtype)
  hq, d = args.hq, args.head_dim

  def add(kind, row, cp, strategy, pass_name, hkv, key, build,
          no_collectives=False):
    """Plans one measurement (once per row) and its program (once per
    key: rows with the same static shape share a program)."""
    ident = (kind, row.row_id, cp, strategy, pass_name, hkv)
    if ident in seen:
      return
    seen.add(ident)
    if key not in programs:
      programs[key] = Program(key, build, cp, row.num_docs, no_collectives)
    plan.append(Measurement(dict(
        kind=kind, dist=row.dist, tokens=row.tokens, hq=hq, hkv=hkv,
        head_dim=d, dtype=dtype.name, strategy=strategy, cp=cp,
        pass_name=pass_name, layout=row.layout, row_id=row.row_id,
        max_seqlen=row.max_seqlen, bound=args.max_seqlen_bound,
        num_docs=row.num_docs, valid_tokens=row.valid_tokens,
        longest_padded_doc=row.longest_padded_doc,
        flops=_flops(row, hq, d, pass_name), backend=args.backend,
        exchange=(exchange_name(strategy, cp, row.tokens, row.max_seqlen)
                  if cp > 1 else None)),
        programs[key], row))

  # Run order = priority under --budget-s: the issue's targets first
  # (fwd+bwd; one document, short documents), stdlib_mix last.
  passes = sorted(args.passes, key=PASSES[::-1].index)
  dists = sorted(args.dists, key=_DIST_PRIORITY.index)
  impl = "cudnn" if args.backend == "cudnn" else None
  exposed = args.exchange in ("both", "exposed")
  standalone = args.exchange in ("both", "standalone")
  for tokens in args.tokens:
    for hkv in args.hkv:
      shape = (tokens, hq, hkv, d, dtype.name)
      for p, dist in itertools.product(passes, dists):
        rows = {s: make_row(dist, tokens, s, max_cp, args.max_seqlen_bound,
                            args.seed) for s in args.strategies}
        if args.references and dist == "one_doc":
          row = next(iter(rows.values()))
          add("dense_reference", row, 1, None, p, hkv,
              ("dense",) + shape + (p,),
              lambda p=p: _with_pass(dense_forward(impl), p))
        for st, row in rows.items():
          w, n = row.max_seqlen, row.num_docs
          if args.references:
            add("fused_primitive", row, 1, None, p, hkv,
                ("primitive",) + shape + (p, n, w),
                lambda p=p, w=w: _with_pass(primitive_forward(args.backend,
                                                              w), p))
          for cp in args.cp:
            s = st if cp > 1 else None     # cp=1 ignores the strategy
            add("cp_attention", row, cp, s, p, hkv,
                ("cp_attention",) + shape + (p, cp, s, n, w),
                lambda p=p, cp=cp, st=st, w=w: _with_pass(
                    cp_forward(make_mesh(cp), st, args.backend, w), p))
            if cp == 1:
              continue
            if exposed:
              add("cp_attention_nocomm", row, cp, s, p, hkv,
                  ("cp_attention_nocomm",) + shape + (p, cp, s, n, w),
                  lambda p=p, cp=cp, st=st, w=w: _with_pass(
                      cp_forward(make_mesh(cp), st, args.backend, w), p),
                  no_collectives=True)
            if standalone:
              add("exchange_standalone", row, cp, s, p, hkv,
                  ("exchange",) + shape + (p, cp, s, n, w),
                  lambda p=p, cp=cp, st=st, t=tokens, w=w: exchange_program(
                      make_mesh(cp), st, t, p, w))
  return programs, plan


# ----------------------------------------------------------------- running


_COMPILES = {"count": 0, "seconds": 0.0}
_LISTENING = False


def _count_compiles():
  global _LISTENING
  if _LISTENING:
    return

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      _COMPILES["count"] += 1
      _COMPILES["seconds"] += duration
  jax.monitoring.register_event_duration_secs_listener(listener)
  _LISTENING = True


def _short_error(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}"
  return msg if len(msg) < 600 else msg[:600] + " ..."


def _timed_compile(lowered):
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t0


def lower_and_compile(programs: Dict[Tuple, Program], plan, args, log):
  """Lowers every program on the main thread, then compiles them.

  Lowering (tracing, MLIR) must not run while another thread compiles: the
  two share MLIR state, and overlapping them crashed the process on CPU.
  Compiles of already-lowered programs run in a pool of
  ``--compile-workers`` threads (1: sequentially on the main thread).
  """
  dtype = jnp.dtype(args.dtype)
  first_use = {}
  for m in plan:
    first_use.setdefault(m.program.key, m)
  for key, prog in programs.items():
    m = first_use[key]
    t0 = time.perf_counter()
    try:
      fn = jax.jit(prog.build())
      aargs = abstract_args(prog.cp, m.record["tokens"], m.record["hq"],
                            m.record["hkv"], m.record["head_dim"], dtype,
                            prog.num_docs)
      ctx = (collectives_replaced_by_local_copies() if prog.no_collectives
             else contextlib.nullcontext())
      with ctx:
        prog.lowered = fn.lower(*aargs)
      if prog.no_collectives:
        # Whatever communication the replacement missed stays in the
        # "exchange removed" step and is then missing from "exposed".
        left = sorted(set(_COLLECTIVE_RE.findall(prog.lowered.as_text())))
        prog.note = ("collectives left in the no-exchange variant: "
                     + ", ".join(left)) if left else None
    except Exception as e:  # pylint: disable=broad-except
      prog.error = "lowering: " + _short_error(e)
      if args.verbose:
        traceback.print_exc()
    prog.lower_s = time.perf_counter() - t0
  todo = [p for p in programs.values() if p.lowered is not None]
  log(f"lowered {len(programs)} programs; compiling {len(todo)} with "
      f"{args.compile_workers} thread(s) ...")
  if args.compile_workers <= 1:
    for prog in todo:
      prog.future = concurrent.futures.Future()
      try:
        prog.future.set_result(_timed_compile(prog.lowered))
      except Exception as e:  # pylint: disable=broad-except
        prog.future.set_exception(e)
  else:
    with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
      for prog in todo:
        prog.future = pool.submit(_timed_compile, prog.lowered)
      concurrent.futures.wait([p.future for p in todo])
  for prog in todo:
    prog.lowered = None          # free the MLIR modules


def time_program(compiled, arg_sets, warmup: int, reps: int,
                 pipeline_ms: float = 40.0):
  """Host-clock timings of a compiled program, alternating input sets.

  Returns ``(first_call_s, synced, pipelined, steady, depth)``:

  * ``synced``: seconds of each of ``reps`` single calls, each followed by
    ``block_until_ready`` (includes the host's dispatch latency, which a
    step of a few ms cannot hide);
  * ``pipelined``: seconds per call of ``reps`` blocks of ``depth`` calls
    dispatched back to back and waited for once (JAX dispatches
    asynchronously, so the next call's host work overlaps this one's GPU
    work). ``depth`` is chosen so that a block lasts about ``pipeline_ms``
    (at most 32; 1 for long programs, whose numbers then coincide). Each
    block still pays one fill and drain of the pipeline;
  * ``steady``: the slope ``(t(2*depth) - t(depth)) / depth`` of a block's
    time over its length, each rep from a pair of blocks: the time per call
    once the pipeline is full, which is what a training step of many layers
    sees (fill and drain cancel).
  """
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(*arg_sets[0]))
  first = time.perf_counter() - t0
  for i in range(1, warmup):
    jax.block_until_ready(compiled(*arg_sets[i % len(arg_sets)]))
  synced = []
  for i in range(reps):
    a = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    out = compiled(*a)
    jax.block_until_ready(out)
    synced.append(time.perf_counter() - t0)
    del out
  depth = pipeline_depth(statistics.median(synced), pipeline_ms)
  pipelined, steady = [], []
  for _ in range(reps):
    t1 = block_seconds(compiled, arg_sets, depth)
    t2 = block_seconds(compiled, arg_sets, 2 * depth)
    pipelined.append(t1 / depth)
    steady.append((t2 - t1) / depth)
  return first, synced, pipelined, steady, depth


def pipeline_depth(call_s: float, pipeline_ms: float = 40.0) -> int:
  """Calls per block so that a block lasts about ``pipeline_ms`` (1..32)."""
  return int(min(32, max(1, round(pipeline_ms * 1e-3 / call_s))))


def block_seconds(compiled, arg_sets, n: int) -> float:
  """Seconds for ``n`` calls dispatched back to back (alternating input
  sets) and waited for once."""
  t0 = time.perf_counter()
  outs = [compiled(*arg_sets[j % len(arg_sets)]) for j in range(n)]
  jax.block_until_ready(outs)
  return time.perf_counter() - t0


def cudnn_graph_builds() -> Optional[int]:
  """cuDNN graphs built so far by jax_cp's extension (None without it)."""
  try:
    from jax_cp.attention import cudnn  # pylint: disable=import-outside-toplevel
    return int(cudnn.graph_cache_stats()["builds"])
  except Exception:  # pylint: disable=broad-except
    return None


def environment(args) -> Dict[str, Any]:
  import jaxlib  # pylint: disable=import-outside-toplevel
  env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
             jax=jax.__version__, jaxlib=jaxlib.__version__,
             jax_cp=getattr(jax_cp, "__version__", None),
             python=sys.version.split()[0],
             platform=jax.default_backend(),
             device_kind=jax.devices()[0].device_kind,
             device_count=jax.device_count(), cudnn=None)
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    if cuda_versions is not None:
      env["cudnn"] = int(cuda_versions.cudnn_get_version())
      env["cuda_runtime"] = int(cuda_versions.cuda_runtime_get_version())
  except Exception:  # pylint: disable=broad-except
    pass
  return env


# ----------------------------------------------------------------- results


def _key(r, **override):
  k = dict(dist=r["dist"], tokens=r["tokens"], hq=r["hq"], hkv=r["hkv"],
           head_dim=r["head_dim"], dtype=r["dtype"], pass_name=r["pass_name"],
           bound=r["bound"])
  k.update(override)
  return tuple(sorted(k.items()))


def derive(records: List[Dict[str, Any]]) -> None:
  """Adds TFLOP/s, speed-ups, efficiencies, exchange fractions and
  reference ratios to the records, in place."""
  ok = [r for r in records if r.get("ms_median") is not None]
  by = {}
  for r in ok:
    by[_key(r, kind=r["kind"], row_id=r["row_id"], cp=r["cp"],
            strategy=r["strategy"])] = r
  for r in ok:
    r["tflops_per_gpu"] = r["flops"] / (r["ms_median"] * 1e-3) / r["cp"] / 1e12
  for r in ok:
    if r["kind"] != "cp_attention":
      continue
    base = by.get(_key(r, kind="cp_attention", row_id=r["row_id"], cp=1,
                       strategy=None))
    if base is not None:
      r["ms_cp1"] = base["ms_median"]
      r["speedup"] = base["ms_median"] / r["ms_median"]
      r["efficiency"] = r["speedup"] / r["cp"]
    if r["cp"] > 1:
      nc = by.get(_key(r, kind="cp_attention_nocomm", row_id=r["row_id"],
                       cp=r["cp"], strategy=r["strategy"]))
      if nc is not None:
        if nc.get("note"):
          r["exposed_caveat"] = nc["note"]
        r["nocomm_ms"] = nc["ms_median"]
        r["exposed_exchange_ms"] = r["ms_median"] - nc["ms_median"]
        r["exposed_exchange_fraction"] = (r["exposed_exchange_ms"]
                                          / r["ms_median"])
      ex = by.get(_key(r, kind="exchange_standalone", row_id=r["row_id"],
                       cp=r["cp"], strategy=r["strategy"]))
      if ex is not None:
        r["standalone_exchange_ms"] = ex["ms_median"]
        r["standalone_exchange_fraction"] = ex["ms_median"] / r["ms_median"]
    else:
      prim = by.get(_key(r, kind="fused_primitive", row_id=r["row_id"], cp=1,
                         strategy=None))
      if prim is not None:
        r["primitive_ms"] = prim["ms_median"]
        r["overhead_vs_primitive"] = r["ms_median"] / prim["ms_median"] - 1
      dense = [x for x in ok if x["kind"] == "dense_reference"
               and _key(x) == _key(r) and r["dist"] == "one_doc"]
      if dense:
        r["dense_ms"] = dense[0]["ms_median"]


def _predict(m: Measurement, dtype_bytes: int) -> Dict[str, Any]:
  r = m.record
  if r["kind"] not in ("cp_attention", "cp_attention_nocomm"):
    return {}
  strategy = r["strategy"] or "no_load_balance"
  try:
    est = jax_cp.estimate_cp_imbalance(
        m.row.cu, m.row.cuP, r["cp"], strategy, num_heads_q=r["hq"],
        num_heads_kv=r["hkv"], head_dim=r["head_dim"],
        dtype_bytes=dtype_bytes, max_seqlen=m.row.max_seqlen)
  except ValueError as e:
    return {"prediction_error": str(e)}
  return dict(
      predicted_imbalance=est.imbalance,
      predicted_ms=1e3 * est.predicted_time_s(
          include_backward=r["pass_name"] == "fwd_bwd"),
      allgather_bytes_per_rank=est.allgather_bytes,
      halo_bytes_per_rank=est.halo_bytes)


def write_json(path: str, payload: Dict[str, Any]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, default=str)
  os.replace(tmp, path)


def print_table(records, out=sys.stdout) -> None:
  rows = [r for r in records if r["kind"] == "cp_attention"]
  hdr = (f"{'dist':<14}{'T':>7}{'Hkv':>4} {'pass':<8}{'strategy':<16}"
         f"{'cp':>3}{'ms':>10}{'TF/s/GPU':>9}{'speedup':>8}{'eff':>6}"
         f"{'imb':>6}{'expo%':>7}{'stand%':>7}{'vsPrim%':>8}")
  print(hdr, file=out)
  print("-" * len(hdr), file=out)
  f = lambda x, fmt: format(x, fmt) if isinstance(x, (int, float)) else "-"
  for r in rows:
    if r.get("ms_median") is None:
      print(f"{r['dist']:<14}{r['tokens']:>7}{r['hkv']:>4} "
            f"{r['pass_name']:<8}{str(r['strategy']):<16}{r['cp']:>3}  "
            f"ERROR {str(r.get('error'))[:60]}", file=out)
      continue
    pct = lambda k: f(100 * r[k], ".1f") if k in r else "-"
    print(f"{r['dist']:<14}{r['tokens']:>7}{r['hkv']:>4} {r['pass_name']:<8}"
          f"{str(r['strategy'] or '(cp=1)'):<16}{r['cp']:>3}"
          f"{f(r['ms_median'], '.3f'):>10}"
          f"{f(r.get('tflops_per_gpu'), '.0f'):>9}"
          f"{f(r.get('speedup'), '.2f'):>8}{f(r.get('efficiency'), '.2f'):>6}"
          f"{f(r.get('predicted_imbalance'), '.2f'):>6}"
          f"{pct('exposed_exchange_fraction'):>7}"
          f"{pct('standalone_exchange_fraction'):>7}"
          f"{pct('overhead_vs_primitive'):>8}", file=out)


# ----------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="preset: T=65536, Hkv=8, all dists, cp 1 2 4, both "
                      "strategies,\nfwd and fwd_bwd (explicit flags win)")
  p.add_argument("--cp", type=int, nargs="+")
  p.add_argument("--strategies", nargs="+", choices=STRATEGIES)
  p.add_argument("--hkv", type=int, nargs="+")
  p.add_argument("--tokens", type=int, nargs="+")
  p.add_argument("--dists", nargs="+", choices=DISTS)
  p.add_argument("--passes", nargs="+", choices=PASSES)
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--max-seqlen-bound", choices=("auto", "none"),
                 default="auto",
                 help="auto: max_seqlen = longest padded document of the row")
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--timing", choices=("pipelined", "steady", "synced"),
                 default="pipelined",
                 help="which timing is the record's ms_median (all are "
                      "recorded; see benchmarks/README.md)")
  p.add_argument("--exchange", choices=("both", "exposed", "standalone",
                                        "none"), default="both")
  p.add_argument("--no-references", dest="references", action="store_false",
                 help="skip jax.nn.dot_product_attention and fused_attention")
  p.add_argument("--compile-workers", type=int,
                 default=max(1, min(16, os.cpu_count() or 1)))
  p.add_argument("--budget-s", type=float, default=None,
                 help="stop measuring (record 'skipped') after this many "
                      "seconds of wall time")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(_REPO, "benchmarks",
                                               "results"))
  p.add_argument("--dry-run", action="store_true",
                 help="print the plan (programs, measurements) and exit")
  p.add_argument("--verbose", action="store_true")
  args = p.parse_args(argv)
  preset = QUICK if args.quick else FULL
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, list(value))
  if args.reps < 1 or args.warmup < 1:
    p.error("--reps and --warmup must be >= 1")
  for t in args.tokens:
    if t % (2 * max(args.cp)):
      p.error(f"--tokens {t} must be a multiple of 2*max(cp)="
              f"{2 * max(args.cp)}")
  if max(args.cp) > jax.device_count():
    p.error(f"--cp {max(args.cp)} needs that many devices; "
            f"{jax.device_count()} present")
  return args


def main(argv: Optional[Sequence[str]] = None) -> str:
  """Runs the benchmark; returns the path of the JSON written."""
  args = parse_args(argv)
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}",
                          flush=True)
  _count_compiles()
  compiles0 = dict(_COMPILES)
  programs, plan = build_plan(args)
  log(f"plan: {len(programs)} programs, {len(plan)} measurements")
  if args.dry_run:
    for m in plan:
      r = m.record
      print(r["kind"], r["dist"], r["tokens"], r["hkv"], r["pass_name"],
            r["strategy"], r["cp"], r["layout"], r["max_seqlen"],
            r["num_docs"])
    return ""
  try:
    from jax_cp.attention.registry import resolve_backend  # pylint: disable=import-outside-toplevel
    resolve_backend(args.backend)
  except ValueError as e:
    raise SystemExit(f"backend {args.backend!r} unusable here: {e}")

  env = environment(args)
  os.makedirs(args.out, exist_ok=True)
  gpu = re.sub(r"[^A-Za-z0-9]+", "_", env["device_kind"]).strip("_")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = os.path.join(args.out, f"results_{stamp}_{gpu}.json")
  payload = dict(env=env, args=vars(args), records=[], summary={})

  lower_and_compile(programs, plan, args, log)
  compile_wall = time.perf_counter() - start
  log("compiled; measuring")
  dtype_bytes = jnp.dtype(args.dtype).itemsize
  inputs: Dict[Tuple, Any] = {}
  meta: Dict[Tuple, Any] = {}
  group = None
  for i, m in enumerate(plan):
    r = dict(m.record)
    r.update(_predict(m, dtype_bytes))
    prog = m.program
    this_group = (r["tokens"], r["hkv"])
    if this_group != group:
      inputs.clear()
      meta.clear()
      gc.collect()
      group = this_group
    r["lower_s"] = prog.lower_s
    if prog.note:
      r["note"] = prog.note
    elapsed = time.perf_counter() - start
    if args.budget_s is not None and elapsed > args.budget_s:
      r["error"] = "skipped: --budget-s exceeded"
    elif prog.error or prog.future is None:
      r["error"] = prog.error or "not compiled"
    else:
      try:
        compiled, r["compile_s"] = prog.future.result()
        ikey = (prog.cp,) + this_group
        if ikey not in inputs:
          inputs[ikey] = make_inputs(prog.cp, r["tokens"], r["hq"], r["hkv"],
                                     r["head_dim"], jnp.dtype(args.dtype),
                                     args.seed)
        mkey = (prog.cp, m.row.row_id)
        if mkey not in meta:
          rep = NamedSharding(make_mesh(prog.cp), P())
          meta[mkey] = tuple(jax.device_put(x, rep) for x in (m.row.cu,
                                                              m.row.cuP))
        arg_sets = [tuple(s) + meta[mkey] for s in inputs[ikey]]
        builds0 = cudnn_graph_builds()
        first, synced, pipelined, steady, depth = time_program(
            compiled, arg_sets, args.warmup, args.reps)
        times = dict(pipelined=pipelined, synced=synced,
                     steady=steady)[args.timing]
        builds1 = cudnn_graph_builds()
        if builds0 is not None and builds1 is not None:
          r["cudnn_graph_builds"] = builds1 - builds0
        ms = [1e3 * t for t in times]
        r.update(ms_median=statistics.median(ms), ms_min=min(ms),
                 ms_mean=statistics.fmean(ms), ms_all=ms, reps=len(ms),
                 first_call_s=first, error=None, timing=args.timing,
                 ms_synced_median=1e3 * statistics.median(synced),
                 ms_pipelined_median=1e3 * statistics.median(pipelined),
                 ms_steady_median=1e3 * statistics.median(steady),
                 pipeline_depth=depth)
      except Exception as e:  # pylint: disable=broad-except
        r["error"] = _short_error(e)
        if args.verbose:
          traceback.print_exc()
        gc.collect()
    payload["records"].append(r)
    status = (f"{r['ms_median']:.3f} ms" if r.get("ms_median") is not None
              else f"ERROR {r['error'][:100]}")
    log(f"{i + 1}/{len(plan)} {r['kind']} {r['dist']} T={r['tokens']} "
        f"Hkv={r['hkv']} {r['pass_name']} {r['strategy']} cp={r['cp']}: "
        f"{status}")
    derive(payload["records"])
    payload["summary"] = dict(
        wall_s=time.perf_counter() - start, compile_phase_s=compile_wall,
        programs=len(programs), measurements=len(plan),
        xla_compiles=_COMPILES["count"] - compiles0["count"],
        xla_compile_s=_COMPILES["seconds"] - compiles0["seconds"],
        first_calls_s=sum(x.get("first_call_s") or 0.0
                          for x in payload["records"]),
        cudnn_graph_builds=sum(x.get("cudnn_graph_builds") or 0
                               for x in payload["records"]))
    write_json(path, payload)
  inputs.clear()
  print_table(payload["records"])
  s = payload["summary"]
  log(f"done: {s['measurements']} measurements of {s['programs']} programs, "
      f"{s['xla_compiles']} XLA compiles; wrote {path}")
  return path


if __name__ == "__main__":
  main()
