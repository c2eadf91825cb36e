"""The training step at cp = N, modeled from one GPU's kernel times.

    python -m benchmarks.scaling --profile step_<date>_<device>.json \\
        --plans memory_<date>_<device>_plan_<tag>.json ...

For each step of a plan (``bench_memory --compile-only --schedule``: the
example's step compiled for N H200s, its row of T tokens), the busiest
rank's step time is modeled as

    t(N) = A1 * pairs(N) / pairs(1) + K1 * (T / N) / T1 + I1 + exposed(N)
           + F   (N > 1)

* ``A1``, ``K1``, ``I1``: the cp=1 step of the same model on one GPU, from
  a ``bench_step --profile`` file: milliseconds per step of its attention
  kernels, of its other compute kernels (matmul, elementwise, copy), and
  of the gaps between kernels; ``T1`` its row length;
* ``pairs``: the causal (query, key) pairs of the busiest rank
  (:func:`jax_cp.planning.estimate_cp_imbalance`, the strategy's exact
  split) on the example's row of T tokens packed for N ranks
  (``examples.packed_lm.data.load_rows``), over those of the profiled row;
  after an all-to-all over ``ci`` ranks each rank attends ``1/ci`` of the
  heads: of whole rows (``all_to_all``, ``ci = N``: the row's pairs over
  N), or of the busiest outer rank's share at ``N/ci`` ranks
  (``all_to_all+ring``);
* ``exposed(N)``: the plan's collectives (:mod:`benchmarks.schedule`) at
  ``--bandwidth`` bytes per second per GPU and direction: an all-gather
  moves (N-1)/N of its result, a reduce-scatter N-1 times its result, a
  collective-permute its result, an all-reduce 2 (N-1)/N of it, an
  all-to-all (ci-1)/ci of it. Those XLA scheduled beside no matmul and no
  attention count whole; the others only by as much as their total
  outlasts the step's compute;
* ``F``: a fixed cost of every step at cp > 1 that none of the above
  holds (0 unless ``--calibrate-on N``: the measured step at that cp,
  from ``--measured``, less the rest of the model there, in a plan of
  ``--plans`` or ``--calibrate-with``; the other measured cps then check
  it).

What it leaves out: every attention call is taken to run at the profiled
calls' FLOP rate (a DUAL_CHUNK_SWAP chunk of a short document runs slower,
``results/fused.md``), launch gaps are taken as they are at cp=1, and a
loop body's collectives count once (plans of unrolled layers only).

It prints, per plan step, the parts, ``t(N)``, the per-GPU efficiency
``t1(T) / (N * t(N))``, where ``t1(T)`` is the same model's one-GPU step
on the same row (weak scaling when ``T = N * T1``), and, for the profiled
row length, the speed-up ``t(1) / t(N)`` beside ``--measured`` ones; writes
``scaling_<date>.json`` and rebuilds ``scaling.md`` beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence

import jax_cp
from benchmarks import results
from examples.packed_lm import config, data

#: NVLink 4 on an H200 SXM: 900 GB/s per GPU in both directions together
#: (NVIDIA's H200 data sheet), 450 GB/s each way.
NVLINK_BYTES_PER_S = 450e9
#: Bytes a collective moves per GPU, as a multiple of its result's bytes.
MOVED = {"all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: n - 1,
         "collective-permute": lambda n: 1,
         "all-reduce": lambda n: 2 * (n - 1) / n,
         "all-to-all": lambda n: (n - 1) / n}


@functools.cache
def pairs(strategy: str, seq_len: int, cp: int, max_doc_len: int,
          seed: int, ranks: int | None = None) -> tuple[int, int]:
  """``(busiest rank's, all ranks')`` causal pairs on the example's row
  of ``seq_len`` tokens packed for ``cp`` ranks, split over ``ranks``
  (default ``cp``)."""
  cfg = config.Config(strategy=strategy, seq_len=seq_len, seed=seed,
                      max_doc_len=max_doc_len, doc_order="packed")
  rows = data.load_rows(cfg, 1, cp)
  est = jax_cp.planning.estimate_cp_imbalance(
      rows.cu_seqlens[0], rows.cu_seqlens_padded[0],
      jax_cp.CPLayout(cp_size=ranks or cp, strategy=strategy))
  return int(max(est.pairs_per_rank)), int(sum(est.pairs_per_rank))


def busiest_pairs(r: dict, strategy: str, max_doc_len: int, seed: int
                  ) -> tuple[float, int]:
  """``(busiest rank's, all ranks')`` causal pairs of a planned step
  ``r``, a rank's share of the heads counted (``pairs``, module doc)."""
  cp, seq = int(r["cp"]), int(r["seq_len"])
  comm = r.get("comm_type", "all_gather")
  ci = (cp if comm == "all_to_all" else int(r.get("cp_inner") or 1)
        if comm == "all_to_all+ring" else 1)
  busiest, total = pairs(strategy, seq, cp, max_doc_len, seed,
                         ranks=cp // ci)
  return busiest / ci, total


def exposed_ms(schedule: dict, cp: int, bandwidth: float,
               compute_ms: float, inner: int | None = None
               ) -> tuple[float, float]:
  """``(all collectives' ms, exposed ms)`` of a plan's schedule; an
  all-to-all over ``inner`` ranks (default ``cp``)."""
  whole = hidden = 0.0
  for kind, k in schedule["kinds"].items():
    n = (inner or cp) if kind == "all-to-all" else cp
    per_byte = MOVED[kind](n) / bandwidth * 1e3
    whole += per_byte * k["unhidden_bytes"]
    hidden += per_byte * (k["bytes"] - k["unhidden_bytes"])
  return whole + hidden, whole + max(0.0, hidden - compute_ms)


def cp1_profile(path: str, strategy: str) -> tuple[dict, dict]:
  """``(record, profile)`` of a ``bench_step --profile`` file's cp=1 step
  of ``strategy``."""
  with open(path) as f:
    run = json.load(f)
  label = next((k for k in run["profiles"] if k.startswith(strategy)
                and k.endswith(" cp=1")), None)
  if label is None:
    raise SystemExit(f"{path} has no cp=1 profile of {strategy} "
                     f"(profiles: {sorted(run['profiles'])})")
  return run["records"][0], run["profiles"][label]


def model(args, fixed_ms: float = 0.0, say=print, plans=None) -> list[dict]:
  """One record per planned step with a schedule in ``plans`` (default
  ``args.plans``): the parts of its modeled time, the per-GPU efficiency
  and the speed-up (``say`` prints a line each)."""
  out = []
  for path in args.plans if plans is None else plans:
    with open(path) as f:
      plan = json.load(f)
    p = plan["args"]
    rec, prof = cp1_profile(args.profile, p["strategy"])
    g = prof["groups_ms"]
    attn1 = g.get("attention", 0.0)
    other1 = sum(g.get(k, 0.0) for k in ("matmul", "elementwise", "copy"))
    idle1, t1 = prof["idle_ms"], rec["seq_len"]
    pairs1 = pairs(p["strategy"], t1, 1, rec["max_doc_len"], p["seed"])[1]
    step1 = attn1 + other1 + idle1
    for r in plan["records"]:
      if r.get("kind") != "run" or not r.get("schedule"):
        continue
      cp, seq = int(r["cp"]), int(r["seq_len"])
      busiest, total = busiest_pairs(r, p["strategy"], p["max_doc_len"],
                                     p["seed"])
      attn, other = attn1 * busiest / pairs1, other1 * seq / cp / t1
      one_gpu = attn1 * total / pairs1 + other1 * seq / t1 + idle1
      comm, exposed = exposed_ms(r["schedule"], cp, args.bandwidth,
                                 attn + other, r.get("cp_inner"))
      step = attn + other + idle1 + exposed + (fixed_ms if cp > 1 else 0)
      rec_out = dict(
          model=r["model"], strategy=p["strategy"],
          comm_type=r.get("comm_type", "all_gather"),
          **({"cp_inner": r["cp_inner"]} if r.get("cp_inner") else {}),
          cp=cp, seq_len=seq,
          profiled_seq_len=t1, bandwidth=args.bandwidth, attention_ms=attn,
          other_ms=other, idle_ms=idle1, collectives_ms=comm,
          exposed_ms=exposed, fixed_ms=fixed_ms if cp > 1 else 0.0,
          step_ms=step, cp1_step_ms=step1,
          one_gpu_ms=one_gpu, efficiency=one_gpu / (cp * step),
          speedup=step1 / step if seq == t1 else None,
          measured=args.measured.get(cp) if seq == t1 else None, plan=path)
      out.append(rec_out)
      say(f"{rec_out['strategy']} / {rec_out['comm_type']} cp={cp} "
          f"T={seq}: attention {attn:.2f} + other {other:.2f} + gaps "
          f"{idle1:.2f} + exposed {exposed:.2f} (of {comm:.2f}) + fixed "
          f"{rec_out['fixed_ms']:.2f} = {step:.2f} ms; per-GPU efficiency "
          f"{rec_out['efficiency']:.3f}"
          + (f"; speed-up {rec_out['speedup']:.3f}" if seq == t1 else "")
          + (f" (measured {rec_out['measured']})"
             if rec_out["measured"] else ""))
  if not out:
    raise SystemExit("no planned step with a schedule in --plans (plan "
                     "with bench_memory --compile-only --schedule)")
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.scaling",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--profile", required=True,
                 help="a bench_step --profile file with a cp=1 profile")
  p.add_argument("--plans", nargs="+", required=True,
                 help="bench_memory --compile-only --schedule files")
  p.add_argument("--bandwidth", type=float, default=NVLINK_BYTES_PER_S,
                 help="bytes/s per GPU and direction")
  p.add_argument("--measured", nargs="*", default=[], metavar="CP=SPEEDUP",
                 help="measured step speed-ups at the profiled T")
  p.add_argument("--calibrate-with", nargs="*", default=[],
                 help="plans that --calibrate-on may fit F on, their "
                 "steps not written")
  p.add_argument("--calibrate-on", type=int, default=None, metavar="CP",
                 help="fit the fixed cost F of cp > 1 to the measured "
                 "speed-up at this cp")
  p.add_argument("--out", default=results.RESULTS_DIR)
  p.add_argument("--tag", default=None, help="suffix of the result file")
  return p


