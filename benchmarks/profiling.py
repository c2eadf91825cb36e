"""What the device ran: kernels from a JAX profiler trace, collectives from
compiled program text.

* Traces: :func:`trace_steps` records steps under ``jax.profiler.trace``,
  :func:`load_trace` reads the XSpace (``*.xplane.pb``) with
  ``jax.profiler.ProfileData``; :func:`device_plane` and
  :func:`kernel_events` take one device's kernels out of it,
  :func:`host_events` the host's events. Planes, lines and events are read
  through their ``name``, ``lines``, ``events``, ``start_ns`` and
  ``duration_ns`` only.
* Kernels: :func:`kernel_totals` (time and launches per kernel),
  :func:`one_step` (one step in time order), :func:`kernel_group`,
  :func:`group_kernels` (per-group time, collectives split into exposed
  and overlapped) and :func:`idle_gaps` (the device's idle time, charged
  to the kernels around each gap); :func:`profile` does it all for a
  program.
* Program text: :func:`hlo_collectives` (compiled HLO) and
  :func:`stablehlo_collectives` (lowered StableHLO).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

DEVICE_PLANE = "/device:GPU:0"
# Kernels are the events of a device plane's lines whose (lower-cased) name
# holds this: the GPU's streams.
KERNEL_LINES = "stream"

# A kernel event: (start ns, duration ns, name).
Event = tuple[int, int, str]


# ----------------------------------------------------------------- traces


def trace_steps(run: Callable[[int], Any], steps: int,
                prefix: str = "jax_cp_profile_") -> str:
  """Runs ``run(steps)`` under ``jax.profiler.trace`` (after one untraced
  ``run(1)``) and returns the trace directory."""
  import jax  # pylint: disable=import-outside-toplevel
  trace_dir = tempfile.mkdtemp(prefix=prefix)
  run(1)
  with jax.profiler.trace(trace_dir):
    run(steps)
  return trace_dir


def load_trace(trace_dir: str):
  """The ``jax.profiler.ProfileData`` of a trace directory, or None
  without an ``.xplane.pb`` file in it."""
  import jax  # pylint: disable=import-outside-toplevel
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  return jax.profiler.ProfileData.from_file(paths[0]) if paths else None


def device_plane(data, prefix: str = DEVICE_PLANE):
  """The first plane (by name) whose name starts with ``prefix``, or
  None."""
  planes = [p for p in data.planes if p.name.startswith(prefix)]
  return min(planes, key=lambda p: p.name) if planes else None


def kernel_events(plane, line_filter: str = KERNEL_LINES
                  ) -> list[tuple[int, int, str, str]]:
  """``(start_ns, duration_ns, line name, kernel name)`` of the plane's
  lines whose lower-cased name holds ``line_filter``, in time order."""
  return sorted((ev.start_ns, ev.duration_ns, line.name, ev.name)
                for line in plane.lines if line_filter in line.name.lower()
                for ev in line.events)


def host_events(data) -> list[tuple[int, int, str, str]]:
  """The same for every line of the ``/host:`` planes (XLA thunks,
  custom-call handlers, ...)."""
  return sorted((ev.start_ns, ev.duration_ns, line.name, ev.name)
                for plane in data.planes if plane.name.startswith("/host:")
                for line in plane.lines for ev in line.events)


def kernel_totals(events) -> tuple[dict[str, float], collections.Counter]:
  """``(ms per name, launches per name)`` summed over ``events`` (as
  :func:`kernel_events` gives them)."""
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  for _, duration, _, name in events:
    totals[name] += duration / 1e6
    counts[name] += 1
  return dict(totals), counts


def one_step(events, steps: int) -> list[tuple[float, float, str, str]]:
  """One step of ``steps`` traced back to back, from the middle:
  ``(start offset ms, duration ms, line, name)`` in time order."""
  per_step = len(events) // steps
  chunk = events[per_step * (steps // 2):per_step * (steps // 2 + 1)]
  t0 = chunk[0][0] if chunk else 0
  return [((s - t0) / 1e6, d / 1e6, line, name) for s, d, line, name in chunk]


# ----------------------------------------------------------------- kernels


# Kernel groups, tried in this order on the lower-cased kernel name.
KERNEL_GROUPS: tuple[tuple[str, str], ...] = (
    ("collective", (r"nccl|all-?reduce|all-?gather|reduce-?scatter|"
                    r"collective|sendrecv")),
    ("attention", (r"sdpa|fmha|flash|attn|attention|cudnn|jax_cp|"
                   r"merge_rows")),
    ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|matmul|\bdot"),
    ("copy", r"memcpy|memset|copy|transpose|dynamic.update.slice"),
)


def kernel_group(name: str) -> str:
  """``attention``, ``matmul``, ``collective``, ``copy`` or
  ``elementwise`` (everything else: XLA's loop and reduction fusions)."""
  low = name.lower()
  for group, pattern in KERNEL_GROUPS:
    if re.search(pattern, low):
      return group
  return "elementwise"


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out: list[tuple[int, int]] = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], e))
    else:
      out.append((s, e))
  return out


def _covered(s: int, e: int, union: list[tuple[int, int]]) -> int:
  return sum(max(0, min(e, b) - max(s, a)) for a, b in union)


