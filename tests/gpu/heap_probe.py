"""Looks for heap corruption on the failure paths a full GPU drives the
extension into, one suspect at a time, under glibc's malloc checking.

  python -m tests.gpu.heap_probe [--rounds R] [--workers N] [MODE ...]

Modes (default: all), each in fresh processes:

* ``xla_contention``: N processes start at once, each with JAX's default
  preallocation (75 % of the GPU per process, so all but the first run
  short of memory), and run jitted forward + backward of the ``xla``
  backend in a loop. Is it XLA?
* ``cudnn_contention``: the same with the ``cudnn`` backend, whose handle
  creation fails in every process but the first. Is it the extension under
  contention?
* ``cudnn_create_loop``: one process starts JAX (its 75 % pool), takes
  what the GPU has left with ``cudaMalloc``, then calls ``cudnnCreate``
  (and ``cudnnDestroy`` after a success) directly, thousands of times,
  through ctypes: no jax_cp code.
  Is it cuDNN's failing ``cudnnCreate``?
* ``injected_handle``: ``JAX_CP_FAULT_INJECT=handle:<many>``: every cuDNN
  call of the extension fails in handle creation without calling cuDNN.
  Is it our error path?

Every process runs with glibc's heap checking (``GLIBC_TUNABLES=
glibc.malloc.check=3:glibc.malloc.perturb=165`` with
``libc_malloc_debug.so.0`` preloaded where glibc has it, and
``MALLOC_CHECK_=3`` for older ones), which aborts on the first
inconsistency it sees. A process that dies by a signal, or prints glibc's
or Python's fatal messages, counts as a reproduction (an exception that
ends a process with status 1 is reported, not counted). Prints one JSON line
per mode and a summary; exits 1 if any mode reproduced a corruption.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import importlib
import json
import os
import subprocess
import sys
import time

MODES = ("xla_contention", "cudnn_contention", "cudnn_create_loop",
         "injected_handle")
#: What glibc's checks and a crashing interpreter print.
FATAL_MARKERS = ("malloc(): ", "free(): ", "double free", "corrupted",
                 "malloc_consolidate", "Fatal Python error", "Segmentation",
                 "Aborted")


_LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
             "/usr/lib64", "/lib/aarch64-linux-gnu")


def malloc_check_env() -> dict:
  """Environment that turns on glibc's heap consistency checks."""
  env = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165",
         "GLIBC_TUNABLES": "glibc.malloc.check=3:glibc.malloc.perturb=165"}
  debug = [p for p in (os.path.join(d, "libc_malloc_debug.so.0")
                       for d in _LIB_DIRS) if os.path.exists(p)]
  if debug:
    env["LD_PRELOAD"] = " ".join(
        filter(None, [os.environ.get("LD_PRELOAD", ""), debug[0]]))
  return env


# ---------------------------------------------------------------------------
# Workers (run in their own processes).


def _worker_steps(backend: str, iters: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_cp.attention.backend import Segments

  if backend == "cudnn":
    from jax_cp.attention.cudnn import backend as impl
  else:
    from jax_cp.attention import xla as impl
  kw = dict(mask="causal_top_left", scale=0.125)
  rng = np.random.default_rng(0)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, do, k, v = mk(256, 4, 64), mk(256, 4, 64), mk(256, 2, 64), mk(256, 2, 64)
  lens = jnp.array([85, 171], jnp.int32)
  offs = jnp.array([0, 85], jnp.int32)
  seg = Segments(lens, lens, offs, offs, 171, 171, rows_see_keys=True)

  @jax.jit
  def step(q, k, v, do):
    o, lse = impl.forward(q, k, v, seg, **kw)
    return (o,) + tuple(impl.backward(q, k, v, o, lse, do, seg, **kw))

  errors: collections.Counter = collections.Counter()
  ok = 0
  for _ in range(iters):
    try:
      jax.block_until_ready(step(q, k, v, do))
      ok += 1
    except Exception as e:  # noqa: BLE001 - counted: failures are the point
      errors[f"{type(e).__name__}: {str(e)[:160]}"] += 1
  return dict(ok=ok, errors=dict(errors.most_common(4)))


def _library(soname: str, wheel: str) -> ctypes.CDLL:
  """``soname`` as the process finds it (JAX has loaded it), else from the
  nvidia wheel package ``wheel`` (``"cudnn"``, ``"cu13"``) JAX uses."""
  try:
    return ctypes.CDLL(soname)
  except OSError:
    package = importlib.import_module(f"nvidia.{wheel}")
    lib_dir = os.path.join(list(package.__path__)[0], "lib")
    return ctypes.CDLL(os.path.join(lib_dir, soname))


def _fill_device(rt: ctypes.CDLL) -> int:
  """cudaMalloc's what the device has left, big blocks then small ones;
  returns the bytes taken (kept until the process ends)."""
  taken = 0
  ptr = ctypes.c_void_p()
  for block in (1 << 30, 1 << 26, 1 << 20):
    while rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(block)) == 0:
      taken += block
  return taken