def main(argv: Sequence[str] | None = None) -> str:
  """Models every plan's steps; returns the path of the JSON written."""
  args = build_parser().parse_args(argv)
  try:
    args.measured = {int(c): float(s) for c, s in
                     (m.split("=") for m in args.measured)}
  except ValueError as e:
    raise SystemExit(f"--measured takes CP=SPEEDUP pairs: {e}") from e
  fixed = 0.0
  if args.calibrate_on is not None:
    if args.calibrate_on not in args.measured:
      raise SystemExit(f"--calibrate-on {args.calibrate_on} needs a "
                       f"--measured speed-up at that cp")
    at = [r for r in model(args, say=lambda _: None,
                           plans=args.calibrate_with + args.plans)
          if r["cp"] == args.calibrate_on
          and r["speedup"] is not None]
    if not at:
      raise SystemExit(f"no plan has cp={args.calibrate_on} at the "
                       "profiled row length")
    fixed = (at[0]["cp1_step_ms"] / args.measured[args.calibrate_on]
             - at[0]["step_ms"])
    print(f"fixed cost of a cp > 1 step, fitted at cp="
          f"{args.calibrate_on}: {fixed:.2f} ms", flush=True)
  run = results.Run("scaling", argv, args, args.tag, module="scaling")
  run.add(*model(args, fixed))
  return run.finish()


if __name__ == "__main__":
  main()
