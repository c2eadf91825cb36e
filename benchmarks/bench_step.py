"""Speed of the example's whole training step: cp=1 against cp=N, paired.

    python -m benchmarks.bench_step --cp 1 2 \\
        --strategies dual_chunk_swap no_load_balance --profile

The model, optimizer, shardings, step and data are those of the example
package ``examples/packed_lm`` (imported, built from its
:class:`~examples.packed_lm.config.Config`): by default a GPU configuration
of 4 layers, d_model 1024, 16 query / 4 KV heads (head_dim 64), bf16, one
row of 32,768 tokens of standard-library files cut at 16k, dp=1. For
NO_LOAD_BALANCE the row's documents are reordered as the example reorders
them (``--doc-order balanced``, its default: every rank's chunk holds
near-equal attention work); ``--doc-order balanced packed`` pairs both.

For every strategy, each cp=N step is timed against the cp=1 step in
alternation (:func:`benchmarks.timing.paired`, ``A B B A`` per rep). Each
timing is the *device-only* steady time per step: the batch is placed once,
``n`` steps are dispatched back to back (the state is donated from step to
step, as in training) and the slope ``(t(2n) - t(n)) / n`` cancels the
pipeline's fill and drain. Also paired:
the CP model at cp=1 against the same model built with ``cp_axis=None``
(plain attention, no mesh) on one device: the cost of the CP machinery when
there is nothing to split.

MFU = model FLOPs per step (:func:`jax_cp.model_flops`, the MFU
convention: ``6 N`` per token for the matmuls plus causal attention per
document, backward 2x forward, no recompute) / step time /
(``--peak-tflops`` x devices).

``--profile`` traces a few steps of every program with ``jax.profiler``
and groups the first GPU's kernels as attention / matmul / collectives
(exposed: not overlapped by any other kernel; overlapped) / elementwise /
copies, and charges the GPU's idle gaps to the kernels around them.
Writes ``benchmarks/results/step_<date>_<device>.json`` and prints a
markdown step table (``--table FILE.json`` prints it again).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from examples.packed_lm.config import Config  # no jax import

_HERE = os.path.dirname(os.path.abspath(__file__))

STRATEGIES = ("dual_chunk_swap", "no_load_balance")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--cp", type=int, nargs="+", default=[1, 2],
                 help="cp sizes; 1 is the base every other is paired with")
  p.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                 default=list(STRATEGIES))
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="bfloat16")
  p.add_argument("--seq-len", type=int, default=32768, help="tokens per row")
  p.add_argument("--batch", type=int, default=1, help="rows per step")
  p.add_argument("--max-doc-len", type=int, default=16384,
                 help="cut files to this many bytes")
  p.add_argument("--max-seqlen", type=int, default=None,
                 help="static document-length bound (default: the data's)")
  p.add_argument("--backend", choices=("auto", "xla", "cudnn"),
                 default="auto")
  p.add_argument("--doc-order", nargs="+", choices=("balanced", "packed"),
                 default=["balanced"],
                 help="no_load_balance: the row's documents reordered to "
                 "balance the cp ranks (the example's default) and/or as "
                 "packed; each order is its own pair")
  p.add_argument("--param-sharding", choices=("fsdp", "replicated"),
                 default="fsdp")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reps", type=int, default=5, help="A B B A repetitions")
  p.add_argument("--block-ms", type=float, default=300.0,
                 help="length of one timed block of back-to-back steps "
                 "(at most 32 steps)")
  p.add_argument("--no-nocp", action="store_true",
                 help="skip the cp=1 vs cp_axis=None pair")
  p.add_argument("--peak-tflops", type=float, default=989.0,
                 help="per-device peak for the MFU (H100/H200 dense bf16)")
  p.add_argument("--profile", action="store_true",
                 help="per-kernel profile of every program")
  p.add_argument("--profile-steps", type=int, default=4)
  p.add_argument("--hlo-collectives", action="store_true",
                 help="count the collectives of every compiled step")
  p.add_argument("--device-plane", default="/device:GPU:0")
  p.add_argument("--out", default=os.path.join(_HERE, "results"))
  p.add_argument("--table", default=None, metavar="JSON",
                 help="print the step table of a JSON written earlier; "
                 "nothing is run")
  return p


def _configure(args) -> None:
  """Before jax is imported."""
  if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_"
                                 f"count={max(args.cp)}").strip()


def paired(prog_a: Program, prog_b: Program, reps: int,
           block_ms: float) -> dict:
  """``A B B A`` steady step times per rep (:func:`benchmarks.timing.paired`
  on one step of each program); per-rep ratio ``t_a / t_b``."""
  from benchmarks import timing  # pylint: disable=import-outside-toplevel
  r = timing.paired(prog_a.step, [()], prog_b.step, [()], reps, warmup=1,
                    pipeline_ms=block_ms)
  return {"ms_a": r.ms_a, "ms_b": r.ms_b, "ratio_median": r.ratio_median,
          "ratio_q1": r.ratio_q1, "ratio_q3": r.ratio_q3,
          "ratio_min": r.ratio_min, "ratio_max": r.ratio_max,
          "ratios": r.ratios, "depth_a": r.depth_a, "depth_b": r.depth_b}


# Kernel groups of the per-kernel profile, tried in this order on the
# lower-cased kernel name.
KERNEL_GROUPS: tuple[tuple[str, str], ...] = (
    ("collective", (r"nccl|all-?reduce|all-?gather|reduce-?scatter|"
                    r"collective|sendrecv")),
    ("attention", (r"sdpa|fmha|flash|attn|attention|cudnn|jax_cp|"
                   r"merge_rows")),
    ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|matmul|\bdot"),
    ("copy", r"memcpy|memset|copy|transpose|dynamic.update.slice"),
)


def kernel_group(name: str) -> str:
  """``attention``, ``matmul``, ``collective``, ``copy`` or
  ``elementwise`` (everything else: XLA's loop and reduction fusions)."""
  low = name.lower()
  for group, pattern in KERNEL_GROUPS:
    if re.search(pattern, low):
      return group
  return "elementwise"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], e))
    else:
      out.append((s, e))
  return out


