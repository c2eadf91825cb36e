"""Paired A/B timing of jitted programs on the host clock.

GPU clock and power drift moves separate stretches of a run by a few
percent, so two programs are never timed in separate stretches:
:func:`paired` times A and B in alternation, :data:`ORDER` per rep, and
forms each rep's ratio ``time(A) / time(B)`` from its eight timings (> 1:
B is faster). Drift linear or quadratic in time (a GPU that warms up
after a pause) adds as much to A's four timings as to B's and cancels
(``A B B A`` cancels only the linear part); each program is timed three
times right after the other and once after itself in every rep. The
spread of the per-rep ratios (their interquartile range) says how far
to trust their median.

Each timing is *steady*: blocks of ``n`` and ``2n`` calls dispatched back
to back, ``n`` making a block last about ``pipeline_ms``, their time over
their ``3n`` calls (:func:`steady`); a call of ``LONG_CALL_S`` or more is
timed as the faster of two synced calls. Every function alternates
between the given input sets (argument tuples) and takes the clock as
``clock`` (tests pass a fake one).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax

ArgSets = Sequence[tuple]
#: Seconds per synced call from which a program is timed by synced calls.
LONG_CALL_S = 1.0
#: One rep's order of timings (the Thue–Morse sequence's first eight).
ORDER = "ABBABAAB"


def block_seconds(fn: Callable, arg_sets: ArgSets, n: int,
                  clock: Callable[[], float] = time.perf_counter) -> float:
  """Seconds for ``n`` calls dispatched back to back, waited for once."""
  t0 = clock()
  jax.block_until_ready([fn(*arg_sets[i % len(arg_sets)])
                         for i in range(n)])
  return clock() - t0


def synced(fn: Callable, arg_sets: ArgSets, reps: int,
           clock: Callable[[], float] = time.perf_counter) -> list[float]:
  """Seconds of ``reps`` single calls, each waited for."""
  return [block_seconds(fn, arg_sets[i % len(arg_sets):], 1, clock)
          for i in range(reps)]


def steady(fn: Callable, arg_sets: ArgSets, depth: int,
           clock: Callable[[], float] = time.perf_counter) -> float:
  """Seconds per call: blocks of ``depth`` and ``2*depth`` calls, each
  timed twice and the faster kept (a host stall lands whole in one
  block), their sum over their ``3*depth`` calls. A block's fixed cost
  (its first launch and final wait) is spread over its calls, alike for
  similar programs. The slope ``(long - short) / depth`` would cancel
  that cost, but with a fraction ``s`` of independent jitter per block
  its error is ``sqrt(5) s``, the sum's ``sqrt(5) s / 3``."""
  short, long = [], []
  for _ in range(2):
    short.append(block_seconds(fn, arg_sets, depth, clock))
    long.append(block_seconds(fn, arg_sets, 2 * depth, clock))
  return (min(short) + min(long)) / (3 * depth)


def pipeline_depth(call_s: float, pipeline_ms: float) -> int:
  """Calls per block so that a block lasts about ``pipeline_ms`` (1..32)."""
  return int(min(32, max(1, round(pipeline_ms * 1e-3 / max(call_s, 1e-9)))))


@dataclasses.dataclass(frozen=True)
class PairedResult:
  """An A/B comparison: per-call seconds of A and of B (four per rep), the
  per-rep ratios (the sum of A's over the sum of B's) and the block depths
  (1: timed by synced calls)."""

  seconds_a: list[float]
  seconds_b: list[float]
  ratios: list[float]
  depth_a: int
  depth_b: int

  @property
  def ms_a(self) -> float:
    return 1e3 * statistics.median(self.seconds_a)

  @property
  def ms_b(self) -> float:
    return 1e3 * statistics.median(self.seconds_b)

  @property
  def ratio(self) -> float:
    """The median per-rep ratio: the speed-up of B over A."""
    return statistics.median(self.ratios)

  def quartiles(self) -> tuple[float, float]:
    """The first and third quartiles of the per-rep ratios."""
    if len(self.ratios) < 2:
      return self.ratios[0], self.ratios[0]
    q = statistics.quantiles(self.ratios, n=4, method="inclusive")
    return q[0], q[2]

  def fields(self) -> dict:
    """The JSON fields of a record: ms, ratios, quartiles, timings."""
    q1, q3 = self.quartiles()
    return dict(ms_a=self.ms_a, ms_b=self.ms_b, ratio=self.ratio,
                ratio_q1=q1, ratio_q3=q3, ratios=list(self.ratios),
                seconds_a=list(self.seconds_a),
                seconds_b=list(self.seconds_b),
                depth_a=self.depth_a, depth_b=self.depth_b)


def _timer(fn: Callable, arg_sets: ArgSets, pipeline_ms: float,
           clock: Callable[[], float]) -> tuple[Callable[[], float], int]:
  """A zero-argument timer of ``fn`` (seconds per call) and its depth."""
  call_s = statistics.median(synced(fn, arg_sets, 3, clock))
  if call_s >= LONG_CALL_S:
    return lambda: min(synced(fn, arg_sets, 2, clock)), 1
  depth = pipeline_depth(call_s, pipeline_ms)
  return lambda: steady(fn, arg_sets, depth, clock), depth


def paired(fn_a: Callable, args_a: ArgSets, fn_b: Callable, args_b: ArgSets,
           reps: int, warmup: int = 2, pipeline_ms: float = 40.0,
           on_rep: Callable[[int, float, float, float], None] | None = None,
           clock: Callable[[], float] = time.perf_counter) -> PairedResult:
  """A and B timed in :data:`ORDER` per rep after ``warmup`` calls of
  each. ``on_rep(i, seconds_a, seconds_b, ratio)`` is called after each
  rep (a run cut short has printed what it measured)."""
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  for _ in range(warmup):
    jax.block_until_ready(fn_a(*args_a[0]))
    jax.block_until_ready(fn_b(*args_b[0]))
  timers = dict(zip("AB", (_timer(fn_a, args_a, pipeline_ms, clock),
                           _timer(fn_b, args_b, pipeline_ms, clock))))
  sa, sb, ratios = [], [], []
  for i in range(reps):
    got = {"A": [], "B": []}
    for side in ORDER:
      got[side].append(timers[side][0]())
    sa += got["A"]
    sb += got["B"]
    ratios.append(sum(got["A"]) / sum(got["B"]))
    if on_rep is not None:
      on_rep(i, statistics.mean(got["A"]), statistics.mean(got["B"]),
             ratios[-1])
  return PairedResult(sa, sb, ratios, timers["A"][1], timers["B"][1])
