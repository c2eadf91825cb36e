"""Scaling out: the local multi-process launcher (examples/launch_local.py),
the N-process vs 1-process comparison (tests/gpu/compare_multiprocess.py)
on synthetic reports and, marked slow, on CPU processes; the NVLink
topology parser of tests/gpu/test_dp_cp_cudnn.py."""

from __future__ import annotations

import io
import json
import math
import pathlib
import sys

import pytest

from examples import launch_local
from tests.gpu import compare_multiprocess as cmp
from tests.gpu.test_dp_cp_cudnn import nvlink_matrix

# --------------------------------------------------------------- launcher


def test_process_env_one_gpu_each_and_nvls_off():
  base = {"PYTHONPATH": "/x", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
  env = launch_local.process_env(2, "gpu", base)
  assert env["CUDA_VISIBLE_DEVICES"] == "6"
  assert env["NCCL_NVLS_ENABLE"] == "0"
  assert env["PYTHONPATH"].split(":") == [str(launch_local.ROOT), "/x"]
  assert launch_local.process_env(0, "gpu", base, gpus=4)[
      "CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
  assert launch_local.process_env(1, "gpu", {}, gpus=2)[
      "CUDA_VISIBLE_DEVICES"] == "2,3"
  with pytest.raises(ValueError, match="needs GPUs 4..4.*lists 4"):
    launch_local.process_env(4, "gpu", base)
  cpu = launch_local.process_env(1, "cpu", {
      "XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8"})
  assert cpu["XLA_FLAGS"] == "--a=1" and cpu["JAX_PLATFORMS"] == "cpu"
  assert "NCCL_NVLS_ENABLE" not in cpu


def test_commands_carry_the_distributed_flags():
  cmds = launch_local.commands(2, ["--steps", "5"], "gpu", 1234)
  assert cmds[1][1:] == ["-m", "examples.packed_lm", "--steps", "5",
                         "--device", "gpu", "--coordinator", "localhost:1234",
                         "--num-processes", "2", "--process-id", "1"]


def test_launch_stops_the_others_when_one_fails(tmp_path):
  """Process 1 exits 3 at once; process 0 would sleep a minute: it is
  stopped, and main's status is 3. Output lines carry their process."""
  (tmp_path / "fake_job.py").write_text(
      "import sys, time\n"
      "i = int(sys.argv[sys.argv.index('--process-id') + 1])\n"
      "print('hello from', i, flush=True)\n"
      "sys.exit(3) if i == 1 else time.sleep(60)\n")
  sink = io.StringIO()
  env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
  codes = launch_local.launch(2, [], device="cpu", module="fake_job",
                              sink=sink, env=env, log_dir=tmp_path / "logs",
                              timeout=30)
  assert codes[1] == 3 and codes[0] == -9, codes
  assert "[1] hello from 1" in sink.getvalue()
  assert (tmp_path / "logs" / "process1.log").read_text() == "hello from 1\n"


# ------------------------------------------------------------- comparison

STEPS, RESUME = 6, 3


def _report(losses, i=0, n=1, start=0, tok_s=1000.0):
  return dict(losses=list(losses), process_index=i, num_processes=n,
              start_step=start, tokens_per_s=tok_s)


def _runs(n=2, drift=0.0, tok=1000.0, resume_at=RESUME, nan=False):
  curve = [3.0 - 0.1 * s for s in range(STEPS)]
  multi_curve = [x * (1 + drift) for x in curve]
  if nan:
    multi_curve[4] = float("nan")
  multi = [_report(multi_curve, i, n, tok_s=tok) for i in range(n)]
  single = _report(curve)
  resumed = _report(curve[resume_at:], start=resume_at)
  return multi, single, resumed


def _verdicts(*runs, **kw):
  return {c.name: c.ok for c in cmp.compare(*runs, steps=STEPS,
                                            resume_step=RESUME, **kw)}


def test_compare_passes_equal_runs_and_prints_lines():
  checks = cmp.compare(*_runs(drift=1e-3, tok=1030.0), steps=STEPS,
                       resume_step=RESUME)
  assert all(c.ok for c in checks) and len(checks) == 7, checks
  assert checks[2].line().startswith(
      "PASS losses N processes vs 1 process: 6 steps, max relative "
      "difference 1.00e-03")


@pytest.mark.parametrize("runs, kw, failing", [
    (_runs(drift=2e-2), {}, "losses N processes vs 1 process"),
    (_runs(drift=2e-2), {"loss_rtol": 3e-2}, None),
    (_runs(nan=True), {},     # NaN equals nothing, not even itself
     "losses N processes vs 1 process|losses across the N processes"),
    (_runs(tok=940.0), {}, "tok/s N processes vs 1 process"),
    (_runs(tok=1060.0), {}, "tok/s N processes vs 1 process"),
    (_runs(resume_at=2), {}, "resume step|losses resumed vs 1 process"),
])
def test_compare_fails_what_differs(runs, kw, failing):
  got = _verdicts(*runs, **kw)
  assert [k for k, ok in got.items() if not ok] == (
      failing.split("|") if failing else []), got


def test_compare_missing_or_inconsistent_reports():
  multi, single, resumed = _runs()
  assert not _verdicts([multi[0], None], single, resumed)["multi reports"]
  assert not _verdicts(multi, None, resumed)["single report"]
  assert not _verdicts(multi, single, None)["resume"]
  multi[1]["losses"][2] += 1e-3
  assert not _verdicts(multi, single, resumed)["losses across the N processes"]
  swapped = [dict(multi[0], process_index=1), multi[1]]
  assert not _verdicts(swapped, single, resumed)["multi reports"]
  assert cmp.max_rel_diff([1.0, math.inf], [1.0, 1.0])[0] == math.inf


def test_run_orchestration_with_a_fake_launcher(tmp_path, monkeypatch):
  """The three runs' flags, the resume checkpoint copied alone, the
  reports read back, the exit status of main."""
  calls = []

  def fake_launch(n, args, **kw):
    calls.append((n, list(args), kw["gpus_per_process"]))
    report = args[args.index("--report") + 1]
    ckpt = pathlib.Path(args[args.index("--checkpoint-dir") + 1])
    start = RESUME if "resume_ckpt" in str(ckpt) else 0
    if start:
      assert sorted(p.name for p in (ckpt / "state").iterdir()) == ["3"]
    for step in (RESUME, STEPS):
      (ckpt / "state" / str(step)).mkdir(parents=True, exist_ok=True)
    (ckpt / "run_config.json").write_text("{}")
    for i in range(n):
      curve = [3.0 - 0.1 * s for s in range(start, STEPS)]
      pathlib.Path(report.replace("{process}", str(i))).write_text(
          json.dumps(_report(curve, i, n, start)))
    return [0] * n

  monkeypatch.setattr(cmp.launch_local, "launch", fake_launch)
  status = cmp.main(["-n", "4", "--steps", str(STEPS), "--out",
                     str(tmp_path), "--", "--seq-len", "64"])
  assert status == 0
  assert [(n, g) for n, _, g in calls] == [(4, 1), (1, 4), (1, 4)]
  for _, args, _ in calls:
    assert args[:2] == ["--seq-len", "64"] and "--steps" in args
    assert args[args.index("--checkpoint-every") + 1] == str(RESUME)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert all(c["ok"] for c in summary["checks"])
  # A process that did not report fails the run.
  monkeypatch.setattr(cmp, "read_report", lambda p: None
                      if p.name == "multi1.json" else json.loads(
                          p.read_text()))
  out2 = tmp_path / "again"
  assert cmp.main(["-n", "2", "--steps", str(STEPS), "--out", str(out2)]) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compare_multiprocess_on_cpu_processes(tmp_path, capsys):
  """The whole comparison on 2 CPU processes (gloo) x 1 virtual device
  against 1 process x 2: a real checkpoint of the 2-process run resumed by
  one process. tok/s is not compared (CPU timings of a shared machine)."""
  status = cmp.main([
      "-n", "2", "--device", "cpu", "--steps", "4", "--out", str(tmp_path),
      "--tok-s-rtol", "100", "--", "--dp", "1", "--cp", "2", "--layers", "1",
      "--d-model", "32", "--heads", "2", "--kv-heads", "1", "--seq-len", "64",
      "--batch", "1", "--backend", "xla"])
  out = capsys.readouterr().out
  assert status == 0, out[-4000:]
  assert "FAIL" not in out and "PASS losses resumed vs 1 process" in out


# --------------------------------------------------------------- topology

TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\tSYS\t0-47\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tSYS\tSYS\t48-95\t1\t\tN/A
GPU3\tSYS\tSYS\tSYS\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tSYS\tSYS\tSYS\t X

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_nvlink_matrix_parses_nvidia_smi_topo():
  links = nvlink_matrix(TOPO)
  assert links[(0, 1)] == "NV18" and links[(2, 1)] == "NV18"
  assert links[(0, 3)] == "SYS" and links[(3, 3)] == "X"
  assert len(links) == 16          # GPU columns only, no NIC
  assert nvlink_matrix("no topology here") == {}


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
