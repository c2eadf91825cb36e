"""Shared pytest setup.

* Eight virtual CPU devices for the CP meshes: XLA_FLAGS must be set before
  JAX initialises, hence at conftest import time. The flag is added to an
  XLA_FLAGS that lacks it (one that sets its own device count keeps it).
* ``gpu`` tests skip cleanly where no CUDA GPU is visible. Where one is,
  every test process (each xdist worker, and the subprocesses some tests
  start) shares it: JAX's preallocation of 75 % of the GPU per process is
  turned off (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, unless set), so
  ``pytest -n N`` runs N processes on one GPU, each taking what it uses.
* ``requires_devices(n, platform=None)`` tests skip where fewer devices
  exist (``tests/_devices.py``).
* ``record_error``: tests report their relative errors; the largest per
  dtype is printed at the end of the run.
* ``record_run_to_run``: tests report how far two runs of one program
  differ (tests/gpu/test_deterministic_cudnn.py); printed at the end.
"""

import os

_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _FLAGS:
  _FLAGS = f"{_FLAGS} --xla_force_host_platform_device_count=8".strip()
os.environ["XLA_FLAGS"] = _FLAGS
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  # Test programs are small: LLVM's -O0 roughly halves XLA:CPU compile time,
  # which dominates the suite on 2 cores (tests check results, not speed).
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Set before JAX initialises, like XLA_FLAGS; a value the caller set wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import pytest  # noqa: E402

from tests import _devices  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "requires_devices(n, platform=None): skipped where fewer "
      "than n devices of the platform (None: JAX's default) exist")
  config.addinivalue_line(
      "markers", "sweep(fast): a sweep of cases; the default tier runs "
      "`fast` of them, spread over the sweep, the slow tier the rest")


def sampled(count: int, fast: int) -> set[int]:
  """The indices of the ``fast`` cases of a sweep of ``count`` that the
  default tier runs: evenly spread, first and last included."""
  if fast >= count:
    return set(range(count))
  if fast <= 1:
    return {0}
  return {round(i * (count - 1) / (fast - 1)) for i in range(fast)}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  # Before `-m` deselects: the cases of a sweep past its sample are slow.
  sweeps = {}
  for item in items:
    mark = item.get_closest_marker("sweep")
    if mark is not None:
      key = (item.path, getattr(item, "originalname", item.name))
      sweeps.setdefault(key, (mark, []))[1].append(item)
  for mark, cases in sweeps.values():
    keep = sampled(len(cases), int(mark.kwargs.get("fast", mark.args[0]
                                                   if mark.args else 1)))
    for i, item in enumerate(cases):
      if i not in keep:
        item.add_marker(pytest.mark.slow)
  _skip_unavailable(items)


def _skip_unavailable(items):
  try:
    has_gpu = jax.default_backend() == "gpu"
  except RuntimeError:
    has_gpu = False
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip_gpu)
    mark = item.get_closest_marker("requires_devices")
    if mark is not None:
      reason = _devices.skip_reason(*mark.args, **mark.kwargs)
      if reason is not None:
        item.add_marker(pytest.mark.skip(reason=reason))


_LARGEST_ERRORS = {}


@pytest.fixture
def record_error():
  """Records relative errors; the largest per dtype is printed at the end."""
  def record(dtype, what, err):
    key = (jax.numpy.dtype(dtype).name, what)
    _LARGEST_ERRORS[key] = max(err, _LARGEST_ERRORS.get(key, 0.0))
  return record


_RUN_TO_RUN = "run_to_run"


@pytest.fixture
def record_run_to_run(request):
  """Records a JSON-able dict of two runs' differences under the test's
  id, as a user property of its report (so it also comes back from
  pytest-xdist's workers and lands in JUnit XML); every one is printed at
  the end."""
  def record(result: dict):
    request.node.user_properties.append((_RUN_TO_RUN, result))
  return record


def pytest_terminal_summary(terminalreporter):
  found = sorted(
      (report.nodeid, value)
      for reports in terminalreporter.stats.values() for report in reports
      if getattr(report, "when", None) == "call"
      for name, value in getattr(report, "user_properties", ())
      if name == _RUN_TO_RUN)
  if found:
    terminalreporter.section("run-to-run differences (two runs, one program)")
    for nodeid, result in found:
      terminalreporter.write_line(f"{nodeid}: {result}")
  if not _LARGEST_ERRORS:
    return
  terminalreporter.section("largest relative errors vs the reference")
  for (dtype, what), err in sorted(_LARGEST_ERRORS.items()):
    terminalreporter.write_line(f"{dtype:9s} {what:4s} {err:.3e}")
