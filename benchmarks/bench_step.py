"""The example's whole training step: cp=1 against cp=N, paired.

    python -m benchmarks.bench_step --cp 2 --strategies dual_chunk_swap

The model, optimizer, shardings, step and data are the example's
(``examples/packed_lm``: ``config``, ``model``, ``train``, ``data``): by
default 4 layers, d_model 1024, 16/4 heads (head dim 64), bf16, FSDP,
one row of 32768 tokens of standard-library files cut at
``--max-doc-len`` bytes (16384), dp=1; ``--model big`` is 16 x 2048 with
32/8 heads. For NO_LOAD_BALANCE the row's documents are reordered for the
ranks as the example does (``--doc-order balanced``; ``packed`` too pairs
both). Every program trains on the same row, packed for the largest cp.

For every strategy, the cp=N step is timed against the cp=1 step in
alternation (:func:`benchmarks.timing.paired`); the first strategy also
pairs the CP model at cp=1 with the same model built with ``cp_axis=None``
(``nocp``: attention without a mesh) on one device. Each timing is the
device-only steady step time: the batch is placed once, steps are
dispatched back to back (the state donated from step to step, as in
training), and two blocks' time over their steps spreads the pipeline's
fill and drain over them (:func:`benchmarks.timing.steady`). MFU: model
FLOPs per step (:func:`jax_cp.planning.model_flops`: ``6 N`` per token
plus causal attention, backward 2x forward) over the step time and
``--peak-tflops`` per device used. ``--profile`` traces
``--profile-steps`` steps of every program and prints the first GPU's
time per kernel group (:mod:`benchmarks.profiling`).

Writes ``step_<date>_<device>.json`` and rebuilds ``step.md`` beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
from flax import nnx

import jax_cp
from benchmarks import profiling, results, timing, workload
from examples.packed_lm import config, data, model, train
from examples.packed_lm import main as lm_main


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_step",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--cp", type=int, nargs="+", default=[2],
                 help="the cp sizes each paired with cp=1 (1: only the "
                 "pair of cp=1 and the model without CP, on one GPU)")
  p.add_argument("--strategies", nargs="+", choices=workload.STRATEGIES,
                 default=list(workload.STRATEGIES))
  p.add_argument("--doc-order", nargs="+", choices=workload.DOC_ORDERS,
                 default=["balanced"],
                 help="no_load_balance's row: reordered for the ranks "
                 "and/or as packed (each order its own pair)")
  p.add_argument("--model", choices=sorted(workload.MODELS),
                 default="example")
  for name in ("layers", "d_model", "heads", "kv_heads"):
    p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                   help=f"override the model's {name}")
  p.add_argument("--remat", choices=config.REMAT, default="none")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="bfloat16")
  p.add_argument("--seq-len", type=workload.parse_tokens, default=32768)
  p.add_argument("--batch", type=int, default=1, help="rows per step")
  p.add_argument("--max-doc-len", type=workload.parse_tokens, default=16384)
  p.add_argument("--backend", choices=("auto", "xla", "cudnn"),
                 default="auto")
  p.add_argument("--param-sharding", choices=("fsdp", "replicated"),
                 default="fsdp")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--block-ms", type=float, default=300.0,
                 help="length of one timed block of back-to-back steps")
  p.add_argument("--no-nocp", action="store_true",
                 help="skip the cp=1 against cp_axis=None pair")
  p.add_argument("--peak-tflops", type=float, default=989.0,
                 help="per-device peak for the MFU (H200 dense bf16)")
  p.add_argument("--profile", action="store_true")
  p.add_argument("--profile-steps", type=int, default=4)
  p.add_argument("--out", default=results.RESULTS_DIR)
  p.add_argument("--tag", default=None, help="suffix of the result file")
  return p


def sizes(args) -> dict:
  """The model's layers, d_model, heads and kv_heads (``--model`` with
  the overrides)."""
  return {k: getattr(args, k) if getattr(args, k) is not None else v
          for k, v in workload.MODELS[args.model].items()}


class Program:
  """One training program with its own state and a batch placed once:
  ``step()`` dispatches a step (the state donated and replaced) and
  returns its loss; ``run(n)`` runs ``n`` steps and waits."""

  def __init__(self, args, strategy: str, cp: int | None, rows):
    cfg = config.Config(
        device=args.device, dtype=args.dtype, backend=args.backend,
        strategy=strategy, seq_len=args.seq_len, batch=args.batch,
        max_doc_len=args.max_doc_len, seed=args.seed, steps=1000,
        warmup=10, remat=args.remat, param_sharding="replicated"
        if cp is None else args.param_sharding, **sizes(args))
    mesh = lm_main.make_mesh(1, cp or 1, args.device)
    layout = model.make_layout(cfg, None if cp is None else mesh,
                               rows.max_seqlen)
    self.batch = data.place_batch(rows, layout)
    with jax.set_mesh(mesh):
      graphdef, self.state, shardings = train.init_state(
          cfg, layout, train.make_optimizer(cfg), mesh)
    self.fn = train.make_train_step(graphdef, shardings, mesh,
                                    cfg.param_sharding)
    self.matmul_params = model.matmul_params(
        nnx.merge(graphdef, self.state)[0])

  def step(self):
    self.state, loss = self.fn(self.state, self.batch)
    return loss

  def run(self, n: int) -> None:
    jax.block_until_ready([self.step() for _ in range(n)])


def run_pairs(args, argv) -> str:
  run = results.Run("step", argv, args, args.tag)
  run.extra["profiles"] = {}
  s, cps = sizes(args), sorted(set(args.cp))
  configs = [(st, o) for st in args.strategies
             for o in (args.doc_order if st == "no_load_balance"
                       else ["packed"])]
  for strategy, order in configs:
    cfg = config.Config(device=args.device, strategy=strategy,
                        seq_len=args.seq_len, max_doc_len=args.max_doc_len,
                        seed=args.seed, doc_order=order)
    rows = data.load_rows(cfg, args.batch, max(cps))
    programs = {1: Program(args, strategy, 1, rows)}
    flops = jax_cp.planning.model_flops(
        rows.cu_seqlens, tokens=rows.tokens.size,
        matmul_params=programs[1].matmul_params, num_layers=s["layers"],
        num_heads=s["heads"], head_dim=s["d_model"] // s["heads"])
    docs = int((rows.cu_seqlens[:, 1:] > rows.cu_seqlens[:, :-1]).sum())
    print(f"{strategy} ({order}): {args.batch} x {args.seq_len} tokens, "
          f"{docs} documents, max_seqlen {rows.max_seqlen}, "
          f"{flops / 1e12:.3f} model TFLOP per step", flush=True)
    pairs = [(1, c) for c in cps if c > 1]
    if not args.no_nocp and (strategy, order) == configs[0]:
      pairs.append((None, 1))
    for a, b in pairs:
      for c in (a, b):
        if c not in programs:
          programs[c] = Program(args, strategy, c, rows)
      r = timing.paired(programs[a].step, [()], programs[b].step, [()],
                        args.reps, warmup=1, pipeline_ms=args.block_ms)
      name = lambda c: "nocp" if c is None else f"cp={c}"
      rec = dict(model=args.model + ("*" if s != workload.MODELS[
                     args.model] else ""), **s, dtype=args.dtype,
                 seq_len=args.seq_len, batch=args.batch,
                 max_doc_len=args.max_doc_len, remat=args.remat,
                 strategy=strategy, doc_order=order, a=name(a), b=name(b),
                 documents=docs, max_seqlen=int(rows.max_seqlen),
                 model_flops=flops, reps=args.reps, **r.fields())
      for side, c in (("a", a), ("b", b)):
        sec = rec[f"ms_{side}"] / 1e3
        rec[f"tok_s_{side}"] = rows.tokens.size / sec
        rec[f"mfu_{side}"] = flops / sec / (args.peak_tflops * 1e12 * (c or 1))
      print(f"  {rec['a']} {rec['ms_a']:.2f} ms (MFU {rec['mfu_a']:.1%}), "
            f"{rec['b']} {rec['ms_b']:.2f} ms (MFU {rec['mfu_b']:.1%}): "
            f"{rec['a']} / {rec['b']} {rec['ratio']:.3f} (IQR "
            f"{rec['ratio_q1']:.3f}-{rec['ratio_q3']:.3f})", flush=True)
      run.add(rec)
    for c, prog in programs.items() if args.profile else ():
      label = f"{strategy} ({order}) {'nocp' if c is None else f'cp={c}'}"
      run.extra["profiles"][label] = profiling.profile(prog.run,
                                                       args.profile_steps)
      profiling.print_breakdown(label, run.extra["profiles"][label])
    programs.clear()
  return run.finish()


def main(argv: Sequence[str] | None = None) -> str:
  """Runs the pairs; returns the path of the JSON written."""
  args = build_parser().parse_args(argv)
  if min(args.cp) < 1 or (max(args.cp) == 1 and args.no_nocp):
    raise SystemExit("--cp takes sizes of at least 1; each above 1 is paired "
                     "with 1, and --cp 1 alone runs only cp=1 against the "
                     "model without CP")
  if args.device == "cpu":
    workload.use_cpu(max(args.cp))
  return run_pairs(args, argv)


if __name__ == "__main__":
  main()
