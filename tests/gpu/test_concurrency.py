"""GPU tests: concurrent cuDNN calls on one GPU. Two threads, and two
processes at once (each with two threads), run jitted forward + backward of
different shapes, so graph-cache misses (graph builds) happen at the same
time; every result equals the serial one (up to the backward's
non-deterministic accumulation order) and the xla backend's. The work runs
in fresh subprocesses (tests/gpu/fault_worker.py) so the cache starts
empty."""

import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

from tests.gpu.test_fault_injection import result_of, run_worker


def check(r):
  assert not r["errors"], r["errors"]
  assert r["worst_vs_serial"] < 1e-2, r
  assert r["worst_vs_xla"] < 2e-2, r
  # Two shapes per thread, forward and backward graphs each.
  assert r["cache"]["entries"] == 8, r["cache"]


def test_two_threads():
  check(result_of(run_worker("concurrent", "0")))


def test_two_processes():
  procs = [run_worker("concurrent", str(tag)) for tag in (1, 2)]
  for p in procs:
    check(result_of(p))
