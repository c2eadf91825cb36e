"""``bench_memory --target``: XLA's plan of the step for a GPU that is not
here (``benchmarks/deviceless.py``). The plan itself needs JAX's CUDA
plugin (no GPU): that test skips without it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_memory, deviceless

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_targets_and_their_names():
  assert "h200" in deviceless.targets()
  assert deviceless.device_kind("h200") == "NVIDIA H200"
  assert "cuda_compute_capability" in deviceless.target_config("h200")
  with pytest.raises(ValueError, match=r"target='b300'.*known targets"):
    deviceless.target_config("b300")


@pytest.mark.parametrize("extra", [[], ["--compile-only"],
                                   ["--compile-only", "--backend", "xla"],
                                   ["--backend", "standin"],
                                   ["--backend", "cudnn"]])
def test_target_needs_compile_only_and_cudnn_or_the_standin(extra):
  with pytest.raises(SystemExit, match="--compile-only and --backend "
                                       "standin or cudnn"):
    bench_memory.main(["--target", "h200", "--seq-lens", "8k", *extra])


def test_topology_of_n_gpus_fills_hosts_of_eight():
  assert [deviceless.topology(n) for n in (1, 2, 4, 8, 16)] == [
      "1x1x1", "1x1x2", "1x1x4", "1x1x8", "1x2x8"]
  for bad in (0, 12):
    with pytest.raises(ValueError, match="do not fill hosts"):
      deviceless.topology(bad)


def test_unknown_target_is_refused_by_the_parser(capsys):
  with pytest.raises(SystemExit):
    bench_memory.build_parser().parse_args(["--target", "b300"])
  assert "invalid choice: 'b300'" in capsys.readouterr().err


def _importable(name: str) -> bool:
  """Whether module ``name`` can be found (False also when a parent
  package is missing)."""
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:
    return False


@pytest.mark.skipif(not _importable("jax_plugins.xla_cuda13"),
                    reason="JAX's CUDA plugin is not installed")
@pytest.mark.parametrize("backend, cp", [("standin", 1), ("standin", 2),
                                         ("cudnn", 1)])
def test_plan_for_h200s_compiles_for_sm90(tmp_path, backend, cp):
  """A small model's step compiled for ``cp`` H200s in a fresh process:
  XLA's GPU pipeline (the buffer assignment of an sm_90 module), the
  record named for the target, and the plan of a longer row larger."""
  if backend == "cudnn" and not _importable("jax_cp._jax_cp_cuda"):
    pytest.skip("the cuDNN extension is not built")
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_memory", "--target", "h200",
       "--compile-only", "--backend", backend, "--cp", str(cp),
       "--layers", "1", "--d-model", "256", "--heads", "4", "--kv-heads",
       "2", "--remat", "full", "--seq-lens", "8k", "16k", "--breakdown",
       "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
  (path,) = tmp_path.glob("memory_*.json")
  result = json.loads(path.read_text())
  assert result["env"]["device_kind"] == "NVIDIA H200 (plan)"
  assert result["env"]["target"] == "h200"
  assert result["env"]["device_count"] == cp
  runs = result["records"]
  assert [(r["status"], r["cp"]) for r in runs] == [("compiled", cp)] * 2
  for r in runs:
    assert "sm_9.0" in r["breakdown"]["source"], r["breakdown"]["source"]
  short, long = sorted(runs, key=lambda r: r["seq_len"])
  assert long["temp_bytes"] > 1.5 * short["temp_bytes"] > 0
  assert "NVIDIA H200 (plan)" in (tmp_path / "memory.md").read_text()


@pytest.mark.skipif(not _importable("jax_plugins.xla_cuda13"),
                    reason="JAX's CUDA plugin is not installed")
def test_scanned_layers_keep_one_stack_of_inputs(tmp_path):
  """The layers as a scan at cp = 2, compiled for H200s: the stack of
  saved layer inputs ``[L, 1, Tl, E]`` is never transposed whole for the
  backward loop (jax_cp.modules.row_major), so no buffer of the step's
  temp is the stack in another layout."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  layers, d, t, cp = 4, 256, 65536, 2
  run = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench_memory", "--target", "h200",
       "--compile-only", "--backend", "standin", "--cp", str(cp),
       "--scan-layers", "--layers", str(layers), "--d-model", str(d),
       "--heads", "4", "--kv-heads", "2", "--remat", "full", "--seq-lens",
       str(t), "--breakdown", "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
  (path,) = tmp_path.glob("memory_*.json")
  (record,) = json.loads(path.read_text())["records"]
  stack = f"bf16[{layers},1,{t // cp},{d}]"
  shapes = [v["shape"] for v in record["breakdown"]["top_temp"]]
  assert stack in shapes, shapes
  size = sorted([layers, 1, t // cp, d])
  others = [s for s in shapes if s != stack and s.startswith("bf16[") and
            sorted(int(n) for n in s[5:-1].split(",")) == size]
  assert not others, f"the stack {stack} also held as {others}"