def _covered(s: int, e: int, union: list[tuple[int, int]]) -> int:
  return sum(max(0, min(e, b) - max(s, a)) for a, b in union)


def idle_gaps(events: Sequence[tuple[int, int, str]], steps: int,
              top: int = 12) -> dict:
  """Where the device sits idle between its first and last kernel.

  ``events`` are ``(start_ns, duration_ns, name)`` of one device's kernels
  over ``steps`` steps dispatched back to back. Idle time is the span not
  covered by any kernel. Each gap is charged to the pair (last kernel to
  end before it, first kernel to start after it), so the same gap in every
  step adds up under one pair.

  Returns:
    ``{"idle_ms": per step, "span_ms": per step, "pairs": [...]}``, the
    ``top`` pairs by idle time, each ``{"before", "after", "ms"`` (per
    step), ``"count"`` (per step), ``"max_us"}``.
  """
  if not events:
    return {"idle_ms": 0.0, "span_ms": 0.0, "pairs": []}
  ends = sorted((s + d, n) for s, d, n in events)
  starts = sorted((s, n) for s, _, n in events)
  union = _union([(s, s + d) for s, d, _ in events])
  pairs = collections.defaultdict(lambda: [0, 0, 0])
  j = k = 0
  for (_, end), (start, _) in zip(union, union[1:]):
    while j + 1 < len(ends) and ends[j + 1][0] <= end:
      j += 1
    while k < len(starts) and starts[k][0] < start:
      k += 1
    key = (ends[j][1], starts[k][1])
    gap = start - end
    pairs[key][0] += gap
    pairs[key][1] += 1
    pairs[key][2] = max(pairs[key][2], gap)
  span = union[-1][1] - union[0][0]
  idle = span - sum(e - s for s, e in union)
  ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
  return {"idle_ms": idle / 1e6 / steps, "span_ms": span / 1e6 / steps,
          "pairs": [{"before": b[:120], "after": a[:120],
                     "ms": v[0] / 1e6 / steps, "count": v[1] / steps,
                     "max_us": v[2] / 1e3} for (b, a), v in ranked]}


