"""Where the time of one CP attention step goes: a per-kernel breakdown
from the JAX profiler, for one configuration.

    python -m benchmarks.profile_step --strategy no_load_balance \\
        --dist short_128_1k --tokens 65536 --cp 2 --pass fwd_bwd

Runs the jitted step a few times under ``jax.profiler.trace``, reads the
XSpace with ``jax.profiler.ProfileData`` and prints, for the first GPU, the
device time per iteration of each kernel (summed over its launches), the
number of launches, and the busy time against the wall time of a step;
``--gaps N`` adds where the device sits idle between kernels.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from benchmarks.bench_step import idle_gaps, print_idle
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


def load_profile(trace_dir: str):
  """The ``jax.profiler.ProfileData`` of a trace directory."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not paths:
    raise SystemExit(f"no .xplane.pb under {trace_dir}")
  return jax.profiler.ProfileData.from_file(paths[0])


def device_plane(data, device_prefix: str):
  """The first plane (by name) whose name starts with ``device_prefix``."""
  planes = [p for p in data.planes if p.name.startswith(device_prefix)]
  if not planes:
    raise SystemExit("planes: " + ", ".join(p.name for p in data.planes))
  return min(planes, key=lambda p: p.name)


def kernel_table(data, device_prefix: str, line_filter: str = "stream"):
  """``(plane name, ms per kernel name, launches per kernel name)`` summed
  over the plane's lines whose name contains ``line_filter``."""
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  plane = device_plane(data, device_prefix)
  for line in plane.lines:
    if line_filter not in line.name.lower():
      continue
    for ev in line.events:
      totals[ev.name] += ev.duration_ns / 1e6
      counts[ev.name] += 1
  if not totals:
    raise SystemExit(f"no {line_filter!r} lines in {plane.name}; lines: "
                     + ", ".join(line.name for line in plane.lines))
  return plane.name, totals, counts


def kernel_sequence(data, iters: int, device_prefix: str,
                    line_filter: str = "stream"):
  """One step's kernels in time order, from the middle of the traced
  steps: (start offset ms, duration ms, stream, name)."""
  plane = device_plane(data, device_prefix)
  events = sorted((ev.start_ns, ev.duration_ns, line.name, ev.name)
                  for line in plane.lines
                  if line_filter in line.name.lower() for ev in line.events)
  per_step = len(events) // iters
  chunk = events[per_step * (iters // 2):per_step * (iters // 2 + 1)]
  t0 = chunk[0][0] if chunk else 0
  return [((s - t0) / 1e6, d / 1e6, line, name) for s, d, line, name in chunk]


def host_table(data):
  """Host-side events (XLA thunks, custom-call handlers, ...) by total
  time: whether the host keeps ahead of the GPU."""
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  for plane in data.planes:
    if not plane.name.startswith("/host:"):
      continue
    for line in plane.lines:
      for ev in line.events:
        totals[ev.name] += ev.duration_ns / 1e6
        counts[ev.name] += 1
  return totals, counts


def main(argv: Sequence[str] | None = None) -> None:
  """Profiles one step and prints the tables."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--strategy", default="no_load_balance")
  p.add_argument("--dist", default="short_128_1k")
  p.add_argument("--tokens", type=int, default=65536)
  p.add_argument("--cp", type=int, default=2)
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--pass", dest="pass_name", default="fwd_bwd",
                 choices=("fwd", "fwd_bwd"))
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--device-plane", default="/device:GPU:0")
  p.add_argument("--line-filter", default="stream",
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
                 choices=("fallback", "checked_on_host"), default="fallback",
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
  trace_dir = tempfile.mkdtemp(prefix="jax_cp_profile_")
  with jax.profiler.trace(trace_dir):   # back to back, as timed
    jax.block_until_ready([step(*inputs) for _ in range(args.iters)])
  data = load_profile(trace_dir)
  name, totals, counts = kernel_table(data, args.device_plane,
                                      args.line_filter)
  busy = sum(totals.values()) / args.iters
  print(f"{args.strategy} {args.dist} T={args.tokens} cp={args.cp} "
        f"{args.pass_name}: wall {wall:.3f} ms/step (pipelined "
        f"{wall_pipelined:.3f}), {name} kernels "
        f"{busy:.3f} ms/step, {sum(counts.values()) / args.iters:.0f} "
        f"launches/step")
  print(f"{'ms/step':>9} {'launches':>8}  kernel")
  for kname, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"{ms / args.iters:9.4f} {counts[kname] / args.iters:8.1f}  "
          f"{kname[:110]}")
  if args.sequence:
    print(f"one step in time order ({name}): start ms, ms, stream, kernel")
    for start, dur, line, kname in kernel_sequence(
        data, args.iters, args.device_plane, args.line_filter):
      print(f"{start:8.4f} {dur:8.4f}  {line[-12:]:>12}  {kname[:90]}")
  if args.gaps:
    plane = device_plane(data, args.device_plane)
    events = [(ev.start_ns, ev.duration_ns, ev.name) for line in plane.lines
              if args.line_filter in line.name.lower() for ev in line.events]
    print_idle(idle_gaps(events, args.iters, args.gaps))
  if args.host_top:
    htot, hcnt = host_table(data)
    print(f"host events (ms/step, count/step), top {args.host_top}:")
    for hname, ms in sorted(htot.items(), key=lambda kv: -kv[1])[
        :args.host_top]:
      print(f"{ms / args.iters:9.4f} {hcnt[hname] / args.iters:8.1f}  "
            f"{hname[:110]}")


if __name__ == "__main__":
  main()
