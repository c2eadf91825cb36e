"""Each call of a CP rank's attention plan, timed alone on one GPU against
a top-left call of the same shape.

From the repository root, on one GPU::

    python -m benchmarks.bench_call_plan --strategy dual_chunk_swap \\
        --window 4095 --dists one_doc uniform_1k_8k

For every rank ``r`` of a ``--cp`` layout (default 2) the plan's forward
and backward calls (:func:`jax_cp.call_plan.forward_calls`,
:func:`jax_cp.call_plan.backward_calls`) run as the rank runs them: the
rank's local Q rows ``[T/cp, Hq, D]`` against the exchanged K/V
``[T, Hkv, D]`` (or the local ones; a call over compact buffers, their
sizes), the call's segments, mask and band, on random inputs (a reversed
or compact call's timing does not depend on which rows its inputs hold).
Each is paired (:func:`benchmarks.timing.paired`, A and B in alternation)
with the
*reference*: the same segments and bounds, top-left causal with the
layout's band. Per call it prints

* ``ms`` of the call and of the reference;
* ``time``: call / reference;
* ``per pair``: the call's time per (query, key) pair it computes over
  the reference's (> 1: slower per unit of work). An unmasked call has
  about twice the pairs of a top-left one of its shape, so ``per pair`` is
  the figure to read; a call cuDNN runs on a slow path (a bottom-right
  band's backward) shows there as several times 1.

and per rank the sum of its calls against the one-GPU program's one
top-left call over the whole row, whose ``1/cp`` is the ideal share.
``--plan bottom_right`` (``cp_attention``'s ``dcs_window_plan``) times
DUAL_CHUNK_SWAP's banded bottom-right plan instead, ``split_backward`` its
bottom-right forward call with the split backward, for comparison.
Writes a JSON next to the other results.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results, timing
from benchmarks.names import DISTS
from benchmarks.workload import make_row
from jax_cp import call_plan, checks, cp_config
from jax_cp.attention.api import window_kwargs
from jax_cp.attention.backend import Segments


def segment_pairs(seg: Segments, mask: str, left: int) -> int:
  """The (query, key) pairs a call's segments compute."""
  total = 0
  for q, kv in zip(np.asarray(seg.q_lens), np.asarray(seg.kv_lens)):
    q, kv = int(q), int(kv)
    if q <= 0 or kv <= 0:
      continue
    if mask == "no_mask":
      total += q * kv
      continue
    d = np.arange(q, dtype=np.int64)
    if mask == "causal_bottom_right":
      d = d + kv - q
    lo = np.zeros_like(d) if left < 0 else np.maximum(d - left, 0)
    total += int(np.maximum(np.minimum(d, kv - 1) - lo + 1, 0).sum())
  return total


def _runner(backend, direction: str, mask: str, left: int, scale: float):
  """A jitted ``f(q, k, v, out, lse, dout, seg)`` running one forward or
  backward call."""
  extra = window_kwargs(left)

  def fwd(q, k, v, out, lse, dout, seg):
    del out, lse, dout
    return backend.forward(q, k, v, seg, mask=mask, scale=scale, **extra)

  def bwd(q, k, v, out, lse, dout, seg):
    return backend.backward(q, k, v, out, lse, dout, seg, mask=mask,
                            scale=scale, **extra)

  return jax.jit(fwd if direction == "fwd" else bwd)


@functools.cache
def _inputs(tq: int, tkv: int, hq: int, hkv: int, d: int, dtype):
  """(q, k, v, out, dout, lse): random (on the device), ``lse`` finite;
  one set per shape."""
  keys = jax.random.split(jax.random.key(tq * 7 + tkv), 6)
  normal = lambda key, *shape: jax.random.normal(key, shape, dtype)
  lse = jax.random.uniform(keys[5], (tq, hq), jnp.float32, 1.0, 3.0)
  return (normal(keys[0], tq, hq, d), normal(keys[1], tkv, hkv, d),
          normal(keys[2], tkv, hkv, d), normal(keys[3], tq, hq, d),
          normal(keys[4], tq, hq, d), lse)


def time_call(backend, direction, call, cfg, seg, arrays, reps, cache):
  """The paired timings of one call and its top-left reference."""
  q, k, v, out, dout, lse = arrays
  args = [(q, k, v, out, lse, dout, seg)]
  band = call_plan.window_left(cfg, call)

  def fn(mask, left):
    key = (direction, mask, left)
    if key not in cache:
      cache[key] = _runner(backend, direction, mask, left, cfg.scale)
    return cache[key]

  ref_left = cfg.window_left
  r = timing.paired(fn(call.mask, band), args,
                    fn("causal_top_left", ref_left), args, reps,
                    pipeline_ms=20.0)
  pairs = segment_pairs(seg, call.mask, band)
  ref_pairs = segment_pairs(seg, "causal_top_left", ref_left)
  per_pair = (r.ratio_median * ref_pairs / pairs) if pairs else float("nan")
  return dict(mask=call.mask, window_left=band,
              compact=call.window_rows is not None,
              reversed=call.reversed, pairs=pairs, ref_pairs=ref_pairs,
              ms=r.ms_a, ms_ref=r.ms_b, time_ratio=r.ratio_median,
              time_ratio_q1=r.ratio_q1, time_ratio_q3=r.ratio_q3,
              per_pair_ratio=per_pair)


