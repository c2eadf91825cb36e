"""CP attention at cp=N against cp=1 on the same row, paired.

    python -m benchmarks.bench_cp --cp 2 --window 4095

For every strategy, document mix, document order and pass: one packed row
of ``--tokens`` tokens (DUAL_CHUNK_SWAP: every document padded to a
multiple of ``2*cp``; ``balanced``: the documents reordered by
:func:`jax_cp.planning.balance_document_order` for the cp=N ranks, for
NO_LOAD_BALANCE only, whose work depends on the order), and
:func:`jax_cp.cp_attention` on it, jitted, over one device (A) and over
``--cp`` devices (B). The row's metadata are a :class:`jax_cp.CPBatch`
checked on the host (``max_seqlen``: the longest padded document) and
passed to the jitted step as an argument, as a training step gets them.
``--comm-type ring`` runs the cp=N side with the ring exchange. ``fwd`` is
the forward, ``fwd_bwd`` ``jax.value_and_grad`` of ``sum(out *
dout)`` in q, k, v. A and B are timed in alternation
(:func:`benchmarks.timing.paired`); the speed-up is A's time over B's.

Prints one line per pair, writes ``cp_<date>_<device>.json`` (rewritten
after every pair) and rebuilds ``cp.md`` beside it.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from benchmarks import results, timing, workload


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_cp",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--cp", type=int, default=2, help="N, paired with cp=1")
  p.add_argument("--strategies", nargs="+", choices=workload.STRATEGIES,
                 default=list(workload.STRATEGIES))
  p.add_argument("--dists", nargs="+", choices=workload.DISTS,
                 default=list(workload.DEFAULT_DISTS))
  p.add_argument("--doc-order", nargs="+", choices=workload.DOC_ORDERS,
                 default=list(workload.DOC_ORDERS))
  p.add_argument("--passes", nargs="+", choices=workload.PASSES,
                 default=list(workload.PASSES))
  p.add_argument("--tokens", type=workload.parse_tokens, default=65536)
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--comm-type", default="all_gather",
                 choices=("all_gather", "ring"),
                 help="how K/V travel between the cp=N ranks")
  p.add_argument("--window", type=int, default=None,
                 help="causal sliding window (LEFT, 0) in both programs")
  p.add_argument("--reps", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--device", choices=("gpu", "cpu"), default=None,
                 help="cpu: virtual CPU devices (default: JAX's platform)")
  p.add_argument("--out", default=results.RESULTS_DIR)
  p.add_argument("--tag", default=None, help="suffix of the result file")
  return p


def program(cp: int, cu, cuP, args, strategy: str, pass_name: str):
  """The jitted step of the row at ``cp`` and two input sets ``(q, k, v,
  dout, batch)``."""
  mesh = workload.make_mesh(cp)
  layout = jax_cp.CPLayout(mesh=mesh, strategy=strategy,
                           backend=args.backend, comm_type=args.comm_type,
                           max_seqlen=int(np.diff(cuP).max()))
  cuP_d, cu_d = workload.replicated(mesh, cuP, cu)
  batch = jax_cp.CPBatch(None, cuP_d, cu_d, layout=layout).check_on_host()
  window = workload.window_size(args.window)
  step = jax.jit(workload.with_pass(
      lambda q, k, v, b: jax_cp.cp_attention(q, k, v, b, window_size=window),
      pass_name))
  t, hq, hkv, d = args.tokens, args.hq, args.hkv, args.head_dim
  shapes = [(t, hq, d), (t, hkv, d), (t, hkv, d), (t, hq, d)]
  sets = [tuple(workload.random_inputs(
      shapes, jnp.dtype(args.dtype), args.seed + i,
      NamedSharding(mesh, P("cp")))) + (batch,) for i in range(2)]
  return step, sets


def main(argv: Sequence[str] | None = None) -> str:
  """Runs the pairs; returns the path of the JSON written."""
  args = build_parser().parse_args(argv)
  if args.cp < 2:
    raise SystemExit("--cp must be at least 2 (it is paired with cp=1)")
  if args.device == "cpu":
    workload.use_cpu(args.cp)
  run = results.Run("cp", argv, args, args.tag)
  configs = [(s, dist, o) for s, dist, o in itertools.product(
      args.strategies, args.dists, args.doc_order)
             if o == "packed" or s == "no_load_balance"]
  for strategy, dist, order in configs:
    cu, cuP = workload.make_row(dist, args.tokens, strategy, args.cp,
                                args.seed, order, args.window)
    for pass_name in args.passes:
      rec = dict(strategy=strategy, dist=dist, doc_order=order,
                 window=args.window, cp=args.cp, tokens=args.tokens,
                 hq=args.hq, hkv=args.hkv, head_dim=args.head_dim,
                 dtype=args.dtype, backend=args.backend,
                 comm_type=args.comm_type, docs=len(cu) - 1,
                 max_seqlen=int(np.diff(cuP).max()), reps=args.reps,
                 flops=workload.attention_flops(cu, args.hq, args.head_dim,
                                                pass_name, args.window))
      rec["pass"] = pass_name
      try:
        a, b = (program(c, cu, cuP, args, strategy, pass_name)
                for c in (1, args.cp))
        rec.update(timing.paired(*a, *b, reps=args.reps).fields())
        rec["tflops_b"] = rec["flops"] / (rec["ms_b"] / 1e3) / args.cp / 1e12
        print(f"{strategy} {dist} {order} {pass_name}: cp=1 "
              f"{rec['ms_a']:.3f} ms, cp={args.cp} {rec['ms_b']:.3f} ms, "
              f"{rec['ratio']:.3f}x (IQR {rec['ratio_q1']:.3f}-"
              f"{rec['ratio_q3']:.3f})", flush=True)
      except Exception as err:  # noqa: BLE001  (recorded; the run goes on)
        rec["error"] = f"{type(err).__name__}: {err}"[:600]
        print(f"{strategy} {dist} {order} {pass_name}: {rec['error']}",
              flush=True)
      run.add(rec)
  return run.finish()


if __name__ == "__main__":
  main()
