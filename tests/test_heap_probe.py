"""The GPU heap probe's driver and its XLA worker, on CPU: the worker
processes run under glibc's heap checking and report their steps."""

import os

from tests.gpu import heap_probe


def test_malloc_check_env_turns_on_glibc_checks():
  env = heap_probe.malloc_check_env()
  assert env["MALLOC_CHECK_"] == "3"
  assert "glibc.malloc.check=3" in env["GLIBC_TUNABLES"]
  if "LD_PRELOAD" in env:
    assert all(os.path.exists(p) for p in env["LD_PRELOAD"].split())


def test_xla_worker_runs_under_heap_checking(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  r = heap_probe.run_mode("xla_contention", workers=1, rounds=1, iters=2)
  assert r["processes"] == 1 and r["reproduced"] == 0, r
  run = r["runs"][0]
  assert run["returncode"] == 0 and run["fatal"] == [], run
  assert run["result"]["ok"] == 2 and run["result"]["errors"] == {}, run
