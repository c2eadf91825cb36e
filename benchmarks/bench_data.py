"""Host throughput of the example's grain pipeline (tokens/s).

``python -m benchmarks.bench_data --workers 0 1 2 4 8``: for each worker
count, the pipeline of ``examples/packed_lm/data.py`` (standard-library
files read, packed by grain's first-fit packing aligned to the strategy's
padding, converted by ``jax_cp.rows_from_segment_ids``) builds ``--rows``
rows of ``--seq-len`` tokens after ``--warmup`` rows, and the tokens per
second are printed. 0 workers: in this process, behind grain's thread
prefetch; N > 0: grain's ``mp_prefetch`` with N worker processes. Compare
with the step's tokens/s on the device (704k tok/s for the example's
32k-token rows on one H200: the pipeline must reach at least twice that).
"""

from __future__ import annotations

import argparse
import os
import time

from absl import flags

from examples.packed_lm import config, data


def measure(cfg: config.Config, cp: int, workers: int, rows: int,
            warmup: int) -> float:
  """Tokens per second of the pipeline with ``workers`` processes."""
  per = cfg.batch
  it = iter(data.shard_pipeline(cfg, cp, per, workers=workers))
  try:
    for _ in range(max(warmup // per, 1)):
      next(it)
    n = max(rows // per, 1)
    t0 = time.perf_counter()
    for _ in range(n):
      next(it)
    dt = time.perf_counter() - t0
  finally:
    it.close()
  return n * per * cfg.seq_len / dt


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--seq-len", type=int, default=32768)
  p.add_argument("--batch", type=int, default=1, help="rows per batch")
  p.add_argument("--cp", type=int, default=8)
  p.add_argument("--strategy", default="dual_chunk_swap",
                 choices=["dual_chunk_swap", "no_load_balance"])
  p.add_argument("--rows", type=int, default=64, help="rows timed")
  p.add_argument("--warmup", type=int, default=8, help="rows before timing")
  args = p.parse_args(argv)
  if not flags.FLAGS.is_parsed():   # grain's worker processes read them
    flags.FLAGS(["bench_data"])
  cfg = config.Config(seq_len=args.seq_len, batch=args.batch,
                      strategy=args.strategy)
  print(f"seq_len {cfg.seq_len}, {cfg.strategy} cp={args.cp}, "
        f"{os.cpu_count()} CPUs")
  for w in args.workers:
    tok_s = measure(cfg, args.cp, w, args.rows, args.warmup)
    print(f"workers {w:3d}: {tok_s:14,.0f} tok/s")


if __name__ == "__main__":
  main()
