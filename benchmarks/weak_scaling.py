"""Weak scaling of the example's training step (``bench_step --weak``).

The tokens per GPU are fixed and the row grows with the GPUs: for every cp
of ``--cp`` (default 1, 2, 4, ... up to the device count) and every
``--weak`` tokens-per-GPU value ``n``, one row of ``T = cp * n`` tokens
trains on a ``1 x cp`` mesh (the first ``cp`` devices). The rows
(:data:`benchmarks.names.SCALING_ROWS`, ``--rows``):

* ``dcs_one_doc``: DUAL_CHUNK_SWAP on one document of ``T`` tokens (the
  standard library's files joined);
* ``nlb_short``: NO_LOAD_BALANCE on files cut at ``--max-doc-len`` (1024)
  bytes, in the order of ``--doc-order`` (``balanced``: reordered so that
  every rank's chunk holds near-equal attention work);
* ``nlb_one_doc``: NO_LOAD_BALANCE on the one-document row, for the
  measured NO_LOAD_BALANCE / DUAL_CHUNK_SWAP step-time ratio against the
  predicted ``(2 cp - 1) / cp`` (the last rank's causal work over the
  balanced share).

Each program is timed alone (attention FLOPs grow with ``T``, so cp=N and
cp=1 are different work and are not paired): its device-only steady time
per step, :func:`benchmarks.timing.steady` with blocks of about
``--block-ms``. Reported per program: model TFLOP/s per GPU (MFU
convention, :func:`jax_cp.model_flops`, over ``cp`` devices), MFU against
``--peak-tflops`` and, in the report, the efficiency against cp=1 (TFLOP/s
per GPU at cp over that at cp=1). The result file
(``scaling_<date>_<device>.json``) is rewritten after every program, and
:mod:`benchmarks.scaling_report` then writes ``SCALING.md`` (and its plot)
from every ``scaling_*.json`` of ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks import bench_step, results, scaling_report
from benchmarks.names import SCALING_ROW

# --budget-s: a program starts only if this many times the last one's
# seconds are left.
BUDGET_MARGIN = 1.5


def default_cps(device_count: int) -> list[int]:
  """1, 2, 4, ... up to ``device_count``."""
  out = [1]
  while out[-1] * 2 <= device_count:
    out.append(out[-1] * 2)
  return out


def one_document_rows(cfg, cp: int):
  """``cfg.batch`` rows of one document of ``cfg.seq_len`` tokens each (the
  standard library's files in ``cfg.seed``'s order, joined and cut), padded
  for ``cfg.strategy`` on ``cp`` ranks."""
  # pylint: disable-next=import-outside-toplevel
  import jax_cp
  from examples.packed_lm import data  # pylint: disable=import-outside-toplevel
  parts, need = [], cfg.seq_len
  for doc in data.iter_documents(cfg.seed):
    parts.append(doc)
    need -= doc.size
    if need <= 0:
      break
  doc = np.concatenate(parts)[:cfg.seq_len]
  return jax_cp.pack_documents([doc] * cfg.batch, cfg.seq_len, cfg.batch,
                               jax_cp.pad_multiple_for(cfg.strategy, cp))


def rows_for(args, row: str, cp: int, tokens: int):
  """``(args for this program, rows, document order)`` of ``row`` with
  ``tokens`` per row on ``cp`` ranks (one document has no order: packed)."""
  from examples.packed_lm import data  # pylint: disable=import-outside-toplevel
  strategy, docs = SCALING_ROW[row]
  order = ("packed" if strategy != "no_load_balance" or docs == "one_doc"
           else args.doc_order[0])
  prog_args = argparse.Namespace(**{**vars(args), "seq_len": tokens})
  cfg = bench_step.example_config(prog_args, strategy, order)
  if docs == "one_doc":
    return prog_args, one_document_rows(cfg, cp), order
  return prog_args, data.load_rows(cfg, args.batch, cp), order


def time_program(prog, block_ms: float) -> dict:
  """First call (compilation included), one synced call, and the seconds
  per step of ``prog`` (a :class:`benchmarks.bench_step.Program`): steady
  (:func:`benchmarks.timing.steady`, blocks of about ``block_ms``) when a
  step is shorter than a block; else the fastest of three synced calls (a
  step that long hides the host's dispatch between steps, and the steady
  slope would cost six more)."""
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import timing  # pylint: disable=import-outside-toplevel

  def synced() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(prog.step())
    return time.perf_counter() - t0
  out = {"first_s": synced(), "synced_s": synced()}
  out["depth"] = timing.pipeline_depth(out["synced_s"], block_ms)
  if out["synced_s"] * 1e3 >= block_ms:
    out["timing"] = "synced"
    out["step_s"] = min([out["synced_s"], synced(), synced()])
  else:
    out["timing"] = "steady"
    out["step_s"] = timing.steady(prog.step, [()], out["depth"])
  return out


def measure(args, row: str, cp: int, tokens_per_gpu: int) -> dict:
  """One program's record: ``row`` at ``cp`` with ``tokens_per_gpu``."""
  import jax_cp  # pylint: disable=import-outside-toplevel
  strategy, _ = SCALING_ROW[row]
  tokens = cp * tokens_per_gpu
  prog_args, rows, order = rows_for(args, row, cp, tokens)
  max_seqlen = args.max_seqlen or rows.max_seqlen
  prog, n_params = bench_step.build_program(prog_args, strategy, cp, rows,
                                            max_seqlen)
  t = time_program(prog, args.block_ms)
  flops = jax_cp.model_flops(rows.cu_seqlens, tokens=rows.tokens.size,
                             matmul_params=n_params, num_layers=args.layers,
                             num_heads=args.heads,
                             head_dim=args.d_model // args.heads)
  step_s = t["step_s"]
  return dict(
      kind="weak", row=row, strategy=strategy, doc_order=order,
      model=args.model_name, layers=args.layers,
      d_model=args.d_model, heads=args.heads, kv_heads=args.kv_heads,
      dtype=args.dtype, remat=args.remat, batch=args.batch,
      max_doc_len=args.max_doc_len,
      tokens_per_gpu=tokens_per_gpu, cp=cp, seq_len=tokens,
      documents=int((np.diff(rows.cu_seqlens[0]) > 0).sum()),
      max_seqlen=max_seqlen, matmul_params=n_params, model_flops=flops,
      first_s=t["first_s"], synced_ms=t["synced_s"] * 1e3, depth=t["depth"],
      timing=t["timing"],
      ms=step_s * 1e3, tok_s=rows.tokens.size / step_s,
      tflops_per_gpu=flops / step_s / cp / 1e12,
      mfu=flops / step_s / (args.peak_tflops * 1e12 * cp))


def run(args) -> dict:
  """Every (tokens per GPU, row, cp) of ``args``; the result file is
  written after each program; at the end ``SCALING.md`` (printed) from
  every ``scaling_*.json`` of ``args.out``. Returns the result with its
  ``path``."""
  import jax  # pylint: disable=import-outside-toplevel
  if args.profile:
    raise SystemExit("--profile is not measured with --weak")
  cps = sorted(set(args.cp or default_cps(jax.device_count())))
  if skipped := [c for c in cps if c > jax.device_count()]:
    print(f"--cp {skipped}: not measured, jax sees {jax.device_count()} "
          "devices", flush=True)
    cps = [c for c in cps if c <= jax.device_count()]
    if not cps:
      raise SystemExit("no --cp size fits the devices")
  env = results.environment(xla_flags=os.environ.get("XLA_FLAGS", ""),
                            args=vars(args))
  result = {"env": env, "records": []}
  path = results.result_path(args.out, "scaling", env, args.tag)
  start = previous = time.monotonic()
  plan = [(n, row, cp) for n in args.weak for row in args.rows for cp in cps]
  for i, (n, row, cp) in enumerate(plan):
    now = time.monotonic()
    last_s, previous = now - previous, now    # the last program's seconds
    # The next program (a larger cp, usually) takes longer than the last;
    # the first always runs.
    if i and args.budget_s and (now - start + BUDGET_MARGIN * last_s
                                > args.budget_s):
      print(f"--budget-s {args.budget_s:g}: {len(plan) - i} of "
            f"{len(plan)} programs not measured", flush=True)
      break
    try:
      rec = measure(args, row, cp, n)
    except jax.errors.JaxRuntimeError as e:   # e.g. out of memory: go on
      msg = str(e).splitlines()[0][:300]
      result["records"].append(dict(kind="weak_error", row=row, cp=cp,
                                    tokens_per_gpu=n, model=args.model_name,
                                    error=msg))
      results.write_result(path, result)
      print(f"{args.model_name} {row} {n} tokens/GPU cp={cp}: {msg}",
            flush=True)
      continue
    result["records"].append(rec)
    results.write_result(path, result)
    print(f"{args.model_name} {row:12s} {n // 1024:4d}k/GPU cp={cp} "
          f"T={rec['seq_len']:>8,}: {rec['ms']:9.2f} ms, "
          f"{rec['tflops_per_gpu']:6.1f} TFLOP/s/GPU, MFU {rec['mfu']:.1%} "
          f"(first call {rec['first_s']:.0f} s)", flush=True)
  md = scaling_report.write(os.path.join(args.out, "scaling_*.json"),
                            args.out)
  result["path"] = path
  with open(md) as f:      # this run's and every earlier file's programs
    print(f.read())
  print(path)
  print(md)
  return result
