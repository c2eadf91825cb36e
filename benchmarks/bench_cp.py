"""Speed of ``jax_cp.cp_attention`` on packed THD rows, in one command.

Quick preset (the speed targets: T=64k, Hkv=8, four document mixes, cp
1/2/4, both strategies, forward and forward+backward), from the repository
root::

    python -m benchmarks.bench_cp --quick --out benchmarks/results

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
  L(L+1)/2`` per document of ``L`` valid tokens (``2*T^2*H*D`` per
  document is the ``L^2/2`` approximation of the same), 3.5x that for
  forward+backward (with ``--window LEFT``, every program runs the
  sliding window ``(LEFT, 0)`` and only ``min(j+1, LEFT+1)`` keys per
  query count);
* the exchange cost two ways: *exposed* = step time minus the time of the
  same step with the exchange's collectives replaced by local copies
  (``cp_comm_type="local_copies"``), and
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
import gc
import itertools
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_cp
from benchmarks import derived, profiling, results, tables, timing
from benchmarks.names import DISTS, PASSES, STRATEGIES, VIOLATIONS
from benchmarks.workload import (
  Row,
  abstract_args,
  cp_forward,
  dense_forward,
  flops,
  make_inputs,
  make_mesh,
  make_row,
  primitive_forward,
  row_metadata,
  with_pass,
)
from jax_cp.attention.registry import resolve_backend
from jax_cp.kv_exchange import choose_exchange

FULL = {"cp": [1, 2, 4], "strategies": list(STRATEGIES), "hkv": [8, 32],
        "tokens": [16384, 32768, 65536, 131072], "dists": list(DISTS),
        "passes": list(PASSES)}
QUICK = {"cp": [1, 2, 4], "strategies": list(STRATEGIES), "hkv": [8],
         "tokens": [65536], "dists": list(DISTS), "passes": list(PASSES)}


# ----------------------------------------------------------------- programs


def core_exchange(strategy: str, cp: int, tokens: int, max_seqlen,
                  window: int | None = None):
  """The core's static exchange choice for a row (with a sliding window
  ``(window, 0)`` unless None)."""
  return choose_exchange(strategy == "no_load_balance", "cp", cp, tokens,
                         tokens if max_seqlen is None else max_seqlen,
                         window_left=-1 if window is None else window)


def exchange_name(strategy: str, cp: int, tokens: int, max_seqlen,
                  window: int | None = None) -> str:
  ex = core_exchange(strategy, cp, tokens, max_seqlen, window)
  if ex.kind == "halo":
    return f"halo ({ex.halo_tokens} tokens)"
  return ex.kind


def exchange_program(mesh, strategy: str, tokens: int, pass_name: str,
                     max_seqlen, window: int | None = None):
  """The K/V exchange of a step alone, in a ``shard_map`` like the core's.

  Uses the core's own exchange (``jax_cp.kv_exchange``: all-gather +
  DUAL_CHUNK_SWAP restore, or NO_LOAD_BALANCE's bounded halo). fwd+bwd adds
  the gradient path (un-restore + reduce-scatter, or the reverse halo
  permutes) on a buffer-sized dK|dV (the halo's, for the halo exchange).
  XLA merges the backward's identical re-gather with the forward's, so it
  is not repeated here.
  """
  cp = mesh.shape["cp"]
  ex = core_exchange(strategy, cp, tokens, max_seqlen, window)

  def local_core(k, v, cuP):
    if ex.kind == "halo":
      halo = ex.receive_halo(k[None], v[None])
      kb, vb = jnp.split(halo, 2, axis=2)
    else:
      kb, vb = ex.gather(k[None], v[None], cuP[None])
    out = jnp.concatenate([kb, vb], axis=2)
    if pass_name == "fwd":
      return out, jnp.zeros((1,), k.dtype)
    dk, dv = jax.lax.optimization_barrier((kb, vb))
    dk, dv = ex.scatter(dk, dv, cuP[None])
    return out, jnp.concatenate([dk, dv], axis=2)[0]

  mapped = jax.shard_map(local_core, mesh=mesh,
                         in_specs=(P("cp"), P("cp"), P()),
                         out_specs=(P("cp"), P("cp")), check_vma=False)
  return lambda q, k, v, dout, cu, cuP: mapped(k, v, cuP)


@dataclasses.dataclass
class Program:
  """One jitted program: lowered on the main thread, compiled in a pool."""

  key: tuple
  build: Callable[[], Callable]
  cp: int
  num_docs: int
  no_collectives: bool = False
  lowered: Any = None
  future: Any = None
  error: str | None = None
  note: str | None = None
  lower_s: float = 0.0


@dataclasses.dataclass
class Measurement:
  record: dict[str, Any]
  program: Program
  row: Row


# ----------------------------------------------------------------- plan


def build_plan(args) -> tuple[dict[tuple, Program], list[Measurement]]:
  """All programs (deduplicated by key) and measurements, in run order."""
  programs: dict[tuple, Program] = {}
  plan: list[Measurement] = []
  seen = set()
  max_cp = max(args.cp)
  dtype = jnp.dtype(args.dtype)
  hq, d = args.hq, args.head_dim
  window = args.window
  ws = None if window is None else (window, 0)

  def add(kind, row, cp, strategy, pass_name, hkv, key, build,
          no_collectives=False):
    """Plans one measurement (once per row) and its program (once per
    key: rows with the same static shape share a program)."""
    ident = (kind, row.row_id, cp, strategy, pass_name, hkv, window)
    if ident in seen:
      return
    seen.add(ident)
    if key not in programs:
      programs[key] = Program(key, build, cp, row.num_docs, no_collectives)
    record = {
        "kind": kind, "dist": row.dist, "tokens": row.tokens, "hq": hq,
        "hkv": hkv, "head_dim": d, "dtype": dtype.name, "strategy": strategy,
        "cp": cp, "pass_name": pass_name, "layout": row.layout,
        "row_id": row.row_id, "max_seqlen": row.max_seqlen,
        "bound": args.max_seqlen_bound, "num_docs": row.num_docs,
        "valid_tokens": row.valid_tokens,
        "longest_padded_doc": row.longest_padded_doc,
        "flops": flops(row, hq, d, pass_name, window),
        "backend": args.backend, "window": window,
        "exchange": (exchange_name(strategy, cp, row.tokens, row.max_seqlen,
                                   window) if cp > 1 else None)}
    plan.append(Measurement(record, programs[key], row))

  # Run order = priority under --budget-s: the speed targets first
  # (fwd+bwd; one document, short documents), stdlib_mix last.
  passes = sorted(args.passes, key=PASSES[::-1].index)
  dists = sorted(args.dists, key=DISTS.index)
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
              ("dense",) + shape + (p, window),
              lambda p=p: with_pass(dense_forward(impl, ws), p))
        for st, row in rows.items():
          w, n = row.max_seqlen, row.num_docs
          if args.references:
            add("fused_primitive", row, 1, None, p, hkv,
                ("primitive",) + shape + (p, n, w, window),
                lambda p=p, w=w: with_pass(primitive_forward(
                    args.backend, w, ws), p))
          for cp in args.cp:
            s = st if cp > 1 else None     # cp=1 ignores the strategy
            add("cp_attention", row, cp, s, p, hkv,
                ("cp_attention",) + shape + (p, cp, s, n, w, window),
                lambda p=p, cp=cp, st=st, w=w: with_pass(
                    cp_forward(make_mesh(cp), st, args.backend, w,
                               window_size=ws, violation=args.violation), p))
            if cp == 1:
              continue
            if exposed:
              add("cp_attention_nocomm", row, cp, s, p, hkv,
                  ("cp_attention_nocomm",) + shape + (p, cp, s, n, w, window),
                  lambda p=p, cp=cp, st=st, w=w: with_pass(
                      cp_forward(make_mesh(cp), st, args.backend, w,
                                 communicate=False, window_size=ws,
                                 violation=args.violation), p),
                  no_collectives=True)
            if standalone:
              add("exchange_standalone", row, cp, s, p, hkv,
                  ("exchange",) + shape + (p, cp, s, n, w, window),
                  lambda p=p, cp=cp, st=st, t=tokens, w=w: exchange_program(
                      make_mesh(cp), st, t, p, w, window))
  return programs, plan


# ----------------------------------------------------------------- running


@dataclasses.dataclass
class CompileCount:
  """XLA backend compiles seen while :func:`counting_compiles` is active."""

  count: int = 0
  seconds: float = 0.0


@contextlib.contextmanager
def counting_compiles() -> Iterator[CompileCount]:
  """Counts XLA backend compiles (and their seconds) inside the block."""
  counter = CompileCount()

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      counter.count += 1
      counter.seconds += duration
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counter
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _short_error(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}"
  return msg if len(msg) < 600 else msg[:600] + " ..."


def _timed_compile(lowered):
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t0


def lower_and_compile(programs: dict[tuple, Program], plan, args, log):
  """Lowers every program on the main thread, then compiles them.

  Lowering (tracing, MLIR) must not run while another thread compiles: the
  two share MLIR state and must not overlap.
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
      prog.lowered = fn.lower(*aargs)
      if prog.no_collectives:
        # Whatever communication the local copies missed stays in the
        # "exchange removed" step and is then missing from "exposed".
        left = profiling.stablehlo_collectives(prog.lowered.as_text())
        prog.note = ("collectives left in the no-exchange variant: "
                     + ", ".join(left)) if left else None
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
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
      except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        prog.future.set_exception(e)
  else:
    with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
      for prog in todo:
        prog.future = pool.submit(_timed_compile, prog.lowered)
      concurrent.futures.wait([p.future for p in todo])
  for prog in todo:
    prog.lowered = None          # free the MLIR modules


def cudnn_graph_builds() -> int | None:
  """cuDNN graphs built so far by jax_cp's extension (None without it)."""
  try:
    from jax_cp.attention import cudnn  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return int(cudnn.graph_cache_stats()["builds"])


# ----------------------------------------------------------------- results


def _predict(m: Measurement, dtype_bytes: int) -> dict[str, Any]:
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
  return {
      "predicted_imbalance": est.imbalance,
      "predicted_ms": 1e3 * est.predicted_time_s(
          include_backward=r["pass_name"] == "fwd_bwd"),
      "allgather_bytes_per_rank": est.allgather_bytes,
      "halo_bytes_per_rank": est.halo_bytes}


# ----------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None):
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
  p.add_argument("--window", type=int, default=None,
                 help="causal sliding window (LEFT, 0) in every program")
  p.add_argument("--max-seqlen-violation", dest="violation",
                 choices=VIOLATIONS, default=VIOLATIONS[0],
                 help="the layout's guard of the max_seqlen bound in the CP "
                      "programs\n(fallback: the library's default lax.cond; "
                      "checked_on_host: none)")
  p.add_argument("--out", default=results.RESULTS_DIR)
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
  if args.window is not None and args.window < 0:
    p.error("--window must be >= 0")
  for t in args.tokens:
    if t % (2 * max(args.cp)):
      p.error(f"--tokens {t} must be a multiple of 2*max(cp)="
              f"{2 * max(args.cp)}")
  if max(args.cp) > jax.device_count():
    p.error(f"--cp {max(args.cp)} needs that many devices; "
            f"{jax.device_count()} present")
  return args


def main(argv: Sequence[str] | None = None) -> str:
  """Runs the benchmark; returns the path of the JSON written ("" for
  ``--dry-run``)."""
  args = parse_args(argv)
  with counting_compiles() as compiles:
    return run(args, compiles)


def run(args: argparse.Namespace, compiles: CompileCount) -> str:
  """Plans, compiles and measures; returns the path of the JSON written."""
  start = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - start:7.1f}s] {msg}",
                          flush=True)
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
    resolve_backend(args.backend)
  except ValueError as e:
    raise SystemExit(f"backend {args.backend!r} unusable here: {e}") from e

  env = results.environment()
  path = results.result_path(args.out, "results", env)
  payload = {"env": env, "args": vars(args), "records": [], "summary": {}}

  lower_and_compile(programs, plan, args, log)
  compile_wall = time.perf_counter() - start
  log("compiled; measuring")
  dtype_bytes = jnp.dtype(args.dtype).itemsize
  inputs: dict[tuple, Any] = {}
  meta: dict[tuple, Any] = {}
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
          meta[mkey] = row_metadata(prog.cp, m.row)
        arg_sets = [tuple(s) + meta[mkey] for s in inputs[ikey]]
        builds0 = cudnn_graph_builds()
        t = timing.measure(compiled, arg_sets, args.warmup, args.reps)
        times = {"pipelined": t.pipelined, "synced": t.synced,
                 "steady": t.steady}[args.timing]
        builds1 = cudnn_graph_builds()
        if builds0 is not None and builds1 is not None:
          r["cudnn_graph_builds"] = builds1 - builds0
        ms = [1e3 * x for x in times]
        r.update(ms_median=statistics.median(ms), ms_min=min(ms),
                 ms_mean=statistics.fmean(ms), ms_all=ms, reps=len(ms),
                 first_call_s=t.first_s, error=None, timing=args.timing,
                 ms_synced_median=1e3 * statistics.median(t.synced),
                 ms_pipelined_median=1e3 * statistics.median(t.pipelined),
                 ms_steady_median=1e3 * statistics.median(t.steady),
                 pipeline_depth=t.depth)
      except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
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
    derived.derive(payload["records"])
    payload["summary"] = {
        "wall_s": time.perf_counter() - start,
        "compile_phase_s": compile_wall,
        "programs": len(programs), "measurements": len(plan),
        "xla_compiles": compiles.count,
        "xla_compile_s": compiles.seconds,
        "first_calls_s": sum(x.get("first_call_s") or 0.0
                             for x in payload["records"]),
        "cudnn_graph_builds": sum(x.get("cudnn_graph_builds") or 0
                                  for x in payload["records"])}
    results.write_result(path, payload)
  inputs.clear()
  tables.print_table(payload["records"])
  s = payload["summary"]
  log(f"done: {s['measurements']} measurements of {s['programs']} programs, "
      f"{s['xla_compiles']} XLA compiles; wrote {path}")
  return path


if __name__ == "__main__":
  main()
