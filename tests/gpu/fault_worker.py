"""Subprocess helper of tests/gpu/test_fault_injection.py and
tests/gpu/test_concurrency.py. Prints one line ``RESULT {json}`` at the end.

  JAX_CP_FAULT_INJECT=<point> python -m tests.gpu.fault_worker fault <point>

    Runs a clean forward + backward first (except for the points reached
    only on first use), then the cuDNN forward of a new shape 100 times with
    the fault armed (each call must raise), disarms it
    (set_fault_injection(""), reset_failed_handles()), then runs forward +
    backward and compares with the xla backend. Reports
    the messages, the graph cache and the GPU memory in use around the
    failures.

  python -m tests.gpu.fault_worker concurrent <tag>

    Two threads run jitted forward + backward of different shapes at once
    (20 iterations each; the first ones miss the graph cache together), then
    the same calls run serially; reports the largest differences between the
    two and against the xla backend. <tag> (0, 1, ...) picks shapes, so two
    processes do not share shapes.
"""

from __future__ import annotations

import gc
import json
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp import _jax_cp_cuda
from jax_cp.attention import xla
from jax_cp.attention.backend import Segments
from jax_cp.attention.cudnn import backend as cudnn

KW = dict(mask="causal_top_left", scale=0.125)
HQ, HKV, D = 4, 2, 64
REPEATS = 100

# Points reached only on the first use in the process (the handle is created
# once, the kernels loaded once): no clean call may run before the faults.
FIRST_USE = ("handle", "kernel_load")
# Points after a successful graph build: the forward graph of the faulty
# shape is built and cached once, whatever the number of failures.
AFTER_BUILD = ("workspace_alloc", "set_stream", "execute")


class Case:
  """Inputs, segments and jitted calls of one shape (tq tokens, 2 segments)."""

  def __init__(self, tq: int, seed: int):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    self.q, self.do = mk(tq, HQ, D), mk(tq, HQ, D)
    self.k, self.v = mk(tq, HKV, D), mk(tq, HKV, D)
    first = tq // 3
    lens = jnp.array([first, tq - first], jnp.int32)
    offs = jnp.array([0, first], jnp.int32)
    self.seg = seg = Segments(lens, lens, offs, offs, tq - first, tq - first,
                              rows_see_keys=True)
    self.fwd = jax.jit(lambda q, k, v: cudnn.forward(q, k, v, seg, **KW))

    def step(q, k, v, do):
      o, lse = cudnn.forward(q, k, v, seg, **KW)
      return (o, lse) + tuple(cudnn.backward(q, k, v, o, lse, do, seg, **KW))

    self.step = jax.jit(step)

  def run_step(self):
    return jax.block_until_ready(self.step(self.q, self.k, self.v, self.do))

  def reference(self):
    o, lse = xla.forward(self.q, self.k, self.v, self.seg, **KW)
    g = xla.backward(self.q, self.k, self.v, o, lse, self.do, self.seg, **KW)
    return (o,) + tuple(g)


def rel_err(a, b) -> float:
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a32 - b32) / jnp.maximum(
      jnp.linalg.norm(b32), 1e-30))


def worst_vs_xla(case: Case, got) -> float:
  o, _, dq, dk, dv = got
  return max(rel_err(a, b) for a, b in zip((o, dq, dk, dv), case.reference()))


def bytes_in_use() -> int:
  gc.collect()
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_in_use", -1))


def fault(point: str) -> dict:
  # What JAX_CP_FAULT_INJECT armed at import (-1: every call fails).
  armed = _jax_cp_cuda.fault_injection_counts()[point]["remaining"]
  if point not in FIRST_USE:
    # A clean first call (handle, kernels, a first graph), then re-arm.
    _jax_cp_cuda.set_fault_injection("")
    Case(128, seed=1).run_step()
    _jax_cp_cuda.set_fault_injection(point)
  case = Case(256, seed=2)  # a shape not built before the faults
  cache_before = _jax_cp_cuda.graph_cache_stats()
  messages, raised = [], 0
  mem_after_first = -1
  for i in range(REPEATS):
    if point == "handle" and i % 2 == 0:
      # Half the calls retry cudnnCreate (and fail again), half hit the
      # remembered failure. The public way to ask for the retry, the one
      # the remembered failure's message names.
      cudnn.retry_cudnn_handle()
    try:
      jax.block_until_ready(case.fwd(case.q, case.k, case.v))
    except Exception as e:  # pylint: disable=broad-except
      raised += 1
      messages.append(f"{type(e).__name__}: {e}")
    if i == 0:
      mem_after_first = bytes_in_use()
  mem_after_all = bytes_in_use()
  cache_after_faults = _jax_cp_cuda.graph_cache_stats()
  counts = _jax_cp_cuda.fault_injection_counts()[point]
  failed_handles = {str(k): v for k, v in
                    _jax_cp_cuda.failed_handles().items()}

  _jax_cp_cuda.set_fault_injection("")
  _jax_cp_cuda.reset_failed_handles()
  got = case.run_step()
  worst = worst_vs_xla(case, got)
  cache_after_clean = _jax_cp_cuda.graph_cache_stats()
  return dict(
      point=point, armed=armed, raised=raised, repeats=REPEATS,
      messages=messages, injected=counts["injected"],
      failed_handles=failed_handles,
      mem_after_first=mem_after_first, mem_after_all=mem_after_all,
      cache_before=cache_before, cache_after_faults=cache_after_faults,
      cache_after_clean=cache_after_clean, worst_vs_xla=worst)


def concurrent(tag: int) -> dict:
  # Shapes differ between the two threads, between iterations (two per
  # thread, alternating) and between processes (tag).
  sizes = [[160 + 64 * tag, 224 + 64 * tag], [192 + 64 * tag, 256 + 64 * tag]]
  cases = [[Case(t, seed=10 * tag + j) for j, t in enumerate(ts)]
           for ts in sizes]
  iterations = 20
  barrier = threading.Barrier(len(cases))
  threaded: list[list] = [[None] * iterations for _ in cases]
  errors: list[str] = []

  def work(t: int):
    try:
      barrier.wait()
      for i in range(iterations):
        out = cases[t][i % 2].run_step()
        threaded[t][i] = [np.asarray(x, np.float32) for x in out]
    except Exception as e:  # pylint: disable=broad-except
      errors.append(f"thread {t}: {type(e).__name__}: {e}")

  threads = [threading.Thread(target=work, args=(t,))
             for t in range(len(cases))]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  if errors:
    return dict(errors=errors)
  worst_serial = worst_xla = 0.0
  for t, per_thread in enumerate(cases):
    for j, case in enumerate(per_thread):
      serial = case.run_step()
      worst_xla = max(worst_xla, worst_vs_xla(case, serial))
      for i in range(j, iterations, 2):
        # Every row is covered, so the LSE is finite too.
        for a, b in zip(threaded[t][i], serial):
          worst_serial = max(worst_serial, rel_err(a, b))
  return dict(errors=errors, worst_vs_serial=worst_serial,
              worst_vs_xla=worst_xla,
              cache=_jax_cp_cuda.graph_cache_stats())


def main(argv) -> int:
  mode, arg = argv[1], argv[2]
  result = fault(arg) if mode == "fault" else concurrent(int(arg))
  print("RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv))
