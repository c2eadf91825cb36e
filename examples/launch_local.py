"""One job as several processes on one host, one GPU each (NCCL between
them), as on a cluster of single-GPU workers:

    python -m examples.launch_local -n 4 -- --layers 4 --seq-len 32768

starts ``-n`` processes of ``python -m examples.packed_lm ARGS --device
gpu --coordinator localhost:PORT --num-processes N --process-id I`` from
the repository root. On GPU process ``I`` sees only the ``I``-th GPU
(``CUDA_VISIBLE_DEVICES``: the ``I``-th entry of the one given, else
``I``) and NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``). On CPU
(``--device cpu``, gloo) each process gets its share of the mesh as
virtual devices (the example sets them). Every output line is prefixed
with ``[I]``. When one process fails the others are stopped; the exit
status is the first positive one (1 if signals stopped them all), else 0.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULE = "examples.packed_lm"
# NCCL's NVLink multicast (NVLS) algorithms are kept off in every process.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def free_port() -> int:
  """A TCP port free on this host now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(i: int, device: str, base: dict | None = None,
                gpus: int = 1) -> dict:
  """The environment of process ``i``: ``base`` (default ``os.environ``)
  with the repository on ``PYTHONPATH``; on GPU its ``gpus`` visible GPUs
  (the ``i``-th group of the base's ``CUDA_VISIBLE_DEVICES``, else of 0, 1,
  ...) and :data:`NCCL_ENV`; on CPU ``JAX_PLATFORMS=cpu`` and no
  virtual-device count in ``XLA_FLAGS`` (the example sets each
  process's)."""
  env = dict(os.environ if base is None else base)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                     if p])
  if device == "gpu":
    given = env.get("CUDA_VISIBLE_DEVICES", "")
    visible = [d.strip() for d in given.split(",") if d.strip()]
    if visible and (i + 1) * gpus > len(visible):
      last = (i + 1) * gpus - 1
      raise ValueError(f"process {i} needs GPUs {i * gpus}..{last}, but "
                       f"CUDA_VISIBLE_DEVICES={given!r} lists {len(visible)}")
    mine = (visible[i * gpus:(i + 1) * gpus] if visible
            else [str(d) for d in range(i * gpus, (i + 1) * gpus)])
    env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    env.update(NCCL_ENV)
  else:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "",
        env.get("XLA_FLAGS", "")).strip()
  return env


def commands(n: int, args: Sequence[str], device: str, port: int,
             module: str = MODULE) -> list[list[str]]:
  """The command line of each of the ``n`` processes."""
  return [[sys.executable, "-m", module, *args, "--device", device,
           "--coordinator", f"localhost:{port}", "--num-processes", str(n),
           "--process-id", str(i)] for i in range(n)]


def stop(procs: Sequence[subprocess.Popen]) -> None:
  """SIGKILL to the process group of each of ``procs`` still running (each
  started with ``start_new_session=True``), then waits for all."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    p.wait()


def _forward(i: int, stream, sink, log) -> None:
  for line in stream:
    sink.write(f"[{i}] {line}")
    sink.flush()
    if log is not None:
      log.write(line)
  stream.close()


def launch(n: int, args: Sequence[str], *, device: str = "gpu",
           module: str = MODULE, timeout: float | None = None,
           log_dir: str | os.PathLike | None = None, sink=None,
           env: dict | None = None, gpus_per_process: int = 1
           ) -> list[int]:
  """Runs ``n`` processes of ``module`` with ``args`` (see the module
  docstring; ``gpus_per_process`` GPUs each, see :func:`process_env`) and
  waits for them; returns their exit statuses. A process
  that exits non-zero, or ``timeout`` seconds passing, stops the others
  (their process groups get SIGKILL; a stopped process reads ``-9``).
  ``log_dir``: each process's output also in ``process<I>.log`` there."""
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  sink = sys.stdout if sink is None else sink
  port = free_port()
  procs, threads, logs = [], [], []
  start = time.monotonic()
  try:
    for i, cmd in enumerate(commands(n, args, device, port, module)):
      log = None
      if log_dir is not None:
        pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
        log = open(pathlib.Path(log_dir) / f"process{i}.log", "w")
        logs.append(log)
      p = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           env=process_env(i, device, env,
                                           gpus_per_process), cwd=ROOT,
                           text=True, start_new_session=True)
      procs.append(p)
      threads.append(threading.Thread(target=_forward,
                                      args=(i, p.stdout, sink, log),
                                      daemon=True))
      threads[-1].start()
    while any(p.poll() is None for p in procs):
      failed = any(p.poll() not in (None, 0) for p in procs)
      late = timeout is not None and time.monotonic() - start > timeout
      if failed or late:
        if late:
          sink.write(f"launch_local: stopping after {timeout:g} s\n")
        break
      time.sleep(0.2)
  finally:
    stop(procs)
    for t in threads:
      t.join(timeout=5)
    for log in logs:
      log.close()
  return [p.returncode for p in procs]


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      usage="python -m examples.launch_local -n N [options] -- [job args]")
  p.add_argument("-n", "--num-processes", type=int, required=True)
  p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--module", default=MODULE, help="the job to run")
  p.add_argument("--timeout", type=float, default=None, help="seconds")
  p.add_argument("--log-dir", default=None)
  p.add_argument("args", nargs=argparse.REMAINDER,
                 help="the job's flags, after --")
  a = p.parse_args(argv)
  job = a.args[1:] if a.args[:1] == ["--"] else a.args
  codes = launch(a.num_processes, job, device=a.device, module=a.module,
                 timeout=a.timeout, log_dir=a.log_dir)
  bad = [(i, c) for i, c in enumerate(codes) if c]
  for i, c in bad:
    print(f"launch_local: process {i} exited with {c}", file=sys.stderr)
  # A process's own status first; those stopped by a signal read 1.
  return next((c for _, c in bad if c > 0), 1 if bad else 0)


if __name__ == "__main__":
  sys.exit(main())