def group_kernels(events: Sequence[tuple[int, int, str]], steps: int
                  ) -> dict:
  """Per-step milliseconds by group from kernel events ``(start_ns,
  duration_ns, name)`` of one device: collectives split into
  ``collective_exposed`` (no other kernel runs meanwhile) and
  ``collective_overlapped``; ``busy`` is the union of all kernels."""
  groups = collections.defaultdict(float)
  per_kernel = collections.defaultdict(float)
  launches = collections.Counter()
  exposed = collections.defaultdict(float)
  compute = _union([(s, s + d) for s, d, n in events
                    if kernel_group(n) != "collective"])
  for s, d, name in events:
    g = kernel_group(name)
    per_kernel[name] += d
    launches[name] += 1
    if g == "collective":
      hidden = _covered(s, s + d, compute)
      groups["collective_overlapped"] += hidden
      groups["collective_exposed"] += d - hidden
      exposed[name] += d - hidden
    else:
      groups[g] += d
  busy = sum(e - s for s, e in _union([(s, s + d) for s, d, _ in events]))
  ms = lambda ns: ns / 1e6 / steps
  ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
  return {
      "groups_ms": {g: ms(v) for g, v in sorted(groups.items())},
      "busy_ms": ms(busy),
      "idle": idle_gaps(events, steps),
      # Every kernel, heaviest first: per-step ms and launches per step
      # (collectives: also the ms with no other kernel running).
      "kernels": [dict({"name": n[:160], "group": kernel_group(n),
                        "ms": ms(v), "launches": launches[n] / steps},
                       **({"exposed_ms": ms(exposed[n])}
                          if n in exposed else {}))
                  for n, v in ranked]}


def print_idle(idle: dict, out=None) -> None:
  """Prints :func:`idle_gaps`' result, one pair a line."""
  out = out or sys.stdout
  print(f"  idle {idle['idle_ms']:.3f} of {idle['span_ms']:.3f} ms/step; "
        "gaps by (kernel before -> kernel after): ms/step, gaps/step, "
        "largest us", file=out)
  for g in idle["pairs"]:
    print(f"    {g['ms']:7.3f} {g['count']:5.1f} {g['max_us']:8.1f}  "
          f"{g['before'][:60]} -> {g['after'][:60]}", file=out)


def profile_program(run: Callable[[int], float], steps: int,
                    device_plane: str) -> dict | None:
  """Traces ``steps`` steps; the grouped kernels of ``device_plane`` (the
  same parsing as ``profile_step.py``), or ``None`` without that plane
  (CPU)."""
  import jax  # pylint: disable=import-outside-toplevel
  trace_dir = tempfile.mkdtemp(prefix="jax_cp_step_profile_")
  run(1)
  with jax.profiler.trace(trace_dir):
    run(steps)
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not paths:
    return None
  data = jax.profiler.ProfileData.from_file(paths[0])
  planes = sorted((p for p in data.planes if p.name.startswith(device_plane)),
                  key=lambda p: p.name)
  if not planes:
    return None
  events = [(ev.start_ns, ev.duration_ns, ev.name)
            for line in planes[0].lines if "stream" in line.name.lower()
            for ev in line.events]
  return group_kernels(events, steps)


# One collective instruction of HLO text: its result shape (tuples hold
# ``/*index=N*/`` comments) and kind.
COLLECTIVE_RE = re.compile(
    r"= ((?:[^=\n]|/\*index=\d+\*/)*?) (all-gather|reduce-scatter|"
    r"all-reduce|all-to-all|collective-permute)(?:-start)?\(")


def hlo_collectives(hlo_text: str) -> dict[str, list[str]]:
  """Collective kind -> the result shapes of its instructions (layouts
  and index comments dropped), from compiled HLO text."""
  out = collections.defaultdict(list)
  for m in COLLECTIVE_RE.finditer(hlo_text):
    shape = re.sub(r"\{[^}]*\}|/\*index=\d+\*/", "", m.group(1))
    out[m.group(2)].append(shape[:400])
  return dict(out)


def example_config(args, strategy: str, doc_order: str = "packed",
                   param_sharding: str | None = None) -> Config:
  """The example's config of the benchmark's model, data and step."""
  return Config(device=args.device, layers=args.layers,
                d_model=args.d_model, heads=args.heads,
                kv_heads=args.kv_heads, dtype=args.dtype,
                backend=args.backend, strategy=strategy,
                seq_len=args.seq_len, batch=args.batch,
                max_doc_len=args.max_doc_len, seed=args.seed,
                doc_order=doc_order, steps=1000, warmup=10,
                param_sharding=param_sharding or args.param_sharding)


