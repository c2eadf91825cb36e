"""Host-clock timing of jitted programs.

JAX dispatches asynchronously, so a program can be timed three ways; every
function here alternates between the given input sets (a list of argument
tuples) so that no two consecutive calls see the same buffers:

* *synced*: one call, waited for (``jax.block_until_ready``). Adds the
  host's launch and wait latency, which a training loop does not pay.
* *pipelined*: a block of ``depth`` calls dispatched back to back and waited
  for once, per call. ``depth`` (:func:`pipeline_depth`) makes a block last
  about ``pipeline_ms``; the block still pays one fill and drain of the
  pipeline.
* *steady*: ``(t(2*depth) - t(depth)) / depth``, the slope of a block's time
  over its length: the time per call once the pipeline is full (fill and
  drain cancel), what one layer costs inside a step of many layers.

API:

* ``steady(fn, arg_sets, depth=None, pipeline_ms=40.0) -> float``: seconds
  per call, one pair of blocks (``depth`` measured when None).
* ``synced(fn, arg_sets, reps, warmup=0) -> list[float]``: seconds of
  single calls, each waited for.
* ``measure(fn, arg_sets, warmup, reps, pipeline_ms=40.0) -> Timings``: all
  three, ``reps`` each (what ``bench_cp`` records).
* ``paired(fn_a, args_a, fn_b, args_b, reps, warmup=2, pipeline_ms=40.0,
  on_rep=None) -> PairedResult``: an A/B comparison. Clock and power drift
  of the GPU moves separate stretches of a run by a few percent, so A and B
  are timed in alternation, ``A B B A`` per rep (steady times), and each rep
  gives the ratio ``time(A) / time(B)`` (the speed-up of B over A) from
  adjacent timings: drift cancels, and the spread of the per-rep ratios says
  how far to trust their median. ``PairedResult`` holds the per-rep times
  and ratios with ``ms_a``, ``ms_b`` (medians), ``ratio_median``,
  ``ratio_q1``/``ratio_q3`` (quartiles), ``ratio_min``/``ratio_max``. A
  program whose synced call takes ``LONG_CALL_S`` or more (a training step
  of a long row) is timed as the faster of two synced calls instead of a
  steady pair of blocks: launch and wait are then under a thousandth of the
  call, and a rep costs 8 calls instead of 24. ``on_rep`` sees each rep as
  it ends (a run cut short still printed what it measured).
* ``pipeline_depth(call_s, pipeline_ms)`` and ``block_seconds(fn, arg_sets,
  n)``: the building blocks.

Example::

  from benchmarks import timing
  r = timing.paired(step_cp1, args_cp1, step_cp2, args_cp2, reps=10)
  print(f"{r.ratio_median:.3f}x (IQR {r.ratio_q1:.3f}-{r.ratio_q3:.3f})")
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax

ArgSets = Sequence[tuple]


def pipeline_depth(call_s: float, pipeline_ms: float = 40.0) -> int:
  """Calls per block so that a block lasts about ``pipeline_ms`` (1..32)."""
  return int(min(32, max(1, round(pipeline_ms * 1e-3 / call_s))))


def block_seconds(fn: Callable, arg_sets: ArgSets, n: int) -> float:
  """Seconds for ``n`` calls dispatched back to back (alternating input
  sets) and waited for once."""
  t0 = time.perf_counter()
  outs = [fn(*arg_sets[j % len(arg_sets)]) for j in range(n)]
  jax.block_until_ready(outs)
  return time.perf_counter() - t0


def synced(fn: Callable, arg_sets: ArgSets, reps: int,
           warmup: int = 0) -> list[float]:
  """Seconds of ``reps`` single calls, each waited for, after ``warmup``
  untimed ones (both alternate input sets from the first)."""
  n = len(arg_sets)
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % n]))
  times = []
  for i in range(reps):
    a = arg_sets[i % n]
    t0 = time.perf_counter()
    out = fn(*a)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
    del out
  return times


#: Seconds per synced call from which :func:`paired` times single synced
#: calls instead of steady blocks.
LONG_CALL_S = 1.0


def _synced_seconds(fn: Callable, arg_sets: ArgSets) -> float:
  """The median of three synced calls, in seconds."""
  return statistics.median(synced(fn, arg_sets, reps=3))


def _synced_depth(fn: Callable, arg_sets: ArgSets,
                  pipeline_ms: float) -> int:
  """:func:`pipeline_depth` from the median of three synced calls."""
  return pipeline_depth(_synced_seconds(fn, arg_sets), pipeline_ms)


def steady(fn: Callable, arg_sets: ArgSets, depth: int | None = None,
           pipeline_ms: float = 40.0) -> float:
  """Seconds per call once the pipeline is full: the difference of blocks
  of ``2*depth`` and ``depth`` calls over ``depth`` (``depth`` from three
  synced calls when None). Each block length is timed twice, alternately,
  and the faster of the two kept: a host stall in one block (a garbage
  collection, another process) would otherwise land in the difference,
  whole, and can even make it negative."""
  if depth is None:
    depth = _synced_depth(fn, arg_sets, pipeline_ms)
  t1, t2 = [], []
  for _ in range(2):
    t1.append(block_seconds(fn, arg_sets, depth))
    t2.append(block_seconds(fn, arg_sets, 2 * depth))
  return (min(t2) - min(t1)) / depth


@dataclasses.dataclass(frozen=True)
class Timings:
  """Timings of one program, in seconds.

  Attributes:
    first_s: the first call (compiles nothing; builds backend state such as
      cuDNN graphs).
    synced: ``reps`` single calls, each waited for.
    pipelined: per call, ``reps`` blocks of ``depth`` calls.
    steady: per call, ``reps`` pairs of blocks (see :func:`steady`).
    depth: calls per block.
  """

  first_s: float
  synced: list[float]
  pipelined: list[float]
  steady: list[float]
  depth: int


def measure(fn: Callable, arg_sets: ArgSets, warmup: int, reps: int,
            pipeline_ms: float = 40.0) -> Timings:
  """Synced, pipelined and steady timings of ``fn`` after ``warmup`` calls
  (the first of which is timed as ``first_s``); ``depth`` comes from the
  median synced call."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  first = time.perf_counter() - t0
  for i in range(1, warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  synced_ = synced(fn, arg_sets, reps)
  depth = pipeline_depth(statistics.median(synced_), pipeline_ms)
  pipelined, steady_ = [], []
  for _ in range(reps):
    t1 = block_seconds(fn, arg_sets, depth)
    t2 = block_seconds(fn, arg_sets, 2 * depth)
    pipelined.append(t1 / depth)
    steady_.append((t2 - t1) / depth)
  return Timings(first, synced_, pipelined, steady_, depth)


@dataclasses.dataclass(frozen=True)
class PairedResult:
  """An A/B comparison from :func:`paired`.

  Attributes:
    seconds_a: seconds per call of A (steady, or synced for long calls),
      two per rep.
    seconds_b: the same for B.
    ratios: per rep, ``(a1 + a2) / (b1 + b2)``: > 1 when B is faster.
    depth_a: calls per block of A (1 for long calls).
    depth_b: calls per block of B.
  """

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
  def ratio_median(self) -> float:
    return statistics.median(self.ratios)

  def _quartiles(self) -> list[float]:
    if len(self.ratios) > 1:
      return statistics.quantiles(self.ratios, n=4)
    return self.ratios * 3

  @property
  def ratio_q1(self) -> float:
    return self._quartiles()[0]

  @property
  def ratio_q3(self) -> float:
    return self._quartiles()[2]

  @property
  def ratio_min(self) -> float:
    return min(self.ratios)

  @property
  def ratio_max(self) -> float:
    return max(self.ratios)


def _per_call_timer(fn: Callable, arg_sets: ArgSets, pipeline_ms: float
                    ) -> tuple[Callable[[], float], int]:
  """A zero-argument timer of ``fn`` in seconds per call, and its block
  depth: :func:`steady` blocks, or the faster of two synced calls when a
  call takes ``LONG_CALL_S`` or more (depth 1)."""
  call_s = _synced_seconds(fn, arg_sets)
  if call_s >= LONG_CALL_S:
    return lambda: min(synced(fn, arg_sets, reps=2)), 1
  depth = pipeline_depth(call_s, pipeline_ms)
  return lambda: steady(fn, arg_sets, depth), depth


def paired(fn_a: Callable, args_a: ArgSets, fn_b: Callable, args_b: ArgSets,
           reps: int, warmup: int = 2, pipeline_ms: float = 40.0,
           on_rep: Callable[[int, float, float, float], None] | None = None
           ) -> PairedResult:
  """A and B timed in alternation, ``A B B A`` per rep (steady timings, or
  synced ones for calls of ``LONG_CALL_S`` or more), after ``warmup``
  calls of each; per-rep ratios ``time(A) / time(B)``. ``on_rep(i,
  seconds_a, seconds_b, ratio)``, when given, is called after rep ``i``
  with that rep's mean seconds per call of A and of B."""
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  for _ in range(warmup):
    jax.block_until_ready(fn_a(*args_a[0]))
    jax.block_until_ready(fn_b(*args_b[0]))
  time_a, da = _per_call_timer(fn_a, args_a, pipeline_ms)
  time_b, db = _per_call_timer(fn_b, args_b, pipeline_ms)
  ta, tb, ratios = [], [], []
  for i in range(reps):
    a1 = time_a()
    b1 = time_b()
    b2 = time_b()
    a2 = time_a()
    ta += [a1, a2]
    tb += [b1, b2]
    ratios.append((a1 + a2) / (b1 + b2))
    if on_rep is not None:
      on_rep(i, (a1 + a2) / 2, (b1 + b2) / 2, ratios[-1])
  return PairedResult(ta, tb, ratios, da, db)
