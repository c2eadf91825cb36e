"""GPU tests: every fault point of the cuDNN extension (csrc/
fault_injection.h), injected in a subprocess (tests/gpu/fault_worker.py).

For each point: 100 faulty forward calls each raise a Python exception that
names the failing operation and its CUDA/cuDNN status; the process does not
abort; the failures leave no GPU memory and no graph-cache entry behind; and
once the fault is disarmed the next forward + backward matches the xla
backend (a failed build is never cached half-built).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

# point -> (operation named in the message, status named in the message).
EXPECTED = {
    "handle": ("cudnnCreate", "CUDNN_STATUS_INTERNAL_ERROR"),
    "graph_validate": ("validate failed", "CUDNN_STATUS_"),
    "graph_build_operation_graph": ("build_operation_graph failed",
                                    "CUDNN_STATUS_"),
    "graph_create_execution_plans": ("create_execution_plans failed",
                                     "CUDNN_STATUS_"),
    "graph_check_support": ("check_support failed", "CUDNN_STATUS_"),
    "graph_build_plans": ("build_plans failed", "CUDNN_STATUS_"),
    "workspace_size": ("get_workspace_size failed", "CUDNN_STATUS_"),
    "workspace_alloc": ("workspace allocation", "RESOURCE_EXHAUSTED"),
    "kernel_load": ("cudaLibraryLoadData", "cudaErrorMemoryAllocation"),
    "kernel_launch": ("kernel launch failed", "cudaErrorLaunchOutOfResources"),
    "set_stream": ("cudnnSetStream failed", "CUDNN_STATUS_"),
    "execute": ("execute failed", "CUDNN_STATUS_EXECUTION_FAILED"),
}
# Points after a successful build: the faulty shape's forward graph is built
# and cached once (a whole, valid graph).
AFTER_BUILD = {"workspace_alloc", "set_stream", "execute"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def run_worker(*args, env_extra=None, timeout=900):
  env = dict(os.environ)
  env.pop("JAX_CP_FAULT_INJECT", None)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  env.update(env_extra or {})
  return subprocess.Popen(
      [sys.executable, "-m", "tests.gpu.fault_worker", *args], cwd=ROOT,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc, timeout=900):
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, (
      f"worker exited with {proc.returncode}\nstdout:\n{out[-4000:]}\n"
      f"stderr:\n{err[-8000:]}")
  lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert lines, (f"no RESULT line\nstdout:\n{out[-4000:]}\n"
                 f"stderr:\n{err[-8000:]}")
  return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("point", sorted(EXPECTED))
def test_fault_point(point):
  r = result_of(run_worker("fault", point,
                           env_extra={"JAX_CP_FAULT_INJECT": point}))
  operation, status = EXPECTED[point]
  assert r["armed"] == -1  # read from the environment variable
  assert r["raised"] == r["repeats"] == 100, r["messages"][:2]
  assert r["injected"] >= 1
  for m in r["messages"]:
    assert operation in m and status in m, m
  if point == "handle":
    # The first failure is remembered: some calls never reached cudnnCreate.
    assert r["injected"] < r["repeats"]
    assert any("failed earlier on device" in m for m in r["messages"])
  else:
    assert r["injected"] == r["repeats"]
    assert all("(injected)" in m for m in r["messages"])
  # No leak: the failures hold no GPU memory (measured after the first
  # faulty call and after the last).
  if r["mem_after_first"] >= 0:
    assert r["mem_after_all"] - r["mem_after_first"] < 8 << 20, r
  # No half-built cache entry: failed builds are not cached; a failure after
  # the build leaves exactly the one (whole) forward graph.
  grown = r["cache_after_faults"]["entries"] - r["cache_before"]["entries"]
  assert grown == (1 if point in AFTER_BUILD else 0), r
  assert (r["cache_after_faults"]["builds"] - r["cache_before"]["builds"]
          == grown)
  # The next clean forward + backward is right.
  assert r["worst_vs_xla"] < 2e-2, r["worst_vs_xla"]
  assert (r["cache_after_clean"]["entries"]
          - r["cache_after_faults"]["entries"]) == (1 if grown else 2)