class Program:
  """One training program with its own state and a batch placed once.

  ``step()`` dispatches one step (the state is donated and replaced) and
  returns its loss without waiting; ``run(n)`` runs ``n`` steps back to
  back, waits for the last and returns the seconds taken."""

  def __init__(self, step_fn, state, batch):
    self._fn, self._state, self._batch = step_fn, state, batch
    self.collectives = None

  def step(self):
    self._state, loss = self._fn(self._state, self._batch)
    return loss

  def run(self, n: int) -> float:
    import jax  # pylint: disable=import-outside-toplevel
    t0 = time.perf_counter()
    losses = [self.step() for _ in range(n)]
    jax.block_until_ready(losses)
    return time.perf_counter() - t0


def build_program(args, strategy: str, cp: int | None, rows, max_seqlen):
  """``(Program, n_params)`` for the example's step on ``cp`` devices (dp=1),
  or with ``cp=None`` the ``cp_axis=None`` model on one device. The batch
  is placed once."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  # pylint: disable-next=import-outside-toplevel
  from examples.packed_lm import data, main, model, train
  cfg = example_config(args, strategy,
                       param_sharding="replicated" if cp is None else None)
  mesh = main.make_mesh(1, cp or 1, args.device)
  layout = model.make_layout(cfg, None if cp is None else mesh, max_seqlen)
  batch = data.place_batch(rows, layout)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = train.init_state(
        cfg, layout, train.make_optimizer(cfg), mesh)
  step = train.make_train_step(graphdef, shardings, mesh, cfg.param_sharding)
  n_params = model.matmul_params(nnx.merge(graphdef, state)[0])
  prog = Program(step, state, batch)
  if args.hlo_collectives:
    prog.collectives = hlo_collectives(
        step.lower(state, batch).compile().as_text())
  return prog, n_params


def run_bench(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  import jax_cp  # pylint: disable=import-outside-toplevel
  from examples.packed_lm import data  # pylint: disable=import-outside-toplevel
  cps = sorted(set(args.cp))
  if cps[0] != 1:
    raise SystemExit("--cp must include 1 (the base of every pair)")
  if max(cps) > jax.device_count():
    raise SystemExit(f"--cp {max(cps)} needs that many devices; jax sees "
                     f"{jax.device_count()}")
  head_dim = args.d_model // args.heads
  records = []
  # DUAL_CHUNK_SWAP's work does not depend on the document order: one run,
  # of the rows as packed.
  runs_of = [(s, o) for s in args.strategies
             for o in (args.doc_order if s == "no_load_balance"
                       else ["packed"])]
  for strategy, order in runs_of:
    rows = data.load_rows(example_config(args, strategy, order), args.batch,
                          max(cps))
    max_seqlen = args.max_seqlen or rows.max_seqlen
    lens = [int(x) for x in (rows.cu_seqlens[0, 1:] - rows.cu_seqlens[0, :-1])
            if x > 0]
    runs: dict[object, Program] = {}
    runs[1], n_params = build_program(args, strategy, 1, rows, max_seqlen)
    flops = jax_cp.model_flops(rows.cu_seqlens, tokens=rows.tokens.size,
                               matmul_params=n_params,
                               num_layers=args.layers, num_heads=args.heads,
                               head_dim=head_dim)
    print(f"{_label(dict(strategy=strategy, doc_order=order))}: "
          f"{args.batch} x {args.seq_len} tokens, documents "
          f"{lens}, max_seqlen {max_seqlen}; {n_params:,} matmul params; "
          f"{flops / 1e12:.2f} model TFLOP/step", flush=True)
    pairs = [(1, c) for c in cps if c > 1]
    if not args.no_nocp and (strategy, order) == runs_of[0]:
      pairs.append((None, 1))
    for a, b in pairs:
      for c in (a, b):
        if c not in runs:
          runs[c] = build_program(args, strategy, c, rows, max_seqlen)[0]
      r = paired(runs[a], runs[b], args.reps, args.block_ms)
      name_a = "nocp" if a is None else f"cp={a}"
      rec = dict(strategy=strategy, doc_order=order, a=name_a,
                 b=f"cp={b}", **r,
                 speedup=r["ratio_median"])
      for tag, c, ms in (("a", a, r["ms_a"]), ("b", b, r["ms_b"])):
        devices = c or 1
        rec[f"tok_s_{tag}"] = rows.tokens.size / (ms / 1e3)
        rec[f"mfu_{tag}"] = flops / (ms / 1e3) / (
            args.peak_tflops * 1e12 * devices)
      records.append(rec)
      print(f"  {name_a:>6} {r['ms_a']:8.2f} ms (MFU {rec['mfu_a']:.1%})  "
            f"cp={b} {r['ms_b']:8.2f} ms (MFU {rec['mfu_b']:.1%})  "
            f"ratio {r['ratio_median']:.3f} [{r['ratio_q1']:.3f}-"
            f"{r['ratio_q3']:.3f}]", flush=True)
    collectives = {("nocp" if c is None else f"cp={c}"): run.collectives
                   for c, run in runs.items()}
    if args.hlo_collectives:
      for key, found in collectives.items():
        print(f"  collectives {key}: "
              + (", ".join(f"{k} x{len(v)}" for k, v in found.items())
                 or "none"), flush=True)
    profiles = {}
    if args.profile:
      for c, run in runs.items():
        key = "nocp" if c is None else f"cp={c}"
        profiles[key] = profile_program(run.run, args.profile_steps,
                                        args.device_plane)
        if profiles[key]:
          g = profiles[key]["groups_ms"]
          print(f"  profile {key}: busy {profiles[key]['busy_ms']:.2f} ms; "
                + ", ".join(f"{k} {v:.2f}" for k, v in g.items()),
                flush=True)
          print_idle(profiles[key]["idle"])
    records.append({"strategy": strategy, "doc_order": order,
                    "kind": "config",
                    "documents": lens, "max_seqlen": max_seqlen,
                    "model_flops": flops, "matmul_params": n_params,
                    "profiles": profiles, "collectives": collectives})
    runs.clear()
  return {"env": {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "device_kind": jax.devices()[0].device_kind,
      "device_count": jax.device_count(), "jax": jax.__version__,
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "args": vars(args)},
          "records": records}


def _label(record: dict) -> str:
  """A table's strategy cell: NO_LOAD_BALANCE names its document order."""
  order = record.get("doc_order")
  if record["strategy"] == "no_load_balance" and order:
    return f"no_load_balance ({order})"
  return record["strategy"]


