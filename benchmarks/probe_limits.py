"""Where cuDNN's ragged SDPA stops being exact, and what 64-bit offsets cost.

Runs single ``"cudnn"`` backend calls, forward and backward, at sizes around
2^30 elements per tensor and checks every output (out, lse, dq, dk, dv)
against the exact subset reference (:mod:`jax_cp.attention.exactness`: a
cotangent on 128 random query rows makes a float32 reference cheap at any
length). Each case runs once with 32-bit and once with 64-bit ragged
element offsets (the ``offset_bits`` attribute the backend otherwise picks
with :func:`jax_cp.attention.cudnn.ragged_offset_bits`), so the table says
both where the 32-bit path breaks and whether 64-bit offsets alone fix it.

Layouts: ``one_doc`` (the whole row one document: the tiled, dense graph,
no ragged offsets), ``mixed`` (the row cut at 24 random points: 25
documents, the ragged graph), ``short`` (documents of 1k-8k tokens), and
``cp`` (Tq != Tkv as a CP rank's call runs: Q holds the last 1/cp of each
document, K/V the whole documents, bottom-right causal).

``--ab`` times forward+backward with 32- against 64-bit offsets on one call
below the limit, the time per causal token pair of a call at 1.2x the
limit against one below it, and, at 262144 x 32/8/128 (12.9 GB of
workspace), the backward split over GQA head groups (4 sub-calls, the
default bound) against one call, each paired in alternation
(``benchmarks.timing``).

Run on one GPU (memory: the largest case holds about 80 GB)::

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m benchmarks.probe_limits \
      --out benchmarks/results
  python -m benchmarks.probe_limits --ab --out benchmarks/results

Each run writes ``limits_<date>_<gpu>.json`` and prints a markdown table.

Every backward is one cuDNN call: the probe turns the backend's split over
GQA head groups off (``JAX_CP_CUDNN_BWD_SCRATCH_GIB=inf``, unless the
caller sets the variable), since the limit it looks for is one call's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from unittest import mock

import numpy as np

from jax_cp.attention.cudnn_workspace import SCRATCH_LIMIT_ENV as SCRATCH_ENV


@dataclasses.dataclass(frozen=True)
class Case:
  """One call: layout, sizes, dtype."""

  layout: str        # one_doc | mixed | short | cp
  tokens: int        # T of the row (Tkv; Tq too unless layout == "cp")
  hq: int
  hkv: int
  d: int
  dtype: str = "bfloat16"
  cp: int = 8        # layout "cp": Q holds the last 1/cp of each document

  @property
  def name(self) -> str:
    return (f"{self.layout} T={self.tokens} {self.hq}/{self.hkv}/{self.d} "
            f"{self.dtype}")


def segments_for(case: Case, seed: int = 0):
  """Host arrays (q_lens, kv_lens, q_offsets, kv_offsets, max_q, max_kv,
  tq, mask, tiled) of a case's call."""
  rng = np.random.default_rng(seed)
  t = case.tokens
  if case.layout == "one_doc":
    return ([t], [t], [0], [0], t, t, t, "causal_top_left", True)
  if case.layout == "mixed":
    cuts = np.sort(rng.choice(np.arange(1, t), size=24, replace=False))
    bounds = np.concatenate([[0], cuts, [t]])
  elif case.layout in ("short", "cp"):
    lens = []
    while sum(lens) < t:
      lens.append(int(rng.integers(1024, 8193)))
    lens[-1] -= sum(lens) - t
    if lens[-1] <= 0:
      lens.pop()
      lens[-1] += t - sum(lens)
    bounds = np.concatenate([[0], np.cumsum(lens)])
  else:
    raise ValueError(f"unknown layout {case.layout!r}")
  lens = np.diff(bounds)
  starts = bounds[:-1]
  if case.layout == "cp":
    q_lens = -(-lens // case.cp)
    q_off = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    return (q_lens, lens, q_off, starts, int(q_lens.max()), int(lens.max()),
            int(q_lens.sum()), "causal_bottom_right", False)
  return (lens, lens, starts, starts, int(lens.max()), int(lens.max()), t,
          "causal_top_left", False)


def run_case(case: Case, bits: int | None, rows: int, seed: int) -> dict:
  """One case's check with ``bits``-wide offsets (None: the backend's own
  choice); a failing call is recorded in ``error``."""
  import jax
  import jax.numpy as jnp

  from jax_cp.attention import cudnn, exactness
  from jax_cp.attention.backend import Segments

  (q_lens, kv_lens, q_off, kv_off, max_q, max_kv, tq, mask,
   tiled) = segments_for(case, seed)
  seg = Segments(jnp.asarray(q_lens, jnp.int32),
                 jnp.asarray(kv_lens, jnp.int32),
                 jnp.asarray(q_off, jnp.int32),
                 jnp.asarray(kv_off, jnp.int32), max_q, max_kv,
                 rows_see_keys=True, tiled=tiled)
  dtype = jnp.dtype(case.dtype)
  key = jax.random.PRNGKey(seed)
  kq, kk, kv_ = jax.random.split(key, 3)
  q = jax.random.normal(kq, (tq, case.hq, case.d), dtype)
  k = jax.random.normal(kk, (case.tokens, case.hkv, case.d), dtype)
  v = jax.random.normal(kv_, (case.tokens, case.hkv, case.d), dtype)
  chosen = cudnn.ragged_offset_bits
  if bits is not None:
    cudnn.ragged_offset_bits = lambda *a, **kw: bits
  t0 = time.perf_counter()
  try:
    errs = exactness.check_call(cudnn.BACKEND, q, k, v, seg, mask=mask,
                                rows=rows, seed=seed)
    error = None
  except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
    errs, error = {}, f"{type(e).__name__}: {str(e)[:300]}"
  finally:
    cudnn.ragged_offset_bits = chosen
  elapsed = time.perf_counter() - t0
  del q, k, v
  hqd = case.hq * case.d
  default_bits = chosen((tq, case.hq, case.d),
                        (case.tokens, case.hkv, case.d), len(q_lens), max_q)
  return dict(case=dataclasses.asdict(case), name=case.name,
              bits=default_bits if bits is None else bits,
              tq=tq, tkv=case.tokens, mask=mask, tiled=tiled,
              segments=len(q_lens),
              q_elements=tq * hqd, kv_elements=case.tokens * case.hkv * case.d,
              kv_full_head_elements=case.tokens * hqd,
              errors=errs, error=error, seconds=round(elapsed, 2),
              default_bits=default_bits)


#: The sweep, most informative first (a run cut short keeps what it wrote).
CASES = (
    Case("mixed", 262144, 32, 8, 128),    # T*Hq*D = 2^30: broke with int32
    Case("mixed", 131072, 32, 8, 128),    # 2^29: exact with int32
    Case("mixed", 196608, 32, 8, 128),    # 1.5 * 2^29
    Case("cp", 1048576, 32, 8, 128),      # K/V 2^30, full heads 2^32
    Case("mixed", 524288, 32, 8, 64),     # 2^30
    Case("mixed", 1048576, 32, 8, 64),    # 2^31 of Q
    Case("mixed", 262144, 32, 8, 128, "float16"),
    Case("mixed", 262144, 8, 8, 128),     # MHA: no full-head buffers, 2^28
    Case("mixed", 1048576, 8, 8, 128),    # MHA 2^30
    Case("mixed", 2097152, 8, 8, 128),    # MHA 2^31
    Case("short", 262144, 32, 8, 128),    # 1k-8k documents, 2^30
    Case("mixed", 393216, 32, 8, 128),    # 1.5 * 2^30
    Case("one_doc", 1048576, 32, 8, 64),  # tiled at 2^31
    Case("cp", 4194304, 8, 8, 128, cp=8),   # K/V 2^32 elements, MHA
)


def _print_table(records) -> None:
  print("| case | bits | Tq·Hq·D | Tkv·Hq·D | out | lse | dq | dk | dv |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in records:
    e = r["errors"]
    cells = [f"{e[n]:.2e}" if n in e else "-" for n in
             ("out", "lse", "dq", "dk", "dv")]
    if r["error"]:
      cells = [r["error"][:60]] + [""] * 4
    print(f"| {r['name']} | {r['bits']} | "
          f"2^{math.log2(r['q_elements']):.2f} | "
          f"2^{math.log2(r['kv_full_head_elements']):.2f} | "
          + " | ".join(cells) + " |", flush=True)


def sweep(args) -> dict:
  from benchmarks import results
  records = []
  for case in CASES[:args.limit]:
    for bits in (32, 64):
      if bits == 32 and case.tokens * case.hq * case.d >= 2**31:
        continue   # int32 offsets cannot address it at all
      r = run_case(case, bits, args.rows, args.seed)
      records.append(r)
      _print_table([r])
      if args.path:
        results.write_result(args.path, dict(
            kind="limits", env=results.environment(), records=records))
  return dict(records=records)


def ab(args) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from benchmarks import timing
  from jax_cp.attention import cudnn
  from jax_cp.attention.backend import Segments
  from jax_cp.flops import causal_pairs

  def program(case: Case, bits: int | None, scratch_gib: str = "inf"):
    (q_lens, kv_lens, q_off, kv_off, max_q, max_kv, tq, mask,
     tiled) = segments_for(case, args.seed)
    seg = Segments(jnp.asarray(q_lens, jnp.int32),
                   jnp.asarray(kv_lens, jnp.int32),
                   jnp.asarray(q_off, jnp.int32),
                   jnp.asarray(kv_off, jnp.int32), max_q, max_kv,
                   rows_see_keys=True, tiled=tiled)
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    q = jax.random.normal(keys[0], (tq, case.hq, case.d), dtype)
    k = jax.random.normal(keys[1], (case.tokens, case.hkv, case.d), dtype)
    v = jax.random.normal(keys[2], (case.tokens, case.hkv, case.d), dtype)
    do = jax.random.normal(keys[3], q.shape, dtype)
    scale = 1.0 / math.sqrt(case.d)

    def fwd_bwd(q, k, v, do):
      # Both settings are read when the program is traced (here).
      chosen = cudnn.ragged_offset_bits
      if bits is not None:
        cudnn.ragged_offset_bits = lambda *a, **kw: bits
      try:
        with mock.patch.dict(os.environ, {SCRATCH_ENV: scratch_gib}):
          out, lse = cudnn.forward(q, k, v, seg, mask=mask, scale=scale)
          return cudnn.backward(q, k, v, out, lse, do, seg, mask=mask,
                                scale=scale)
      finally:
        cudnn.ragged_offset_bits = chosen

    fn = jax.jit(fwd_bwd)
    pairs = int(causal_pairs(np.concatenate([[0], np.cumsum(kv_lens)])))
    return fn, [(q, k, v, do)], pairs

  out = []
  below = Case("mixed", 131072, 32, 8, 128)
  fa, aa, _ = program(below, 32)
  fb, ab_, _ = program(below, 64)
  r = timing.paired(fa, aa, fb, ab_, reps=args.reps)
  out.append(dict(
      kind="int64_vs_int32_below_limit", case=below.name, ms_int32=r.ms_a,
      ms_int64=r.ms_b,
      int32_over_int64=r.ratio_median, q1=r.ratio_q1, q3=r.ratio_q3))
  print(f"{below.name}: int32 {r.ms_a:.3f} ms, int64 {r.ms_b:.3f} ms, "
        f"int32/int64 {r.ratio_median:.4f} (IQR {r.ratio_q1:.4f}-"
        f"{r.ratio_q3:.4f})", flush=True)
  del fa, aa, fb, ab_
  above = Case("mixed", 314572, 32, 8, 128)   # 1.2x the 2^30 limit
  fa, aa, pa = program(below, 32)
  fb, ab_, pb = program(above, 64)
  r = timing.paired(fa, aa, fb, ab_, reps=args.reps)
  per_pair_below = r.ms_a / pa
  per_pair_above = r.ms_b / pb
  out.append(dict(
      kind="per_pair_above_vs_below", below=below.name, above=above.name,
      ms_below=r.ms_a, ms_above=r.ms_b,
      pairs_below=pa, pairs_above=pb,
      above_per_pair_over_below=per_pair_above / per_pair_below))
  print(f"per token pair: {above.name} (int64) / {below.name} (int32) = "
        f"{per_pair_above / per_pair_below:.4f}", flush=True)
  del fa, aa, fb, ab_
  # The split over GQA head groups (the default 4 GiB workspace bound)
  # against one call, where it applies: 12.9 GB of workspace, 4 sub-calls.
  split = Case("mixed", 262144, 32, 8, 128)
  fa, aa, _ = program(split, None, "inf")
  fb, ab_, _ = program(split, None, "4")
  r = timing.paired(fa, aa, fb, ab_, reps=args.reps)
  out.append(dict(
      kind="head_groups_vs_one_call", case=split.name, ms_one_call=r.ms_a,
      ms_head_groups=r.ms_b, one_call_over_head_groups=r.ratio_median,
      q1=r.ratio_q1, q3=r.ratio_q3))
  print(f"{split.name}: one call {r.ms_a:.3f} ms, head groups {r.ms_b:.3f} "
        f"ms, one/groups {r.ratio_median:.4f} (IQR {r.ratio_q1:.4f}-"
        f"{r.ratio_q3:.4f})", flush=True)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=None, help="folder for the JSON record")
  p.add_argument("--rows", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--limit", type=int, default=len(CASES),
                 help="run only the first N cases")
  p.add_argument("--ab", action="store_true", help="time the fix's cost")
  p.add_argument("--reps", type=int, default=8)
  args = p.parse_args(argv)
  os.environ.setdefault(SCRATCH_ENV, "inf")
  import jax
  if jax.default_backend() != "gpu":
    print("probe_limits needs a GPU with the cuDNN extension", file=sys.stderr)
    return 2
  from benchmarks import results
  env = results.environment()
  args.path = None
  if args.out:
    args.path = results.result_path(args.out, "limits_ab" if args.ab else
                                    "limits", env)
  if args.ab:
    payload = dict(kind="limits_ab", env=env, records=ab(args))
    if args.path:
      results.write_result(args.path, payload)
  else:
    sweep(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
