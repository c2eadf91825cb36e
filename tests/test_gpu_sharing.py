"""Test processes share one GPU: JAX's per-process preallocation is off in
every test process (tests/conftest.py), so ``pytest -n N`` on one GPU gives
each worker what it uses instead of 75 % of the device each."""

import os
import subprocess
import sys


def test_preallocation_is_off_in_test_processes():
  assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_a_caller_setting_wins_and_subprocesses_inherit():
  """conftest only sets a default: a caller's value is kept; a test's
  subprocess (as the GPU tests start) inherits the setting."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import os, tests.conftest; "
          "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])")
  for given, want in ((None, "false"), ("true", "true")):
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if given is not None:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = given
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == want


def test_the_gpu_suite_script_sets_it():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = open(os.path.join(root, "tests", "gpu", "run_gpu_suite.sh")).read()
  assert ('export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_'
          'PREALLOCATE:-false}"') in script
