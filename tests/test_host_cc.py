"""Host-only C++ tests of the cuDNN extension (tests/cc/host_tests.cc), on a
CPU-only machine: the fault injection spec parser and switch, the
per-device memory of failed cudnnCreate calls against stub CUDA/cuDNN entry
points, and the decoding of the SDPA handlers' attributes into their
structs, built with AddressSanitizer where the compiler has it.

CMake configures the project in a temporary folder with
``JAX_CP_BUILD_HOST_TESTS=ON`` and builds only the ``jax_cp_host_tests``
target (not the extension). Skipped when cmake, a C++ compiler or the
headers the extension needs (CUDA, cuDNN, XLA FFI) are missing.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests import _toolchain

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _asan_available() -> bool:
  return _toolchain.asan_runtime(_toolchain.cxx()) is not None


@pytest.fixture(scope="module")
def host_tests(tmp_path_factory) -> pathlib.Path:
  if shutil.which("cmake") is None:
    pytest.skip("cmake not found")
  build = tmp_path_factory.mktemp("host_tests_build")
  asan = "ON" if _asan_available() else "OFF"
  env = {k: v for k, v in os.environ.items() if k != "JAX_CP_BUILD_CUDA"}
  configure = subprocess.run(
      ["cmake", "-S", str(ROOT), "-B", str(build),
       "-DCMAKE_BUILD_TYPE=Debug",
       "-DJAX_CP_BUILD_HOST_TESTS=ON", f"-DJAX_CP_ASAN={asan}",
       "-DJAX_CP_REQUIRE_JAX_CUDA_PLUGIN=OFF",
       f"-DPython_EXECUTABLE={sys.executable}"],
      capture_output=True, text=True, env=env, timeout=600)
  if configure.returncode != 0:
    pytest.fail(f"cmake configure failed:\n{configure.stdout}\n"
                f"{configure.stderr}")
  if "building the cuDNN extension" not in configure.stdout:
    pytest.skip("prerequisites of the extension missing: "
                + configure.stdout[-400:])
  built = subprocess.run(
      ["cmake", "--build", str(build), "--target", "jax_cp_host_tests",
       "-j", "2"], capture_output=True, text=True, env=env, timeout=900)
  assert built.returncode == 0, built.stdout + built.stderr
  exe = build / "jax_cp_host_tests"
  assert exe.exists()
  return exe


def test_host_cc(host_tests):
  env = {k: v for k, v in os.environ.items() if k != "JAX_CP_FAULT_INJECT"}
  # A standalone executable: LeakSanitizer runs too (no Python to excuse).
  env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
  run = subprocess.run([str(host_tests)], capture_output=True, text=True,
                       env=env, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "all checks passed" in run.stdout
  assert "AddressSanitizer" not in run.stderr
