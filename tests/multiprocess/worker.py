"""One process of a multi-process jax_cp run on localhost (gloo CPU
collectives), started by tests/test_multiprocess.py.

Every process generates the same seeded packed batch, but hands
:func:`jax_cp.data.make_global_batch` only its own rows
(:func:`jax_cp.data.process_batch_rows`). It then runs ``cp_attention`` forward
and gradients under ``jit`` on a mesh spanning both processes and compares
each shard it holds with plain masked attention on the unpartitioned rows
(tests/reference.py), computed locally and put in ``reorder_for_cp`` layout.
Results go to ``<out>/result<process_id>.json``; any mismatch exits non-zero.

Scenarios:
  attention: loading only (nothing compiles) on two layouts where a process
    holds several batch shards; then attention with cp=8 over both
    processes, and on (data=2, cp=4) with dp across processes and cp inside
    each; both strategies each.
  die: process ``--dying-process`` (default 1) exits with status 3
    (``os._exit``) at ``--die-at`` (default: right before the first
    collective); the others must notice and exit non-zero on their own.

Failure detection: ``jax.distributed.initialize`` gets a short
``heartbeat_timeout_seconds`` (JAX's default is 100 s), after which the
coordination service declares a silent process dead and aborts every other
one (SIGABRT, "Terminating process because the JAX distributed service
detected fatal errors"). A watchdog thread is a backstop only: if the worker
has not finished after ``--watchdog`` seconds, it prints why to stderr and
exits with status 70, so a hang never outlives the test's timeout.

Usage: python worker.py --process-id I --num-processes 2 \\
    --coordinator localhost:PORT --out DIR [--scenario attention|die]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # run as a script: the repository's packages

# pylint: disable=wrong-import-position
import jax  # noqa: E402  (importing jax does not start a backend)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import CPLayout, data  # noqa: E402
from jax_cp import CPLoadBalancingStrategy as S  # noqa: E402
from tests import reference as ref  # noqa: E402

WATCHDOG_STATUS = 70
DIE_STATUS = 3
T, HQ, HKV, D, B = 128, 4, 2, 16, 2
TOL = 1e-4


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--process-id", type=int, required=True)
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--coordinator", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--scenario", choices=("attention", "die"),
                 default="attention")
  p.add_argument("--die-at", choices=("after_init", "before_collective"),
                 default="before_collective")
  p.add_argument("--dying-process", type=int, default=1)
  p.add_argument("--cpu-devices", type=int, default=4)
  p.add_argument("--heartbeat", type=int, default=30,
                 help="heartbeat_timeout_seconds of jax.distributed")
  p.add_argument("--watchdog", type=float, default=150.0)
  return p.parse_args(argv)


def log(msg: str) -> None:
  print(f"worker {ARGS.process_id}: {msg}", flush=True)


def start_watchdog(seconds: float) -> None:
  def fire():
    sys.stderr.write(f"worker {ARGS.process_id}: watchdog: still running "
                     f"after {seconds:.0f} s (a peer process probably died "
                     f"and JAX did not notice); exiting\n")
    sys.stderr.flush()
    os._exit(WATCHDOG_STATUS)
  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.start()


# --------------------------------------------------------------- the checks


def make_data(strategy, cp, batch=B):
  """The full seeded batch (every process makes the same one)."""
  rng = np.random.default_rng(1234 + cp)
  kinds = ("mixed", "many_short")
  cu, cuP = map(np.stack, zip(*[ref.random_layout(
      rng, T, cp, kinds[i % 2], dual_chunk=strategy == S.DUAL_CHUNK_SWAP,
      max_docs=T) for i in range(batch)]))
  full = {name: rng.standard_normal((batch, T, h, D)).astype(np.float32)
          for name, h in (("q", HQ), ("k", HKV), ("v", HKV), ("w", HQ))}
  return full, cu, cuP


def masked_attention_np(q, k, v, w, mask):
  """Plain masked softmax attention on one row and its gradients for the
  loss ``sum(out * w)``, in float64 numpy (no compilation: cheap next to
  jitting a reference). ``q, w [T, Hq, D]``, ``k, v [T, Hkv, D]``."""
  q, k, v, w = (x.astype(np.float64) for x in (q, k, v, w))
  g = q.shape[1] // k.shape[1]
  kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
  scale = 1.0 / np.sqrt(q.shape[-1])
  s = np.einsum("qhd,khd->hqk", q, kr) * scale
  s = np.where(mask[None], s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp(s - m) * mask[None]
  p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
  out = np.einsum("hqk,khd->qhd", p, vr)
  dp = np.einsum("qhd,khd->hqk", w, vr)
  ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
  dq = np.einsum("hqk,khd->qhd", ds, kr) * scale
  dk = np.einsum("hqk,qhd->khd", ds, q) * scale
  dv = np.einsum("hqk,qhd->khd", p, w)
  fold = lambda x: x.reshape(x.shape[0], -1, g, x.shape[-1]).sum(2)
  return out, dq, fold(dk), fold(dv)


def reference(full, cu, cuP, cp, strategy):
  """Out and grads of plain masked attention on the unpartitioned rows
  (document mask from tests/reference.py), in reorder_for_cp layout."""
  per_row = [masked_attention_np(*(full[n][i] for n in "qkvw"),
                                 ref.doc_mask(cu[i], cuP[i]))
             for i in range(B)]
  layout = CPLayout(cp_size=cp, strategy=strategy)
  return {name: data.reorder_for_cp(np.stack([r[j] for r in per_row]),
                                    cuP, layout, seq_dim=1)
          for j, name in enumerate(("out", "dq", "dk", "dv"))}


def shard_error(arr, want) -> float:
  """Relative error over the shards of ``arr`` this process holds."""
  num = den = 0.0
  for s in arr.addressable_shards:
    got = np.asarray(s.data, np.float64)
    ref = np.asarray(want[s.index], np.float64)
    num += float(np.sum((got - ref) ** 2))
    den += float(np.sum(ref ** 2))
  return (num / max(den, 1e-30)) ** 0.5


def load(layout, full, cu, cuP, expect_rows):
  """Hands make_global_batch only this process's rows and checks that every
  shard it holds is the reorder_for_cp slice of the full batch."""
  batch_size = cu.shape[0]
  rows = data.process_batch_rows(layout, batch_size)
  assert rows.tolist() == list(expect_rows), (rows, expect_rows)
  local = {name: x[rows] for name, x in full.items()}
  assert all(x.shape[0] == len(rows) for x in local.values())
  batch = data.make_global_batch(local, cuP[rows], layout,
                                 global_batch_size=batch_size,
                                 cu_seqlens=cu[rows])
  cu_g = data.make_global_metadata(cu[rows], layout,
                                   global_batch_size=batch_size)
  errors = {}
  for name in full:
    want = data.reorder_for_cp(full[name], cuP, layout, seq_dim=1)
    errors[f"load_{name}"] = shard_error(batch.tensors[name], want)
  errors["load_cuP"] = shard_error(batch.cu_seqlens_padded,
                                   cuP.astype(np.float64))
  errors["load_cu"] = shard_error(cu_g, cu.astype(np.float64))
  return batch.tensors, cu_g, batch.cu_seqlens_padded, rows, errors


def run_case(mesh, strategy, die_before_collective=False):
  cp, n_data = mesh.shape["cp"], mesh.shape["data"]
  full, cu, cuP = make_data(strategy, cp)
  per = B // n_data
  expect = range(B) if n_data == 1 else range(ARGS.process_id * per,
                                             (ARGS.process_id + 1) * per)
  layout = CPLayout(mesh=mesh, batch_axis="data", strategy=strategy,
                    backend="xla")
  batch, cu_g, cuP_g, rows, errors = load(layout, full, cu, cuP, expect)
  if die_before_collective and ARGS.process_id == ARGS.dying_process:
    log(f"dying (os._exit({DIE_STATUS})) before the first collective")
    os._exit(DIE_STATUS)

  def loss(q, k, v, w, cu, cuP):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return jnp.sum(out * w), out

  # The metadata are global arrays too: arguments, never closed over.
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  t = time.time()
  with jax.set_mesh(mesh):
    compiled = step.lower(batch["q"], batch["k"], batch["v"], batch["w"],
                          cu_g, cuP_g).compile()
    t_compile = time.time() - t
    (_, out), grads = compiled(batch["q"], batch["k"], batch["v"],
                               batch["w"], cu_g, cuP_g)
    jax.block_until_ready(grads)
  t_run = time.time() - t - t_compile
  t = time.time()
  want = reference(full, cu, cuP, cp, strategy)
  log(f"compile {t_compile:.1f} s, run {t_run:.1f} s, reference "
      f"{time.time() - t:.1f} s")
  errors["out"] = shard_error(out, want["out"])
  for name, g in zip(("dq", "dk", "dv"), grads):
    errors[name] = shard_error(g, want[name])
  return {"rows": rows.tolist(), "errors": errors,
          "mesh": {k: int(v) for k, v in mesh.shape.items()}}


def load_only_cases():
  """make_global_batch on layouts where a process holds several batch shards
  (4 rows, 2 processes of 4 devices); no attention, so nothing compiles."""
  devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  p0, p1 = devs[:4], devs[4:]
  pid = ARGS.process_id
  layouts = {
      # cp groups inside processes, data shards alternating between
      # processes: process p holds data shards p and p+2 (rows not
      # contiguous).
      "dp4_cp2_interleaved": ([p0[:2], p1[:2], p0[2:], p1[2:]],
                              [pid, pid + 2]),
      # cp groups spanning both processes: each holds every data shard.
      "dp2_cp4_spanning": ([p0[:2] + p1[:2], p0[2:] + p1[2:]], range(4)),
  }
  out = {}
  for name, (grid, expect) in layouts.items():
    mesh = jax.sharding.Mesh(np.array(grid, dtype=object), ("data", "cp"))
    for strategy in S:
      full, cu, cuP = make_data(strategy, mesh.shape["cp"], batch=4)
      layout = CPLayout(mesh=mesh, batch_axis="data", strategy=strategy)
      *_, rows, errors = load(layout, full, cu, cuP, expect)
      out[f"{name}/{strategy.value}"] = {"rows": rows.tolist(),
                                         "errors": errors}
  return out


def main():
  t0 = time.time()
  start_watchdog(ARGS.watchdog)
  data.init_distributed(
      ARGS.coordinator, ARGS.num_processes, ARGS.process_id,
      cpu_devices=ARGS.cpu_devices,
      heartbeat_timeout_seconds=ARGS.heartbeat, initialization_timeout=60,
      shutdown_timeout_seconds=30)
  log(f"initialized in {time.time() - t0:.1f} s: {jax.process_count()} "
      f"processes, {jax.local_device_count()} local / {jax.device_count()} "
      f"devices")
  assert jax.process_count() == ARGS.num_processes
  assert jax.local_device_count() == ARGS.cpu_devices
  die = ARGS.scenario == "die"
  if (die and ARGS.die_at == "after_init"
      and ARGS.process_id == ARGS.dying_process):
    log(f"dying (os._exit({DIE_STATUS})) right after initialize")
    os._exit(DIE_STATUS)
  meshes = {
      # cp spans both processes; Explicit axes (jax.make_mesh's default).
      "cp8": data.make_cp_mesh(1, 8),
      # dp across processes, cp inside each; Auto axes.
      "dp2_cp4": data.make_cp_mesh(2, 4, axis_types=(AxisType.Auto,) * 2),
  }
  for name, mesh in meshes.items():
    groups = {d.process_index for d in mesh.devices[0]}
    log(f"mesh {name}: processes of cp group 0: {sorted(groups)}")
  results = {} if die else load_only_cases()
  for key, res in results.items():
    log(f"{key}: rows {res['rows']}, max error "
        f"{max(res['errors'].values()):.2e}")
  cases = [(m, s) for m in meshes for s in S]
  for mesh_name, strategy in cases[:1] if die else cases:
    t = time.time()
    res = run_case(meshes[mesh_name], strategy, die_before_collective=die)
    key = f"{mesh_name}/{strategy.value}"
    res["seconds"] = round(time.time() - t, 2)
    results[key] = res
    log(f"{key}: {res['seconds']} s, rows {res['rows']}, max error "
        f"{max(res['errors'].values()):.2e}")
  failed = {key: bad for key, res in results.items()
            if (bad := {k: e for k, e in res["errors"].items()
                        if not e < TOL})}
  path = pathlib.Path(ARGS.out) / f"result{ARGS.process_id}.json"
  path.write_text(json.dumps({"results": results,
                              "seconds": round(time.time() - t0, 2)},
                             indent=1))
  log(f"done in {time.time() - t0:.1f} s")
  if failed:
    sys.stderr.write(f"worker {ARGS.process_id}: mismatches in {failed}\n")
    sys.exit(1)


if __name__ == "__main__":
  ARGS = parse_args()
  main()