def step_table(result: dict) -> str:
  """Markdown: one line per pair."""
  env = result["env"]
  a = env["args"]
  head = (f"{a['layers']} layers, d_model {a['d_model']}, {a['heads']}/"
          f"{a['kv_heads']} heads, {a['dtype']}, {a['batch']} x "
          f"{a['seq_len']} tokens (docs cut at {a['max_doc_len']}), "
          f"{a['param_sharding']} params; {env['device_kind']}, paired "
          f"A B B A, device-only steady step time, MFU vs "
          f"{a['peak_tflops']:.0f} TFLOP/s per device; XLA_FLAGS="
          f"'{env.get('xla_flags', '')}'\n\n")
  lines = ["| strategy | A | ms | MFU | B | ms | MFU | tok/s (B) | A/B |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in result["records"]:
    if r.get("kind") == "config":
      continue
    lines.append(
        f"| {_label(r)} | {r['a']} | {r['ms_a']:.2f} | {r['mfu_a']:.1%}"
        f" | {r['b']} | {r['ms_b']:.2f} | {r['mfu_b']:.1%} | "
        f"{r['tok_s_b']:,.0f} | {r['ratio_median']:.3f} "
        f"({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}) |")
  prof = []
  for r in result["records"]:
    for key, p in (r.get("profiles") or {}).items():
      if p:
        g = p["groups_ms"]
        prof.append(f"| {_label(r)} | {key} | {p['busy_ms']:.2f} | "
                    + " | ".join(f"{g.get(k, 0.0):.2f}" for k in (
                        "attention", "matmul", "collective_exposed",
                        "collective_overlapped", "elementwise", "copy"))
                    + " |")
  if prof:
    lines += ["", "Kernels per step (ms, first device):", "",
              ("| strategy | program | busy | attention | matmul | "
               "coll. exposed | coll. overlapped | elementwise | copies |"),
              "|---|---|---|---|---|---|---|---|---|", *prof]
  return head + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
  args = build_parser().parse_args(argv)
  if args.table:
    with open(args.table) as f:
      result = json.load(f)
    print(step_table(result))
    return result
  _configure(args)
  result = run_bench(args)
  os.makedirs(args.out, exist_ok=True)
  kind = result["env"]["device_kind"].replace(" ", "_")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = os.path.join(args.out, f"step_{stamp}_{kind}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  result["path"] = path
  print(step_table(result))
  print(path)
  return result


if __name__ == "__main__":
  main()