def _worker_create_loop(iters: int) -> dict:
  import jax
  import jax.numpy as jnp

  jax.block_until_ready(jnp.ones((1024,)) + 1)  # context + JAX's pool
  lib = _library("libcudnn.so.9", "cudnn")
  filled = _fill_device(_library("libcudart.so.13", "cu13"))
  handle = ctypes.c_void_p()
  statuses: collections.Counter = collections.Counter()
  for _ in range(iters):
    status = lib.cudnnCreate(ctypes.byref(handle))
    statuses[int(status)] += 1
    if status == 0:
      lib.cudnnDestroy(handle)
  return dict(statuses={str(k): v for k, v in statuses.items()},
              filled_bytes=filled)


def worker(argv: list[str]) -> None:
  kind, iters = argv[0], int(argv[1])
  t0 = time.perf_counter()
  if kind == "create":
    result = _worker_create_loop(iters)
  else:
    result = _worker_steps(kind, iters)
  result["seconds"] = round(time.perf_counter() - t0, 1)
  print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------
# Driver.


def _spawn(kind: str, iters: int, extra_env: dict) -> subprocess.Popen:
  env = dict(os.environ)
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # JAX's default: 75 %
  env.pop("JAX_CP_FAULT_INJECT", None)
  env.update(malloc_check_env())
  env.update(extra_env)
  return subprocess.Popen(
      [sys.executable, "-m", "tests.gpu.heap_probe", "--worker", kind,
       str(iters)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
  out = []
  for p in procs:
    try:
      stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      p.kill()
      stdout, stderr = p.communicate()
    result = None
    for line in stdout.splitlines():
      if line.startswith("RESULT "):
        result = json.loads(line[len("RESULT "):])
    fatal = sorted({m for m in FATAL_MARKERS if m in stderr})
    out.append(dict(returncode=p.returncode, result=result, fatal=fatal,
                    stderr_tail=stderr[-600:] if (fatal or p.returncode)
                    else ""))
  return out


def run_mode(mode: str, workers: int, rounds: int, iters: int) -> dict:
  runs = []
  for _ in range(rounds):
    if mode in ("xla_contention", "cudnn_contention"):
      backend = mode.split("_")[0]
      procs = [_spawn(backend, iters, {}) for _ in range(workers)]
    elif mode == "cudnn_create_loop":
      procs = [_spawn("create", 20 * iters, {})]
    elif mode == "injected_handle":
      procs = [_spawn("cudnn", iters,
                      {"JAX_CP_FAULT_INJECT": f"handle:{10 * iters}",
                       "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})]
    else:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    runs.extend(_collect(procs, timeout=600))
  # A corruption aborts (glibc's checks) or crashes: a signal or a fatal
  # message. A Python exception exits 1 and is reported, not counted.
  reproduced = [r for r in runs if r["fatal"] or r["returncode"] < 0]
  return dict(mode=mode, processes=len(runs), reproduced=len(reproduced),
              runs=runs)


def main(argv=None) -> int:
  if argv is None:
    argv = sys.argv[1:]
  if argv[:1] == ["--worker"]:
    worker(argv[1:])
    return 0
  p = argparse.ArgumentParser(prog="python -m tests.gpu.heap_probe",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("modes", nargs="*", default=list(MODES))
  p.add_argument("--workers", type=int, default=4)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--iters", type=int, default=200,
                 help="steps per process (the create loop: 20x as many)")
  args = p.parse_args(argv)
  print("malloc checking:", json.dumps(malloc_check_env()), flush=True)
  bad = 0
  for mode in args.modes:
    r = run_mode(mode, args.workers, args.rounds, args.iters)
    print(json.dumps(r), flush=True)
    bad += r["reproduced"]
    summary = [(x["returncode"], (x["result"] or {}).get("ok"),
                (x["result"] or {}).get("statuses")) for x in r["runs"]]
    print(f"{mode}: {r['processes']} processes, {r['reproduced']} "
          f"reproduced a corruption; (rc, ok steps, cudnnCreate statuses): "
          f"{summary}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
