"""Where the time of one CP attention step goes: a per-kernel breakdown
from the JAX profiler, for one configuration.

    python -m benchmarks.profile_step --strategy no_load_balance \\
        --dist short_128_1k --tokens 65536 --cp 2 --pass fwd_bwd

Runs the jitted step a few times under ``jax.profiler.trace``, reads the
XSpace (:mod:`benchmarks.profiling`) and prints, for the first GPU, the
device time per iteration of each kernel (summed over its launches), the
number of launches, and the busy time against the wall time of a step;
``--gaps N`` adds where the device sits idle between kernels.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from benchmarks import profiling
from benchmarks.names import DISTS, PASSES, STRATEGIES, VIOLATIONS
from benchmarks.workload import make_mesh, make_row


def build_step(args: argparse.Namespace):
  """The jitted step of the configuration and its inputs."""
  row = make_row(args.dist, args.tokens, args.strategy, args.cp, "auto", 0)
  mesh = make_mesh(args.cp)
  shard = NamedSharding(mesh, P(None, "cp"))
  rng = np.random.default_rng(0)
  mk = lambda h: jax.device_put(jnp.asarray(
      rng.standard_normal((1, args.tokens, h, args.head_dim)),
      jnp.bfloat16), shard)
  q, k, v, w = mk(args.hq), mk(args.hkv), mk(args.hkv), mk(args.hq)
  cu, cuP = row.cu[None], row.cuP[None]

  def attn(q, k, v):
    return jax_cp.cp_attention(
        q, k, v, cu, cuP, mesh=mesh, backend=args.backend,
        load_balancing_strategy=args.strategy, max_seqlen=row.max_seqlen,
        split_causal_backward=args.split,
        window_size=None if args.window is None else (args.window, 0),
        max_seqlen_violation=args.violation)
  if args.pass_name == "fwd":
    return jax.jit(attn), (q, k, v)
  loss = lambda q, k, v, w: jnp.sum(attn(q, k, v).astype(jnp.float32) * w)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, w)


def main(argv: Sequence[str] | None = None) -> None:
  """Profiles one step and prints the tables."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--strategy", default="no_load_balance",
                 choices=STRATEGIES)
  p.add_argument("--dist", default="short_128_1k", choices=DISTS)
  p.add_argument("--tokens", type=int, default=65536)
  p.add_argument("--cp", type=int, default=2)
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--pass", dest="pass_name", default="fwd_bwd",
                 choices=PASSES)
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--device-plane", default=profiling.DEVICE_PLANE)
  p.add_argument("--line-filter", default=profiling.KERNEL_LINES,
                 help="count the plane's lines whose name contains this "
                      "(lower case)")
  p.add_argument("--host-top", type=int, default=0,
                 help="also print this many host events by total time")
  p.add_argument("--gaps", type=int, default=0,
                 help="also print the device's idle time per step and this "
                      "many (kernel before, kernel after) pairs by the idle "
                      "time between them")
  p.add_argument("--sequence", action="store_true",
                 help="also print one step's kernels in time order")
  p.add_argument("--split", choices=("auto", "on", "off"), default="auto",
                 help="split_causal_backward (auto: the backend's default)")
  p.add_argument("--window", type=int, default=None,
                 help="causal sliding window (LEFT, 0)")
  p.add_argument("--max-seqlen-violation", dest="violation",
                 choices=VIOLATIONS, default=VIOLATIONS[0],
                 help="the layout's guard of the max_seqlen bound")
  args = p.parse_args(argv)
  args.split = {"auto": None, "on": True, "off": False}[args.split]
  step, inputs = build_step(args)
  for _ in range(3):
    jax.block_until_ready(step(*inputs))
  t0 = time.perf_counter()
  for _ in range(args.iters):
    jax.block_until_ready(step(*inputs))
  wall = (time.perf_counter() - t0) / args.iters * 1e3
  t0 = time.perf_counter()   # dispatched back to back (a training loop)
  jax.block_until_ready([step(*inputs) for _ in range(4 * args.iters)])
  wall_pipelined = (time.perf_counter() - t0) / (4 * args.iters) * 1e3
  run = lambda n: jax.block_until_ready([step(*inputs) for _ in range(n)])
  data = profiling.load_trace(profiling.trace_steps(run, args.iters))
  if data is None:
    raise SystemExit("the trace holds no .xplane.pb")
  plane = profiling.device_plane(data, args.device_plane)
  if plane is None:
    raise SystemExit("planes: " + ", ".join(p.name for p in data.planes))
  events = profiling.kernel_events(plane, args.line_filter)
  if not events:
    raise SystemExit(f"no {args.line_filter!r} lines in {plane.name}; "
                     "lines: " + ", ".join(line.name for line in plane.lines))
  totals, counts = profiling.kernel_totals(events)
  busy = sum(totals.values()) / args.iters
  print(f"{args.strategy} {args.dist} T={args.tokens} cp={args.cp} "
        f"{args.pass_name}: wall {wall:.3f} ms/step (pipelined "
        f"{wall_pipelined:.3f}), {plane.name} kernels "
        f"{busy:.3f} ms/step, {sum(counts.values()) / args.iters:.0f} "
        f"launches/step")
  print(f"{'ms/step':>9} {'launches':>8}  kernel")
  _print_top(totals, counts, args.iters, args.top)
  if args.sequence:
    print(f"one step in time order ({plane.name}): start ms, ms, stream, "
          "kernel")
    for start, dur, line, kname in profiling.one_step(events, args.iters):
      print(f"{start:8.4f} {dur:8.4f}  {line[-12:]:>12}  {kname[:90]}")
  if args.gaps:
    profiling.print_idle(profiling.idle_gaps(
        [(s, d, n) for s, d, _, n in events], args.iters, args.gaps))
  if args.host_top:
    print(f"host events (ms/step, count/step), top {args.host_top}:")
    _print_top(*profiling.kernel_totals(profiling.host_events(data)),
               args.iters, args.host_top)


def _print_top(totals, counts, iters: int, top: int) -> None:
  """The ``top`` names by total time: ms and count per step."""
  for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
    print(f"{ms / iters:9.4f} {counts[name] / iters:8.1f}  {name[:110]}")


if __name__ == "__main__":
  main()
