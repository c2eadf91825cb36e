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

``--weak TOKENS_PER_GPU ...`` measures weak scaling instead
(:mod:`benchmarks.weak_scaling`): T = cp x tokens per GPU, each program
timed alone, model TFLOP/s per GPU and the efficiency against cp=1, written
to ``scaling_<date>_<device>.json`` and ``SCALING.md``. ``--model big``
(16 layers, d_model 2048, 32/8 heads) replaces the model flags.

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
import os
import time
from collections.abc import Sequence

from benchmarks import profiling, results
from benchmarks.names import DOC_ORDERS, MODELS, SCALING_ROWS, STRATEGIES
from examples.packed_lm.config import REMAT, Config  # no jax import


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--cp", type=int, nargs="+", default=None,
                 help="cp sizes; 1 is the base every other is paired with "
                 "(default: 1 2; --weak: 1, 2, 4, ... up to the devices)")
  p.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                 default=list(STRATEGIES))
  p.add_argument("--weak", type=int, nargs="+", default=None,
                 metavar="TOKENS_PER_GPU",
                 help="weak scaling: T = cp x each of these, per row of "
                 "--rows (benchmarks/weak_scaling.py)")
  p.add_argument("--rows", nargs="+", choices=SCALING_ROWS,
                 default=list(SCALING_ROWS), help="--weak: the rows")
  p.add_argument("--model", choices=sorted(MODELS), default=None,
                 help="a preset of --layers --d-model --heads --kv-heads")
  example = MODELS["example"]
  p.add_argument("--layers", type=int, default=example["layers"])
  p.add_argument("--d-model", type=int, default=example["d_model"])
  p.add_argument("--heads", type=int, default=example["heads"])
  p.add_argument("--kv-heads", type=int, default=example["kv_heads"])
  p.add_argument("--remat", choices=REMAT, default="none")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="bfloat16")
  p.add_argument("--seq-len", type=int, default=32768, help="tokens per row")
  p.add_argument("--batch", type=int, default=1, help="rows per step")
  p.add_argument("--max-doc-len", type=int, default=None,
                 help="cut files to this many bytes (default 16384; "
                 "--weak: 1024)")
  p.add_argument("--max-seqlen", type=int, default=None,
                 help="static document-length bound (default: the data's)")
  p.add_argument("--backend", choices=("auto", "xla", "cudnn"),
                 default="auto")
  p.add_argument("--doc-order", nargs="+", choices=DOC_ORDERS,
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
  p.add_argument("--device-plane", default=profiling.DEVICE_PLANE)
  p.add_argument("--budget-s", type=float, default=None,
                 help="--weak: start no program that would likely end "
                 "after this many seconds (1.5 x the last one's time; what "
                 "was measured is kept)")
  p.add_argument("--tag", default=None, help="suffix of the result file")
  p.add_argument("--out", default=results.RESULTS_DIR)
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
                                 f"count={max(args.cp or [8])}").strip()


def resolve(args) -> argparse.Namespace:
  """The defaults that depend on other flags: ``--model``'s sizes (and
  ``model_name``, the preset's name or ``L<layers>-d<d_model>``), the cp
  sizes and the document cut of the mode."""
  if args.model:
    for key, value in MODELS[args.model].items():
      setattr(args, key, value)
  sizes = {k: getattr(args, k) for k in MODELS["example"]}
  args.model_name = next((name for name, m in MODELS.items() if m == sizes),
                         f"L{args.layers}-d{args.d_model}")
  if args.cp is None and not args.weak:
    args.cp = [1, 2]
  if args.max_doc_len is None:
    args.max_doc_len = 1024 if args.weak else 16384
  return args


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
                param_sharding=param_sharding or args.param_sharding,
                remat=args.remat)


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
    prog.collectives = profiling.hlo_collectives(
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
        profiles[key] = profiling.profile(run.run, args.profile_steps,
                                          args.device_plane)
        if profiles[key]:
          g = profiles[key]["groups_ms"]
          print(f"  profile {key}: busy {profiles[key]['busy_ms']:.2f} ms; "
                + ", ".join(f"{k} {v:.2f}" for k, v in g.items()),
                flush=True)
          profiling.print_idle(profiles[key]["idle"])
    records.append({"strategy": strategy, "doc_order": order,
                    "kind": "config",
                    "documents": lens, "max_seqlen": max_seqlen,
                    "model_flops": flops, "matmul_params": n_params,
                    "profiles": profiles, "collectives": collectives})
    runs.clear()
  return {"env": results.environment(
      xla_flags=os.environ.get("XLA_FLAGS", ""), args=vars(args)),
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
    result = results.read_result(args.table)
    print(step_table(result))
    return result
  resolve(args)
  _configure(args)
  if args.weak:
    from benchmarks import weak_scaling  # pylint: disable=import-outside-toplevel
    return weak_scaling.run(args)
  result = run_bench(args)
  path = results.write_result(
      results.result_path(args.out, "step", result["env"], args.tag), result)
  result["path"] = path
  print(step_table(result))
  print(path)
  return result


if __name__ == "__main__":
  main()
