"""The main job as N processes x 1 GPU (NCCL) against 1 process x N GPUs.

    python -m tests.gpu.compare_multiprocess -n 4 [--steps 50] [--out DIR] \\
        [-- JOB FLAGS]

Three runs of ``python -m examples.packed_lm`` with the same flags (default
:data:`DEFAULT_JOB`, the README's main job: 4 layers, d_model 1024, one
32k-token row per step; the mesh is dp=1 x cp=N in both), each started by
:func:`examples.launch_local.launch` (``NCCL_NVLS_ENABLE=0``):

1. ``multi``: N processes, one GPU each, checkpoints every ``steps / 2``
   steps;
2. ``single``: one process on the first N GPUs (checkpoints too, so both
   runs pay the same saves);
3. ``resumed``: one process on N GPUs from the multi run's checkpoint of
   step ``steps / 2``, copied alone into a fresh directory.

Then one ``PASS``/``FAIL`` line per check (:func:`compare`): every process
exited 0 and reported; the multi run's losses equal the single run's
within ``--loss-rtol`` (bf16) at every step, and agree across its
processes; its tokens/s is within ``--tok-s-rtol`` of the single run's; the
resumed run starts at ``steps / 2`` and its losses equal the single run's
from there. The exit status is 1 if any check fails. ``--device cpu`` runs
the same on virtual CPU devices (gloo; give the job ``--dp``/``--cp``);
``summary.json`` in ``--out`` holds the checks and the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence

from examples import launch_local

DEFAULT_JOB = ("--layers", "4", "--d-model", "1024", "--heads", "16",
               "--kv-heads", "4", "--seq-len", "32768", "--batch", "1")
LOSS_RTOL = 1e-2      # bf16 computation: a few units of its 2^-8 epsilon
TOK_S_RTOL = 0.05


@dataclasses.dataclass(frozen=True)
class Check:
  """One verdict: ``name``, ``ok`` and what was measured (``detail``)."""

  name: str
  ok: bool
  detail: str

  def line(self) -> str:
    return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def max_rel_diff(got: Sequence[float], want: Sequence[float]
                 ) -> tuple[float, int]:
  """``(max |got - want| / |want|, the step where it is)`` of two loss
  curves of the same length (``(inf, -1)`` if a value is not finite)."""
  worst, at = 0.0, -1
  for i, (a, b) in enumerate(zip(got, want)):
    d = abs(a - b) / max(abs(b), 1e-12)
    if not d <= worst:      # NaN counts as the worst
      worst, at = (d if d == d else float("inf")), i
  return worst, at


def _curve(name: str, got, want, rtol: float, offset: int = 0) -> Check:
  if len(got) != len(want):
    return Check(name, False, f"{len(got)} losses against {len(want)}")
  d, at = max_rel_diff(got, want)
  where = f" (step {at + offset}: {got[at]:.6f} vs {want[at]:.6f})" \
      if at >= 0 else ""
  return Check(name, d <= rtol, f"{len(got)} steps, max relative "
               f"difference {d:.2e}{where}, tolerance {rtol:g}")


def compare(multi: Sequence[dict | None], single: dict | None,
            resumed: dict | None, *, steps: int, resume_step: int,
            loss_rtol: float = LOSS_RTOL,
            tok_s_rtol: float = TOK_S_RTOL) -> list[Check]:
  """The checks of the module docstring on the runs' reports (the
  example's ``--report`` JSON; ``None``: missing). ``multi`` holds one
  report per process, in process order."""
  n = len(multi)
  checks = []
  ok = all(r is not None and r.get("process_index") == i
           and r.get("num_processes") == n for i, r in enumerate(multi))
  got = sum(r is not None for r in multi)
  checks.append(Check("multi reports", ok, f"{got} of {n} processes "
                      f"reported, each its index of {n}"))
  checks.append(Check("single report", single is not None
                      and single.get("num_processes") == 1,
                      "one process" if single else "missing"))
  if not ok or single is None:
    return checks
  first = multi[0]
  checks.append(_curve("losses N processes vs 1 process", first["losses"],
                       single["losses"][:steps], loss_rtol))
  if len(single["losses"]) != steps:
    checks.append(Check("steps", False, f"the single run trained "
                        f"{len(single['losses'])} steps, not {steps}"))
  others = [_curve(f"losses process {i} vs 0", r["losses"], first["losses"],
                   1e-6) for i, r in enumerate(multi[1:], 1)]
  if others:
    bad = [c for c in others if not c.ok]
    checks.append(Check("losses across the N processes", not bad,
                        bad[0].detail if bad else f"{n} processes agree"))
  a, b = first.get("tokens_per_s") or 0.0, single.get("tokens_per_s") or 0.0
  ratio = a / b if b else float("inf")
  checks.append(Check("tok/s N processes vs 1 process",
                      abs(ratio - 1.0) <= tok_s_rtol,
                      f"{a:,.0f} vs {b:,.0f} tok/s: ratio {ratio:.3f}, "
                      f"tolerance ±{tok_s_rtol:.0%}"))
  if resumed is None:
    checks.append(Check("resume", False, "no report of the resumed run"))
    return checks
  start = resumed.get("start_step")
  checks.append(Check("resume step", start == resume_step,
                      f"resumed at step {start}, the checkpoint's "
                      f"{resume_step}"))
  checks.append(_curve("losses resumed vs 1 process", resumed["losses"],
                       single["losses"][resume_step:steps], loss_rtol,
                       offset=resume_step))
  return checks


def read_report(path: pathlib.Path) -> dict | None:
  """A report, or None when it is missing or not JSON."""
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def copy_checkpoint(src: pathlib.Path, dst: pathlib.Path, step: int) -> None:
  """Step ``step`` of the example's checkpoint directory ``src`` (its
  ``state/<step>`` and ``run_config.json``) alone into ``dst``."""
  (dst / "state").mkdir(parents=True)
  shutil.copytree(src / "state" / str(step), dst / "state" / str(step))
  shutil.copy(src / "run_config.json", dst / "run_config.json")


def run(n: int, job: Sequence[str], out: pathlib.Path, *, steps: int,
        device: str, timeout: float, loss_rtol: float,
        tok_s_rtol: float) -> list[Check]:
  """The three runs of the module docstring in ``out``, then
  :func:`compare`."""
  resume_step = steps // 2
  common = [*job, "--steps", str(steps),
            "--checkpoint-every", str(resume_step)]

  def go(name: str, processes: int, extra: Sequence[str]) -> list[int]:
    print(f"--- {name}: {processes} process(es)", flush=True)
    codes = launch_local.launch(
        processes, [*common, *extra, "--report",
                    str(out / f"{name}{{process}}.json")],
        device=device, timeout=timeout, log_dir=out / name,
        gpus_per_process=1 if processes > 1 else n)
    print(f"--- {name}: exit {codes}", flush=True)
    return codes

  codes = {"multi": go("multi", n, ["--checkpoint-dir",
                                     str(out / "multi_ckpt")])}
  codes["single"] = go("single", 1, ["--checkpoint-dir",
                                      str(out / "single_ckpt")])
  resumed = None
  try:
    copy_checkpoint(out / "multi_ckpt", out / "resume_ckpt", resume_step)
  except OSError as e:
    print(f"no checkpoint of step {resume_step} to resume: {e}")
  else:
    codes["resumed"] = go("resumed", 1, ["--checkpoint-dir",
                                         str(out / "resume_ckpt")])
    resumed = read_report(out / "resumed0.json")
  checks = [Check(f"{name} exit status", all(c == 0 for c in cs), str(cs))
            for name, cs in codes.items()]
  checks += compare([read_report(out / f"multi{i}.json") for i in range(n)],
                    read_report(out / "single0.json"), resumed, steps=steps,
                    resume_step=resume_step, loss_rtol=loss_rtol,
                    tok_s_rtol=tok_s_rtol)
  return checks


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      usage="python -m tests.gpu.compare_multiprocess -n N [options] "
      "[-- job flags]")
  p.add_argument("-n", "--num-processes", type=int, required=True)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--out", default=None,
                 help="directory of the runs (default: a new temporary one)")
  p.add_argument("--timeout", type=float, default=600.0,
                 help="seconds per run")
  p.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
  p.add_argument("--tok-s-rtol", type=float, default=TOK_S_RTOL)
  p.add_argument("job", nargs=argparse.REMAINDER,
                 help=f"the job's flags after -- (default: "
                 f"{' '.join(DEFAULT_JOB)})")
  a = p.parse_args(argv)
  if a.steps < 2:
    p.error("--steps must be >= 2 (the resumed run starts at steps / 2)")
  job = a.job[1:] if a.job[:1] == ["--"] else a.job
  out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_cp_mp_"))
  out.mkdir(parents=True, exist_ok=True)
  checks = run(a.num_processes, job or DEFAULT_JOB, out, steps=a.steps,
               device=a.device, timeout=a.timeout, loss_rtol=a.loss_rtol,
               tok_s_rtol=a.tok_s_rtol)
  for c in checks:
    print(c.line())
  failed = [c for c in checks if not c.ok]
  print(f"{len(checks) - len(failed)} of {len(checks)} checks passed; runs "
        f"in {out}")
  (out / "summary.json").write_text(json.dumps(
      {"num_processes": a.num_processes, "steps": a.steps,
       "device": a.device, "job": list(job or DEFAULT_JOB),
       "checks": [dataclasses.asdict(c) for c in checks]}, indent=1))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
