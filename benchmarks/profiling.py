"""Per-kernel device time of a program, from a JAX profiler trace.

:func:`profile` runs a program's steps under ``jax.profiler.trace``, reads
the trace (``jax.profiler.ProfileData``: planes, lines, events with
``name``, ``start_ns`` and ``duration_ns``), takes the kernels of the
first GPU's stream lines and returns :func:`breakdown`: milliseconds per
step by kernel group (attention, matmul, copy, elementwise, collectives
split into *exposed*, when no other kernel runs, and *overlapped*), the
busy time (union of all kernels), the idle time between the first and
last kernel, and the heaviest kernels. Without a GPU plane (CPU) it
returns None. ``bench_fused --profile`` and ``bench_step --profile`` use
it; :func:`print_breakdown` prints one.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

DEVICE_PLANE = "/device:GPU:0"
#: Kernel groups, tried in order on the lower-cased kernel name; the rest
#: is ``elementwise`` (XLA's loop and reduction fusions).
KERNEL_GROUPS = (
    ("collective", r"nccl|all-?reduce|all-?gather|reduce-?scatter|"
                   r"collective|sendrecv"),
    ("attention", r"sdpa|fmha|flash|attn|attention|cudnn|jax_cp|merge_rows"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|matmul|\bdot"),
    ("copy", r"memcpy|memset|copy|transpose|dynamic.update.slice"))

Event = tuple[int, int, str]   # start ns, duration ns, kernel name


def kernel_group(name: str) -> str:
  low = name.lower()
  return next((g for g, pattern in KERNEL_GROUPS if re.search(pattern, low)),
              "elementwise")


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for s, e in sorted(spans):
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], e))
    else:
      out.append((s, e))
  return out


def breakdown(events: Sequence[Event], steps: int, top: int = 12) -> dict:
  """Per-step milliseconds of one device's kernels over ``steps`` steps:
  ``groups_ms``, ``busy_ms``, ``idle_ms`` and the ``top`` heaviest
  ``kernels`` (name, group, ms and launches per step)."""
  ms = lambda ns: ns / 1e6 / steps
  compute = _union([(s, s + d) for s, d, n in events
                    if kernel_group(n) != "collective"])
  groups = collections.Counter()
  per_kernel = collections.Counter()
  launches = collections.Counter()
  for s, d, name in events:
    per_kernel[name] += d
    launches[name] += 1
    if kernel_group(name) != "collective":
      groups[kernel_group(name)] += d
      continue
    hidden = sum(max(0, min(s + d, b) - max(s, a)) for a, b in compute)
    groups["collective_overlapped"] += hidden
    groups["collective_exposed"] += d - hidden
  spans = _union([(s, s + d) for s, d, _ in events])
  busy = sum(e - s for s, e in spans)
  span = spans[-1][1] - spans[0][0] if spans else 0
  return {"groups_ms": {g: ms(v) for g, v in sorted(groups.items())},
          "busy_ms": ms(busy), "idle_ms": ms(span - busy),
          "kernels": [{"name": n[:160], "group": kernel_group(n),
                       "ms": ms(v), "launches": launches[n] / steps}
                      for n, v in per_kernel.most_common(top)]}


def device_events(trace_dir: str, plane_prefix: str = DEVICE_PLANE
                  ) -> list[Event] | None:
  """The kernels of the first plane named ``plane_prefix...`` of a trace
  directory (its stream lines), or None without one."""
  import jax  # pylint: disable=import-outside-toplevel
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  if not paths:
    return None
  data = jax.profiler.ProfileData.from_file(paths[0])
  planes = [p for p in data.planes if p.name.startswith(plane_prefix)]
  if not planes:
    return None
  plane = min(planes, key=lambda p: p.name)
  return sorted((ev.start_ns, ev.duration_ns, ev.name)
                for line in plane.lines if "stream" in line.name.lower()
                for ev in line.events)


def profile(run: Callable[[int], Any], steps: int,
            plane_prefix: str = DEVICE_PLANE) -> dict | None:
  """:func:`breakdown` of ``run(steps)`` (``run(n)`` runs ``n`` steps and
  waits), traced after one untraced ``run(1)``; None without a GPU."""
  import jax  # pylint: disable=import-outside-toplevel
  trace_dir = tempfile.mkdtemp(prefix="jax_cp_profile_")
  run(1)
  with jax.profiler.trace(trace_dir):
    run(steps)
  events = device_events(trace_dir, plane_prefix)
  return None if not events else breakdown(events, steps)


def print_breakdown(name: str, prof: dict | None) -> None:
  """Prints a :func:`breakdown`: groups, then the heaviest kernels."""
  if prof is None:
    print(f"profile {name}: no GPU kernels in the trace", flush=True)
    return
  groups = ", ".join(f"{g} {v:.3f}" for g, v in prof["groups_ms"].items())
  print(f"profile {name} (ms per step): busy {prof['busy_ms']:.3f}, idle "
        f"{prof['idle_ms']:.3f}; {groups}", flush=True)
  for k in prof["kernels"]:
    print(f"  {k['ms']:9.3f} ms {k['launches']:6.1f}x  {k['group']:<12} "
          f"{k['name'][:100]}", flush=True)