def idle_gaps(events: Sequence[Event], steps: int, top: int = 12) -> dict:
  """Where the device sits idle between its first and last kernel.

  ``events`` are ``(start_ns, duration_ns, name)`` of one device's kernels
  over ``steps`` steps dispatched back to back. Idle time is the span not
  covered by any kernel. Each gap is charged to the pair (last kernel to
  end before it, first kernel to start after it), so the same gap in every
  step adds up under one pair.

  Returns:
    ``{"idle_ms": per step, "span_ms": per step, "pairs": [...]}``, the
    ``top`` pairs by idle time, each ``{"before", "after", "ms"`` (per
    step), ``"count"`` (per step), ``"max_us"}``.
  """
  if not events:
    return {"idle_ms": 0.0, "span_ms": 0.0, "pairs": []}
  ends = sorted((s + d, n) for s, d, n in events)
  starts = sorted((s, n) for s, _, n in events)
  union = _union([(s, s + d) for s, d, _ in events])
  pairs = collections.defaultdict(lambda: [0, 0, 0])
  j = k = 0
  for (_, end), (start, _) in zip(union, union[1:]):
    while j + 1 < len(ends) and ends[j + 1][0] <= end:
      j += 1
    while k < len(starts) and starts[k][0] < start:
      k += 1
    key = (ends[j][1], starts[k][1])
    gap = start - end
    pairs[key][0] += gap
    pairs[key][1] += 1
    pairs[key][2] = max(pairs[key][2], gap)
  span = union[-1][1] - union[0][0]
  idle = span - sum(e - s for s, e in union)
  ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
  return {"idle_ms": idle / 1e6 / steps, "span_ms": span / 1e6 / steps,
          "pairs": [{"before": b[:120], "after": a[:120],
                     "ms": v[0] / 1e6 / steps, "count": v[1] / steps,
                     "max_us": v[2] / 1e3} for (b, a), v in ranked]}


def group_kernels(events: Sequence[Event], steps: int) -> dict:
  """Per-step milliseconds by group from kernel events ``(start_ns,
  duration_ns, name)`` of one device: collectives split into
  ``collective_exposed`` (no other kernel runs meanwhile) and
  ``collective_overlapped``; ``busy`` is the union of all kernels;
  ``idle`` is :func:`idle_gaps`; ``kernels`` every kernel, heaviest
  first."""
  groups = collections.defaultdict(float)
  per_kernel = collections.defaultdict(float)
  launches = collections.Counter()
  exposed = collections.defaultdict(float)
  compute = _union([(s, s + d) for s, d, n in events
                    if kernel_group(n) != "collective"])
  for s, d, name in events:
    g = kernel_group(name)
    per_kernel[name] += d
    launches[name] += 1
    if g == "collective":
      hidden = _covered(s, s + d, compute)
      groups["collective_overlapped"] += hidden
      groups["collective_exposed"] += d - hidden
      exposed[name] += d - hidden
    else:
      groups[g] += d
  busy = sum(e - s for s, e in _union([(s, s + d) for s, d, _ in events]))
  ms = lambda ns: ns / 1e6 / steps
  ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
  return {
      "groups_ms": {g: ms(v) for g, v in sorted(groups.items())},
      "busy_ms": ms(busy),
      "idle": idle_gaps(events, steps),
      # Per-step ms and launches per step (collectives: also the ms with
      # no other kernel running).
      "kernels": [dict({"name": n[:160], "group": kernel_group(n),
                        "ms": ms(v), "launches": launches[n] / steps},
                       **({"exposed_ms": ms(exposed[n])}
                          if n in exposed else {}))
                  for n, v in ranked]}


def print_idle(idle: dict, out=None) -> None:
  """Prints :func:`idle_gaps`' result, one pair a line."""
  out = out or sys.stdout
  print(f"  idle {idle['idle_ms']:.3f} of {idle['span_ms']:.3f} ms/step; "
        "gaps by (kernel before -> kernel after): ms/step, gaps/step, "
        "largest us", file=out)
  for g in idle["pairs"]:
    print(f"    {g['ms']:7.3f} {g['count']:5.1f} {g['max_us']:8.1f}  "
          f"{g['before'][:60]} -> {g['after'][:60]}", file=out)


def profile(run: Callable[[int], Any], steps: int,
            plane_prefix: str = DEVICE_PLANE) -> dict | None:
  """Traces ``steps`` steps of ``run`` (:func:`trace_steps`) and groups the
  kernels of the ``plane_prefix`` device (:func:`group_kernels`); None
  without such a plane (CPU)."""
  data = load_trace(trace_steps(run, steps, "jax_cp_step_profile_"))
  plane = data and device_plane(data, plane_prefix)
  if plane is None:
    return None
  return group_kernels([(s, d, n) for s, d, _, n in kernel_events(plane)],
                       steps)


# ----------------------------------------------------------------- programs


# One collective instruction of HLO text: its result shape (tuples hold
# ``/*index=N*/`` comments) and kind.
HLO_COLLECTIVE_RE = re.compile(
    r"= ((?:[^=\n]|/\*index=\d+\*/)*?) (all-gather|reduce-scatter|"
    r"all-reduce|all-to-all|collective-permute)(?:-start)?\(")
STABLEHLO_COLLECTIVE_RE = re.compile(
    r"stablehlo\.(all_gather|reduce_scatter|collective_permute|all_to_all|"
    r"all_reduce)")


def hlo_collectives(hlo_text: str) -> dict[str, list[str]]:
  """Collective kind -> the result shapes of its instructions (layouts
  and index comments dropped), from compiled HLO text."""
  out = collections.defaultdict(list)
  for m in HLO_COLLECTIVE_RE.finditer(hlo_text):
    shape = re.sub(r"\{[^}]*\}|/\*index=\d+\*/", "", m.group(1))
    out[m.group(2)].append(shape[:400])
  return dict(out)


def stablehlo_collectives(text: str) -> list[str]:
  """The kinds of collective in lowered StableHLO text, sorted."""
  return sorted(set(STABLEHLO_COLLECTIVE_RE.findall(text)))
