"""Paired speed-up of CP attention against cp=1 on the same row.

    python3 benchmarks/speedup_ab.py --cp 2 --strategy no_load_balance \\
        --dists short_128_1k uniform_1k_8k one_doc --passes fwd fwd_bwd

``bench_cp.py`` times each configuration in its own stretch of the run, so
GPU clock and power drift between the cp=1 and the cp=N stretches lands in
their ratio (a few percent on the H200 machine, run to run). Here the two
programs of one row are timed in alternation, ``A B B A`` per rep, and the
speed-up is formed per rep from adjacent timings: drift cancels, and the
spread of the per-rep ratios says how far to trust the median.

Each timing is the *steady* per-call time (as in ``bench_cp.time_program``):
the slope ``(t(2n) - t(n)) / n`` of a block of ``n`` calls dispatched back to
back (``n`` so that a block lasts about 40 ms), so the pipeline's fill and
drain cancel too. Prints one line per (row, pass) and writes a JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_cp  # noqa: E402


def _program(cp: int, row, strategy: str, backend: str, pass_name: str):
  forward = bench_cp.cp_forward(bench_cp.make_mesh(cp), strategy, backend,
                                row.max_seqlen)
  return jax.jit(bench_cp._with_pass(forward, pass_name))  # pylint: disable=protected-access


def _args(cp: int, row, args) -> List[tuple]:
  sets = bench_cp.make_inputs(cp, row.tokens, args.hq, args.hkv,
                              args.head_dim, jnp.dtype(args.dtype), args.seed)
  rep = NamedSharding(bench_cp.make_mesh(cp), P())
  meta = tuple(jax.device_put(x, rep) for x in (row.cu, row.cuP))
  return [tuple(s) + meta for s in sets]


def _depth(fn, arg_sets, pipeline_ms: float) -> int:
  t = []
  for i in range(3):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    t.append(time.perf_counter() - t0)
  return bench_cp.pipeline_depth(statistics.median(t), pipeline_ms)


def _steady(fn, arg_sets, depth: int) -> float:
  """Seconds per call once the pipeline is full (one pair of blocks)."""
  t1 = bench_cp.block_seconds(fn, arg_sets, depth)
  return (bench_cp.block_seconds(fn, arg_sets, 2 * depth) - t1) / depth


def measure_pair(base, other, base_args, other_args, reps: int,
                 warmup: int = 2, pipeline_ms: float = 40.0) -> Dict:
  """Alternating A B B A steady timings; per-rep ratios base/other."""
  for _ in range(warmup):
    jax.block_until_ready(base(*base_args[0]))
    jax.block_until_ready(other(*other_args[0]))
  da = _depth(base, base_args, pipeline_ms)
  db = _depth(other, other_args, pipeline_ms)
  ta, tb, ratios = [], [], []
  for _ in range(reps):
    a1 = _steady(base, base_args, da)
    b1 = _steady(other, other_args, db)
    b2 = _steady(other, other_args, db)
    a2 = _steady(base, base_args, da)
    ta += [a1, a2]
    tb += [b1, b2]
    ratios.append((a1 + a2) / (b1 + b2))
  q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
  return dict(ms_base=1e3 * statistics.median(ta),
              ms_other=1e3 * statistics.median(tb),
              speedup_median=statistics.median(ratios),
              speedup_q1=q[0], speedup_q3=q[2],
              speedup_min=min(ratios), speedup_max=max(ratios),
              ratios=ratios, depth_base=da, depth_other=db)


def parse_args(argv: Optional[Sequence[str]] = None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cp", type=int, default=2)
  p.add_argument("--strategy", default="no_load_balance",
                 choices=bench_cp.STRATEGIES)
  p.add_argument("--dists", nargs="+", default=["short_128_1k",
                                                 "uniform_1k_8k", "one_doc"],
                 choices=bench_cp.DISTS)
  p.add_argument("--passes", nargs="+", default=["fwd", "fwd_bwd"],
                 choices=bench_cp.PASSES)
  p.add_argument("--tokens", type=int, default=65536)
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(_HERE, "results"))
  args = p.parse_args(argv)
  if args.cp < 2 or args.cp > jax.device_count():
    p.error(f"--cp must be in [2, {jax.device_count()}] (devices present)")
  if args.tokens % (2 * args.cp):
    p.error(f"--tokens must be a multiple of 2*cp={2 * args.cp}")
  if args.reps < 1:
    p.error("--reps must be >= 1")
  return args


def main(argv: Optional[Sequence[str]] = None) -> str:
  """Runs the pairs; returns the path of the JSON written."""
  args = parse_args(argv)
  records = []
  print(f"{'dist':<14}{'pass':<8}{'cp=1 ms':>9}{f'cp={args.cp} ms':>9}"
        f"{'speed-up':>10}{'IQR':>14}{'min-max':>14}")
  for dist in args.dists:
    row = bench_cp.make_row(dist, args.tokens, args.strategy, args.cp,
                            "auto", args.seed)
    base_args, other_args = _args(1, row, args), _args(args.cp, row, args)
    for pass_name in args.passes:
      base = _program(1, row, args.strategy, args.backend, pass_name)
      other = _program(args.cp, row, args.strategy, args.backend, pass_name)
      r = measure_pair(base, other, base_args, other_args, args.reps)
      r.update(dist=dist, pass_name=pass_name, cp=args.cp,
               strategy=args.strategy, tokens=args.tokens, hq=args.hq,
               hkv=args.hkv, head_dim=args.head_dim, dtype=args.dtype,
               backend=args.backend, max_seqlen=row.max_seqlen,
               reps=args.reps)
      records.append(r)
      print(f"{dist:<14}{pass_name:<8}{r['ms_base']:9.3f}{r['ms_other']:9.3f}"
            f"{r['speedup_median']:9.3f}x"
            f"  {r['speedup_q1']:.3f}-{r['speedup_q3']:.3f}"
            f"  {r['speedup_min']:.3f}-{r['speedup_max']:.3f}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  kind = jax.devices()[0].device_kind.replace(" ", "_")
  path = os.path.join(args.out, f"speedup_ab_{stamp}_{kind}.json")
  with open(path, "w") as f:
    json.dump(dict(env=dict(date=stamp, device_kind=jax.devices()[0].device_kind,
                            device_count=jax.device_count(),
                            jax=jax.__version__, args=vars(args)),
                   records=records), f, indent=1)
  print(path)
  return path


if __name__ == "__main__":
  main()
