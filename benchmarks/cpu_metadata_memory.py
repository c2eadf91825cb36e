"""CPU measurement of the windowed DUAL_CHUNK_SWAP metadata: the compiled
temp bytes and run time of :func:`jax_cp.metadata.window_compaction` (and
the two steps it reads) for one row of ``T`` tokens and ``N`` documents.

  python -m benchmarks.cpu_metadata_memory --seq-lens 65536 262144 \
      --docs 1024 4096 --cp 4 --window 512 [--run]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp import metadata


def _row(t: int, n: int, cp: int, seed: int = 0):
  """``(cu, cuP)`` ``[1, N+1]``: ``n`` documents filling ``t`` tokens,
  each padded to a multiple of ``2 cp``."""
  rng = np.random.default_rng(seed)
  unit = 2 * cp
  slots = t // unit
  cuts = np.sort(rng.choice(np.arange(1, slots), n - 1, replace=False))
  plens = np.diff(np.concatenate([[0], cuts, [slots]])) * unit
  lens = np.maximum(plens - rng.integers(0, unit, n), 1)
  cuP = np.concatenate([[0], np.cumsum(plens)])[None].astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)])[None].astype(np.int32)
  return cu, cuP


def build(t: int, n: int, cp: int, left: int):
  tl = t // cp
  c = t // (2 * cp)
  sq, skv = metadata.window_compaction_sizes(n, cp, left, c, tl, t)

  def f(cu, cuP, rank):
    steps = tuple(metadata.dual_chunk_swap_step(cu, cuP, cp, rank, s)
                  for s in (0, 1))
    return metadata.window_compaction(steps, cuP, cp, left, tl, t, sq, skv)

  return jax.jit(f)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
  p.add_argument("--docs", type=int, nargs="+", default=[1024])
  p.add_argument("--cp", type=int, default=4)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--run", action="store_true", help="also time a call")
  a = p.parse_args(argv)
  for t in a.seq_lens:
    for n in a.docs:
      cu, cuP = _row(t, n, a.cp)
      fn = build(t, n, a.cp, a.window)
      t0 = time.perf_counter()
      compiled = fn.lower(cu, cuP, jnp.int32(1)).compile()
      comp = time.perf_counter() - t0
      temp = compiled.memory_analysis().temp_size_in_bytes
      line = (f"T={t} N={n} cp={a.cp} left={a.window}: temp "
              f"{temp / 2**20:.1f} MiB (4*T*2N = {4 * t * 2 * n / 2**20:.0f}"
              f" MiB), compile {comp:.2f} s")
      if a.run:
        jax.block_until_ready(compiled(cu, cuP, jnp.int32(1)))
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(cu, cuP, jnp.int32(1)))
        line += f", run {time.perf_counter() - t0:.3f} s"
      print(line, flush=True)


if __name__ == "__main__":
  main()
