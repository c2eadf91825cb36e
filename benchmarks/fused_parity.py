"""Our cuDNN varlen call against JAX's own cuDNN attention, paired A/B in
one run, with a per-kernel profile of both on one document.

    python -m benchmarks.bench_fused --parity [--head-dim 128 64] \\
        [--tokens 65536 32768] [--profile]

For every (head_dim, T) pair, document mix and pass (``fwd``, ``fwd+bwd``),
``ours`` (:func:`jax_cp.fused_attention`, cudnn, top-left causal) is timed in
alternation against ``jax.nn.dot_product_attention(implementation="cudnn",
is_causal=True)`` (one document only: the dense reference) and against JAX's
packed cuDNN path (segment offsets, ``PADDING_CAUSAL``), with
:func:`benchmarks.timing.paired`; a ratio > 1 means ours is faster.
``--profile`` adds, on the one-document row, the device time per kernel name
of one call of each (``jax.profiler`` trace), so a gap can be read off the
kernels that differ.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import profiling, timing

PROFILE_ITERS = 5


def kernels_of(fn: Callable, args: tuple, iters: int = PROFILE_ITERS
               ) -> list[tuple[str, int, float]]:
  """``(kernel, launches per call, ms per call)`` of ``fn(*args)`` on the
  first GPU, by device time, from a profiler trace of ``iters`` calls."""
  def run(n: int) -> None:
    out = None
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
  data = profiling.load_trace(profiling.trace_steps(run, iters))
  plane = None if data is None else profiling.device_plane(data)
  if plane is None:
    raise RuntimeError("no GPU plane in the profiler trace")
  ms, n = profiling.kernel_totals(profiling.kernel_events(plane))
  rows = [(k, n[k] // iters, ms[k] / iters) for k in ms]
  return sorted(rows, key=lambda r: -r[2])


def paired_ratio(fn_ref: Callable, fn_ours: Callable, sets: list,
                 reps: int) -> dict[str, float]:
  """Ours against a reference, in alternation (ratio > 1: ours faster)."""
  r = timing.paired(fn_ref, sets, fn_ours, sets, reps=reps)
  return {"ms_ref": r.ms_a, "ms_ours": r.ms_b, "ratio": r.ratio_median,
          "q1": r.ratio_q1, "q3": r.ratio_q3}


def run(args, variants: Callable, fwd_and_bwd: Callable, pack_row: Callable
        ) -> list[dict[str, Any]]:
  """The paired records (and kernel tables) of ``--parity``."""
  tokens = args.tokens if isinstance(args.tokens, list) else [args.tokens]
  dims = args.head_dim if isinstance(args.head_dim, list) else [args.head_dim]
  if len(tokens) == 1:
    tokens = tokens * len(dims)
  if len(tokens) != len(dims):
    raise SystemExit("--tokens takes one value or one per --head-dim")
  rng = np.random.default_rng(0)
  records = []
  for d, t in zip(dims, tokens):
    for hkv in args.hkv:
      sets = [_inputs(rng, t, args.hq, hkv, d) for _ in range(2)]
      for dist in args.dists:
        cu, cuP = pack_row(dist, t, 1, seed=0)
        lens = np.diff(cu).astype(np.int32)
        offs = cuP[:-1].astype(np.int32)
        fns = variants(dist, t, d, args.backend, lens, offs, args.window)
        for pass_name in ("fwd", "fwd+bwd"):
          pick = 0 if pass_name == "fwd" else 1
          arg_sets = [s[:3] for s in sets] if pick == 0 else sets
          ours = fwd_and_bwd(fns["ours"])[pick]
          for ref in args.refs:
            if ref not in fns:
              continue
            rec = {"head_dim": d, "tokens": t, "hq": args.hq, "hkv": hkv,
                   "dist": dist, "docs": len(lens), "pass_": pass_name,
                   "reference": ref, "window": args.window}
            try:
              rec.update(paired_ratio(fwd_and_bwd(fns[ref])[pick], ours,
                                      arg_sets, args.reps))
            except Exception as e:  # noqa: BLE001  (recorded; run goes on)
              rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            records.append(rec)
            print(rec, flush=True)
          if args.profile and dist == "one_doc":
            for name in ("ours", "jax_dense"):
              fn = fwd_and_bwd(fns[name])[pick]
              table = kernels_of(fn, arg_sets[0])
              records.append({"head_dim": d, "tokens": t, "hkv": hkv,
                              "dist": dist, "pass_": pass_name,
                              "profile": name, "kernels": table})
              print(f"\n## kernels: {name}, {pass_name}, D={d}, T={t}, "
                    f"Hkv={hkv} (per call)")
              print("| ms | launches | kernel |\n|---|---|---|")
              for k, n, ms in table:
                print(f"| {ms:.3f} | {n} | {k[:110]} |")
              print(f"| {sum(r[2] for r in table):.3f} | | total |")
  print("\n| D | T | Hkv | mix | pass | ours / jax.nn | ours / JAX packed |"
        "\n|---|---|---|---|---|---|---|")
  keyed = collections.defaultdict(dict)
  for r in records:
    if "reference" in r:
      keyed[(r["head_dim"], r["tokens"], r["hkv"], r["dist"],
             r["pass_"])][r["reference"]] = r
  for (d, t, hkv, dist, p), refs in keyed.items():
    print(f"| {d} | {t} | {hkv} | {dist} | {p} | "
          f"{_cell(refs.get('jax_dense'))} | {_cell(refs.get('jax_packed'))} |")
  return records


def _inputs(rng, t: int, hq: int, hkv: int, d: int) -> tuple:
  mk = lambda h, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal((t, h, d)),
                                              dt)
  return mk(hq), mk(hkv), mk(hkv), mk(hq, jnp.float32)


def _cell(rec: dict | None) -> str:
  if rec is None:
    return ""
  if "error" in rec:
    return rec["error"][:40]
  return (f"{rec['ratio']:.3f}x ({rec['q1']:.3f}-{rec['q3']:.3f}; "
          f"{rec['ms_ours']:.2f} vs {rec['ms_ref']:.2f} ms)")