def _config(args, row, cp):
  shape = lambda h: (1, args.tokens, h, args.head_dim)
  return cp_config.make_config(
      shape(args.hq), shape(args.hkv), shape(args.hkv), args.dtype,
      row.cu[None], row.cuP[None], cp_size=cp, cp_axis="cp",
      load_balancing_strategy=args.strategy, cp_comm_type="all_gather",
      attn_mask_type="causal", softmax_scale=None, backend=args.backend,
      max_seqlen=row.max_seqlen,
      window_size=None if args.window is None else (args.window, 0),
      split_causal_backward=None, total_tokens=args.tokens,
      max_seqlen_violation="checked_on_host", dcs_window_plan=args.plan)


def _call_tokens(cfg, call):
  """(Q rows, KV rows) of the buffers a call reads."""
  rows = call.window_rows
  if rows is not None:
    return rows.q_src.shape[-1], rows.kv_src.shape[-1]
  tq = cfg.local_tokens if call.q_rows is None else call.q_rows
  if not call.exchanged:
    return tq, cfg.local_tokens
  return tq, call.kv_rows or cfg.total_tokens


def bench_row(args, dist: str, cache) -> list[dict[str, Any]]:
  row = make_row(dist, args.tokens, args.strategy, args.cp, "auto",
                 args.seed)
  cfg = _config(args, row, args.cp)
  cfg1 = _config(args, row, 1)
  backend, dtype = cfg.backend, jnp.dtype(args.dtype)
  records = []
  heads = (args.hq, args.hkv, args.head_dim, dtype)
  for direction in ("fwd", "bwd"):
    whole, = call_plan.forward_calls(cfg1, row.cu[None], row.cuP[None],
                                     jnp.int32(0))
    t = args.tokens
    seg1 = call_plan.segments(whole, t, t)
    one = time_call(backend, direction, whole, cfg1, seg1,
                    _inputs(t, t, *heads), args.reps, cache)
    plans = (call_plan.forward_calls if direction == "fwd"
             else call_plan.backward_calls)
    for rank in range(args.cp):
      calls = plans(cfg, row.cu[None], row.cuP[None], jnp.int32(rank))
      total = 0.0
      for i, call in enumerate(calls):
        tq, tkv = _call_tokens(cfg, call)
        seg = call_plan.segments(call, tq, tkv)
        rec = time_call(backend, direction, call, cfg, seg,
                        _inputs(tq, tkv, *heads), args.reps, cache)
        rec.update(dist=dist, direction=direction, rank=rank, call=i)
        records.append(rec)
        total += rec["ms"]
        work = (f"per pair {rec['per_pair_ratio']:.3f} "
                f"({rec['pairs'] / 1e6:.1f}M pairs)" if rec["pairs"]
                else "no pairs (fixed work only)")
        print(f"{dist:14s} {direction} rank {rank} call {i} "
              f"{rec['mask']:19s} band {rec['window_left']:5d}"
              f"{' compact' if rec['compact'] else ''}"
              f"{' reversed' if rec['reversed'] else ''}: "
              f"{rec['ms']:8.3f} ms vs top-left {rec['ms_ref']:8.3f} ms, "
              f"time {rec['time_ratio']:.3f}, {work}", flush=True)
      ideal = one["ms"] / args.cp
      records.append(dict(dist=dist, direction=direction, rank=rank,
                          total_ms=total, one_gpu_ms=one["ms"],
                          share_of_ideal=total / ideal))
      print(f"{dist:14s} {direction} rank {rank} total {total:8.3f} ms; "
            f"one GPU {one['ms']:8.3f} ms, its 1/{args.cp} {ideal:8.3f} ms:"
            f" {total / ideal:.3f} of ideal", flush=True)
  return records


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--strategy", default="dual_chunk_swap",
                 choices=("dual_chunk_swap", "no_load_balance"))
  p.add_argument("--cp", type=int, default=2)
  p.add_argument("--dists", nargs="+", default=["one_doc", "uniform_1k_8k"],
                 choices=DISTS)
  # The shape of results/SLIDING_WINDOW.md: T = 64k, Hq 32, Hkv 8, D 128,
  # window 4095, bf16.
  for flag, default in (("--tokens", 65536), ("--hq", 32), ("--hkv", 8),
                        ("--head-dim", 128), ("--window", 4095)):
    p.add_argument(flag, type=int, default=default)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--plan", choices=checks.DCS_WINDOW_PLANS,
                 default="split",
                 help="DUAL_CHUNK_SWAP's windowed plan (cp_attention's "
                      "dcs_window_plan)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=results.RESULTS_DIR)
  args = p.parse_args(argv)
  cache: dict = {}
  records = []
  for dist in args.dists:
    records += bench_row(args, dist, cache)
  worst = [r["per_pair_ratio"] for r in records
           if "per_pair_ratio" in r and r["pairs"] > 0]
  if worst:
    print(f"largest per-pair ratio of a call: {max(worst):.3f} "
          f"(median {statistics.median(worst):.3f})")
  env = results.environment(dcs_window_plan=args.plan)
  path = results.write_result(
      results.result_path(args.out, "call_plan", env),
      {"env": env, "args": vars(args), "records": records})
  print(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
