"""tests/_devices.py and its conftest mark: tests that build meshes skip,
with a counted reason, where too few devices exist; the conftest adds its
eight CPU devices to an XLA_FLAGS that lacks them."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from tests import _devices
from tests.gpu import skip_summary

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_devices_returns_the_first_n_of_the_platform():
  cpus = jax.devices("cpu")
  assert _devices.devices(2, "cpu") == cpus[:2]
  assert _devices.skip_reason(len(cpus), "cpu") is None


def test_devices_skips_with_a_reason_naming_the_count():
  have = len(jax.devices("cpu"))
  with pytest.raises(pytest.skip.Exception) as info:
    _devices.devices(have + 1, "cpu")
  assert str(info.value.msg) == (f"{_devices.SKIP_PREFIX} needs {have + 1} "
                                 f"cpu devices, {have} present")
  # A platform this machine lacks has no devices: a skip, not an error.
  assert _devices.skip_reason(1, "no_such_platform").endswith(", 0 present")


SUBTEST = '''
import jax
import pytest
from tests._devices import devices, requires_devices

def test_conftest_added_eight_cpu_devices():
  assert len(jax.devices("cpu")) == 8

@requires_devices(2, platform="cpu")
def test_runs():
  pass

@requires_devices(1000, platform="cpu")
def test_skips():
  raise AssertionError("ran with too few devices")

@pytest.mark.parametrize("n", [4, 16])
def test_needs_n(n):
  devices(n, "cpu")

def test_other_skip():
  pytest.skip("something else")
'''


def test_mark_skips_and_conftest_appends_its_device_count(tmp_path):
  """In a fresh pytest with an XLA_FLAGS of its own (without a device
  count), the conftest still gives eight CPU devices; the mark and
  ``devices`` skip the tests needing more with the counted reason, and
  tests/gpu/skip_summary.py counts those skips apart from the others."""
  path = tmp_path / "test_sub.py"
  path.write_text(SUBTEST)
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 [str(ROOT), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest",
       "-p", "no:cacheprovider", "-n", "0", "--junitxml",
       str(tmp_path / "junit.xml"), str(path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out
  assert "3 passed, 3 skipped" in out, out
  assert (f"{_devices.SKIP_PREFIX} needs 1000 cpu devices, 8 present"
          in out), out
  summary = skip_summary.summarize("sub", str(tmp_path / "junit.xml"))
  assert summary == ("sub: 3 passed, 0 failed, 0 errors, 3 skipped (2 for "
                     "devices: 1 x 16 cpu, 1 x 1000 cpu; 1 other)")
  assert skip_summary.summarize("none", str(tmp_path / "no.xml")).startswith(
      "none: no report")
