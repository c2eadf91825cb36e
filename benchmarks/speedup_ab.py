"""Paired speed-up of CP attention against cp=1 on the same row.

From the repository root::

    python -m benchmarks.speedup_ab --cp 2 --strategy no_load_balance \\
        --dists short_128_1k uniform_1k_8k one_doc --passes fwd fwd_bwd

``--window LEFT`` runs both programs with the sliding window ``(LEFT, 0)``
(NO_LOAD_BALANCE then exchanges a halo of ``min(LEFT, max_seqlen - 1)``
tokens).

``--doc-order packed balanced`` times each row twice: as packed, and with
its documents reordered by :func:`jax_cp.balance_document_order` for the
cp=N layout (the same documents; cp=1 runs the same reordered row).

``--max-seqlen-violation`` picks the layout's guard of the ``max_seqlen``
bound: ``fallback`` (the library's default, a ``lax.cond`` in the forward
and in the backward) or ``checked_on_host`` (no in-graph check; right here,
since the rows are built on the host). ``--against fallback`` times the
guard itself: A is the cp=N program with ``fallback``, B the same program
with ``--max-seqlen-violation``, so the ratio is what dropping the ``cond``
gains.

``bench_cp`` times each configuration in its own stretch of the run, so GPU
clock and power drift between the cp=1 and the cp=N stretches lands in
their ratio (a few percent on the H200 machine, run to run). Here the two
programs of one row are timed in alternation with
:func:`benchmarks.timing.paired` (``A B B A`` steady timings per rep, the
speed-up formed per rep from adjacent timings): drift cancels, and the
spread of the per-rep ratios says how far to trust the median. Prints one
line per (row, pass) and writes a JSON.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import names, results, timing
from benchmarks.workload import (
  Row,
  arg_sets,
  balanced_row,
  cp_forward,
  make_mesh,
  make_row,
  with_pass,
)
from jax_cp.checks import DCS_WINDOW_PLANS


def program(cp: int, row: Row, strategy: str, backend: str, pass_name: str,
            window: int | None = None, violation: str = "fallback",
            dcs_window_plan: str = "split"):
  """The jitted step ``(q, k, v, dout, cu, cuP)`` of a row at ``cp``, with
  the sliding window ``(window, 0)`` unless ``window`` is None, the
  ``max_seqlen_violation`` mode ``violation`` and DUAL_CHUNK_SWAP's
  windowed plan ``dcs_window_plan``."""
  forward = cp_forward(make_mesh(cp), strategy, backend, row.max_seqlen,
                       window_size=None if window is None else (window, 0),
                       violation=violation, dcs_window_plan=dcs_window_plan)
  return jax.jit(with_pass(forward, pass_name))


def pair_record(r: timing.PairedResult) -> dict[str, Any]:
  """The JSON fields of a cp=1 (A) / cp=N (B) pair."""
  return {"ms_base": r.ms_a, "ms_other": r.ms_b,
          "speedup_median": r.ratio_median, "speedup_q1": r.ratio_q1,
          "speedup_q3": r.ratio_q3, "speedup_min": r.ratio_min,
          "speedup_max": r.ratio_max, "ratios": r.ratios,
          "depth_base": r.depth_a, "depth_other": r.depth_b}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cp", type=int, default=2)
  p.add_argument("--strategy", default="no_load_balance",
                 choices=names.STRATEGIES)
  p.add_argument("--dists", nargs="+", default=["short_128_1k",
                                                 "uniform_1k_8k", "one_doc"],
                 choices=names.DISTS)
  p.add_argument("--passes", nargs="+", default=list(names.PASSES),
                 choices=names.PASSES)
  p.add_argument("--tokens", type=int, default=names.TOKENS)
  p.add_argument("--hq", type=int, default=names.HQ)
  p.add_argument("--hkv", type=int, default=names.HKV)
  p.add_argument("--head-dim", type=int, default=names.HEAD_DIM)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--reps", type=int, default=15)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--window", type=int, default=None,
                 help="sliding window (LEFT, 0) in both programs")
  p.add_argument("--dcs-window-plan", choices=DCS_WINDOW_PLANS,
                 default="split",
                 help="DUAL_CHUNK_SWAP's windowed calls in both programs "
                      "(cp_attention's dcs_window_plan)")
  p.add_argument("--doc-order", nargs="+", choices=names.DOC_ORDERS,
                 default=["packed"],
                 help="each row as packed and/or with its documents "
                      "reordered to balance the cp ranks")
  p.add_argument("--max-seqlen-violation", dest="violation",
                 choices=names.VIOLATIONS, default=names.VIOLATIONS[0],
                 help="the layout's guard of the max_seqlen bound")
  p.add_argument("--against", choices=("cp1", "fallback"), default="cp1",
                 help="A: cp=1 (default), or the cp=N program with the "
                      "fallback guard")
  p.add_argument("--out", default=results.RESULTS_DIR)
  args = p.parse_args(argv)
  if args.against == "fallback" and args.violation == "fallback":
    p.error("--against fallback needs --max-seqlen-violation "
            "checked_on_host")
  if args.cp < 2 or args.cp > jax.device_count():
    p.error(f"--cp must be in [2, {jax.device_count()}] (devices present)")
  if args.tokens % (2 * args.cp):
    p.error(f"--tokens must be a multiple of 2*cp={2 * args.cp}")
  if args.reps < 1:
    p.error("--reps must be >= 1")
  if args.window is not None and args.window < 0:
    p.error("--window must be >= 0")
  return args


def main(argv: Sequence[str] | None = None) -> str:
  """Runs the pairs; returns the path of the JSON written."""
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  records = []
  a_name = "cp=1" if args.against == "cp1" else "fallback"
  b_name = f"cp={args.cp}" if args.against == "cp1" else "on host"
  print(f"{'dist':<14}{'order':<10}{'pass':<8}{a_name + ' ms':>12}"
        f"{b_name + ' ms':>12}{'A/B':>10}{'IQR':>14}{'min-max':>14}")
  for dist, order in itertools.product(args.dists, args.doc_order):
    row = make_row(dist, args.tokens, args.strategy, args.cp, "auto",
                   args.seed)
    if order == "balanced":
      row = balanced_row(row, args.strategy, args.cp, args.window)
    base_cp = 1 if args.against == "cp1" else args.cp
    base_args, other_args = (
        arg_sets(cp, row, args.hq, args.hkv, args.head_dim, dtype, args.seed)
        for cp in (base_cp, args.cp))
    for pass_name in args.passes:
      base = program(base_cp, row, args.strategy, args.backend, pass_name,
                     args.window, "fallback" if args.against == "fallback"
                     else args.violation, args.dcs_window_plan)
      other = program(args.cp, row, args.strategy, args.backend, pass_name,
                      args.window, args.violation, args.dcs_window_plan)
      r = pair_record(timing.paired(base, base_args, other, other_args,
                                    reps=args.reps))
      r.update(dist=dist, doc_order=order, row_id=row.row_id,
               pass_name=pass_name, cp=args.cp,
               strategy=args.strategy, tokens=args.tokens, hq=args.hq,
               hkv=args.hkv, head_dim=args.head_dim, dtype=args.dtype,
               backend=args.backend, max_seqlen=row.max_seqlen,
               reps=args.reps, window=args.window,
               dcs_window_plan=args.dcs_window_plan,
               max_seqlen_violation=args.violation, against=args.against)
      records.append(r)
      print(f"{dist:<14}{order:<10}{pass_name:<8}{r['ms_base']:12.3f}"
            f"{r['ms_other']:12.3f}"
            f"{r['speedup_median']:9.3f}x"
            f"  {r['speedup_q1']:.3f}-{r['speedup_q3']:.3f}"
            f"  {r['speedup_min']:.3f}-{r['speedup_max']:.3f}", flush=True)
  env = results.environment(args=vars(args))
  path = results.write_result(
      results.result_path(args.out, "speedup_ab", env),
      {"env": env, "records": records})
  print(path)
  return path


if __name__ == "__main__":
  main()
