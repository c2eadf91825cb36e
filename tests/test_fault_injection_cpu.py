"""The test-only fault injection switch of the cuDNN extension, on a CPU-only
machine: the spec the module functions and JAX_CP_FAULT_INJECT take, and the
handle failure memory's reset. (What each fault does to a call needs a GPU:
tests/gpu/test_fault_injection.py.) Skipped when the extension is not built.
"""

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

try:
  from jax_cp.attention.cudnn import backend as cudnn  # noqa: F401  (imports the extension)
except ModuleNotFoundError:  # a present but broken extension fails
  pytest.skip("jax_cp's cuDNN extension is not built", allow_module_level=True)

from jax_cp import _jax_cp_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]

POINTS = {
    "handle", "graph_validate", "graph_build_operation_graph",
    "graph_create_execution_plans", "graph_check_support", "graph_build_plans",
    "workspace_size", "workspace_alloc", "kernel_load", "kernel_launch",
    "set_stream", "execute",
}


@pytest.fixture
def disarmed():
  _jax_cp_cuda.set_fault_injection("")
  yield
  _jax_cp_cuda.set_fault_injection("")


def _armed():
  return {name: c["remaining"]
          for name, c in _jax_cp_cuda.fault_injection_counts().items()
          if c["remaining"]}


def test_points_and_default(disarmed):
  counts = _jax_cp_cuda.fault_injection_counts()
  assert set(counts) == POINTS
  assert all(c == {"remaining": 0, "injected": 0} for c in counts.values())


def test_spec_parsing(disarmed):
  _jax_cp_cuda.set_fault_injection(" execute:3 , handle,,")
  assert _armed() == {"execute": 3, "handle": -1}
  _jax_cp_cuda.set_fault_injection("execute:3,execute:7")
  assert _armed() == {"execute": 7}
  _jax_cp_cuda.set_fault_injection("")
  assert _armed() == {}


@pytest.mark.parametrize("spec", ["nope", "handle:0", "handle:-2",
                                  "handle:x", "execute:", "graph_validate:1.5"])
def test_bad_spec_raises_and_keeps_the_active_one(disarmed, spec):
  _jax_cp_cuda.set_fault_injection("set_stream:2")
  with pytest.raises(ValueError) as info:
    _jax_cp_cuda.set_fault_injection(spec)
  assert ("unknown fault point" in str(info.value)
          or "positive integer" in str(info.value))
  assert _armed() == {"set_stream": 2}


def test_handle_failure_memory_functions():
  # Nothing failed on a machine that never created a handle.
  assert _jax_cp_cuda.failed_handles() == {}
  assert _jax_cp_cuda.reset_failed_handles() == 0


def test_the_remembered_failure_names_the_retry_function():
  """A remembered cudnnCreate failure tells the user to call
  ``retry_cudnn_handle()`` (csrc/cudnn_state.cc): the name resolves, and
  the function forgets the failures (none on this machine)."""
  source = (ROOT / "csrc" / "cudnn_state.cc").read_text()
  dotted = re.search(r"(jax_cp(?:\.\w+)+)\(\)", source).group(1)
  module, name = dotted.rsplit(".", 1)
  retry = getattr(importlib.import_module(module), name)
  assert retry is cudnn.retry_cudnn_handle
  assert retry() == 0


def _run(env_value):
  env = dict(os.environ, JAX_CP_FAULT_INJECT=env_value)
  code = ("import json; from jax_cp import _jax_cp_cuda as m; "
          "print(json.dumps({k: v['remaining'] for k, v in "
          "m.fault_injection_counts().items() if v['remaining']}))")
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, env=env, timeout=300)


def test_environment_variable_is_read_at_import():
  run = _run("workspace_alloc:5,execute")
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip().splitlines()[-1] == (
      '{"workspace_alloc": 5, "execute": -1}')


def test_bad_environment_variable_fails_the_import():
  run = _run("kernel_lod")
  assert run.returncode != 0
  assert 'JAX_CP_FAULT_INJECT="kernel_lod"' in run.stderr
  assert "unknown fault point" in run.stderr
