"""Multi-process jax_cp: per-process loading (jax_cp.data) and cp_attention
under jax.distributed with gloo CPU collectives.

* Single process, 8 virtual devices: ``make_global_batch`` equals
  ``reorder_for_cp`` + ``device_put`` with the sharding; row planning and
  validation.
* ``multiprocess`` marker: two local processes of 4 virtual CPU devices each
  (tests/multiprocess/worker.py) run cp_attention forward and gradients with
  cp=8 spanning both, and on a (data=2, cp=4) mesh with dp across them, each
  checking its shards against plain masked attention; one process dying
  mid-run makes the other exit non-zero with a clear message; and
  python -m examples.packed_lm on 2 processes trains with the same losses as
  on one (dp across the processes, and cp spanning them).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from examples import launch_local
from jax_cp import CPLayout, data
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import multihost
from tests import reference as ref
from tests._devices import devices, requires_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "worker.py"

T = 64


def _rows(seed, cp, strategy, batch):
  rng = np.random.default_rng(seed)
  cu, cuP = map(np.stack, zip(*[ref.random_layout(
      rng, T, cp, ("mixed", "many_short")[i % 2],
      dual_chunk=strategy == S.DUAL_CHUNK_SWAP, max_docs=T)
      for i in range(batch)]))
  ids = rng.integers(0, 256, (batch, T)).astype(np.int32)
  x = rng.standard_normal((batch, T, 2, 4)).astype(np.float32)
  return cu, cuP, ids, x


def _mesh(dp, cp, axis_type):
  devs = np.array(devices(dp * cp)).reshape(dp, cp)
  return jax.sharding.Mesh(devs, ("data", "cp"), axis_types=(axis_type,) * 2)


# ------------------------------------------------------- single process


@pytest.mark.sweep(fast=4)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("dp,cp", [(2, 4), (1, 8), (4, 2)])
def test_single_process_equals_reorder_and_device_put(dp, cp, strategy,
                                                      axis_type):
  cu, cuP, ids, x = _rows(dp * 10 + cp, cp, strategy, batch=4)
  mesh = _mesh(dp, cp, axis_type)
  layout = CPLayout(mesh=mesh, batch_axis="data", strategy=strategy)
  rows = data.process_batch_rows(layout, 4)
  np.testing.assert_array_equal(rows, np.arange(4))
  batch = data.make_global_batch({"ids": ids, "x": x}, cuP, layout,
                                 global_batch_size=4)
  meta = batch.cu_seqlens_padded
  for name, arr, spec in (("ids", ids, P("data", "cp")),
                          ("x", x, P("data", "cp", None, None))):
    want = jax.device_put(data.reorder_for_cp(arr, cuP, layout, seq_dim=1),
                          NamedSharding(mesh, spec))
    got = batch.tensors[name]
    assert got.sharding.is_equivalent_to(want.sharding, arr.ndim), name
    assert got.dtype == arr.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for s in got.addressable_shards:   # device r holds exactly its tokens
      r = s.index[1].start // (T // cp)
      b = s.index[0]
      np.testing.assert_array_equal(
          np.asarray(s.data), data.get_batch_on_this_cp_rank(
              cuP[b], arr[b], layout=layout, cp_rank=r, seq_dim=1)[0])
  assert meta.dtype == jnp.int32
  assert meta.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
  np.testing.assert_array_equal(np.asarray(meta), cuP)
  cu_g = data.make_global_metadata(cu, layout)
  np.testing.assert_array_equal(np.asarray(cu_g), cu)


def test_single_process_feeds_cp_attention():
  """The global batch goes straight into cp_attention (Explicit mesh)."""
  cp, strategy = 4, S.NO_LOAD_BALANCE
  cu, cuP, _, x = _rows(7, cp, strategy, batch=2)
  mesh = _mesh(2, cp, AxisType.Explicit)
  # The attention's layout takes the context mesh; loading needs the mesh.
  layout = CPLayout(batch_axis="data", strategy=strategy, backend="xla")
  loading = layout.replace(mesh=mesh)
  batch = data.make_global_batch((x,), cuP, loading)
  (q,), cuP_g = batch.tensors, batch.cu_seqlens_padded
  cu_g = data.make_global_metadata(cu, loading)
  with jax.set_mesh(mesh):
    out = jax.jit(lambda q, cu, cuP: jax_cp.cp_attention(
        q, q, q, (cu, cuP), layout=layout))(q, cu_g, cuP_g)
  want = ref.batched_attention(x, x, x, cu, cuP)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(2)])
  got = np.asarray(out)     # NO_LOAD_BALANCE: the layout is physical order
  assert ref.rel_err(got[valid], np.asarray(want)[valid]) < 1e-4


def test_unbatched_rows_and_single_array():
  cu, cuP, ids, _ = _rows(3, 4, S.DUAL_CHUNK_SWAP, batch=1)
  mesh = jax.make_mesh((4,), ("cp",), devices=devices(4),
                       axis_types=(AxisType.Auto,))
  layout = CPLayout(mesh=mesh)
  batch = data.make_global_batch(ids[0], cuP[0], layout, seq_dim=0)
  got, meta = batch.tensors, batch.cu_seqlens_padded
  np.testing.assert_array_equal(
      np.asarray(got), data.reorder_for_cp(ids[0], cuP[0], layout))
  assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("cp")), 1)
  np.testing.assert_array_equal(np.asarray(meta), cuP[0])


def test_process_batch_rows_with_two_batch_axes():
  devs = np.array(devices(8)).reshape(2, 2, 2)
  mesh = jax.sharding.Mesh(devs, ("a", "b", "cp"))
  layout = CPLayout(mesh=mesh, batch_axis=("a", "b"))
  np.testing.assert_array_equal(data.process_batch_rows(layout, 8),
                                np.arange(8))
  with pytest.raises(ValueError, match="multiple of the number of batch"):
    data.process_batch_rows(layout, 6)
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    data.process_batch_rows(layout.replace(batch_axis="data"), 8)


def test_make_global_batch_validation():
  cu, cuP, ids, x = _rows(5, 4, S.DUAL_CHUNK_SWAP, batch=2)
  mesh = _mesh(2, 4, AxisType.Auto)
  layout = CPLayout(mesh=mesh, batch_axis="data")
  mk = lambda rows, cuP, **kw: data.make_global_batch(rows, cuP, layout,
                                                      **kw)
  with pytest.raises(ValueError, match="passed 2 rows.*must pass 4 rows"):
    mk({"ids": ids}, cuP, global_batch_size=4)
  with pytest.raises(ValueError, match="3 rows but cu_seqlens_padded has 2"):
    mk({"ids": np.concatenate([ids, ids[:1]])}, cuP)
  with pytest.raises(ValueError, match="must equal the token count"):
    mk({"ids": ids[:, :T - 8]}, cuP)
  with pytest.raises(ValueError, match="different token counts"):
    mk({"ids": ids, "x": x[:, :T - 8]}, cuP)
  with pytest.raises(ValueError, match="divisible by 2\\*cp_size=8"):
    mk((ids,), np.array([[0, 4, T]] * 2))
  with pytest.raises(ValueError, match="cp_axis='seq' is not an axis"):
    layout.replace(cp_axis="seq")
  with pytest.raises(ValueError, match="cannot also be a batch axis"):
    data.make_global_batch((ids,), cuP,
                           layout.replace(batch_axis=("data", "cp")))
  with pytest.raises(ValueError, match="max_seqlen=2 is smaller"):
    data.make_global_batch((ids,), cuP, layout.replace(max_seqlen=2))
  with pytest.raises(ValueError, match="seq_dim must be >= 1"):
    mk((ids,), cuP, seq_dim=0)
  with pytest.raises(ValueError, match="holds no arrays"):
    mk({}, cuP)


@requires_devices(8)
def test_make_cp_mesh_single_process():
  mesh = data.make_cp_mesh(2, 4)
  assert dict(mesh.shape) == {"data": 2, "cp": 4}
  assert mesh.devices[1, 0] == jax.devices()[4]
  assert data.make_cp_mesh(None, 2).shape["data"] == 4
  with pytest.raises(ValueError, match="must equal the number of devices"):
    data.make_cp_mesh(3, 2)


def test_init_distributed_single_process(monkeypatch):
  for name in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES,
               multihost.ENV_PROCESS_ID, "JAX_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(name, raising=False)
  assert data.init_distributed() is False
  assert data.init_distributed(num_processes=1) is False
  monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match="missing coordinator.*process_id"):
    data.init_distributed()
  monkeypatch.setenv(multihost.ENV_PROCESS_ID, "x")
  with pytest.raises(ValueError, match="not an integer"):
    data.init_distributed()


# ---------------------------------------------------------- two processes


def _child_env(xla_flags: str) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                     if p])
  env["XLA_FLAGS"] = xla_flags
  env.pop("JAX_PLATFORMS", None)
  return env


def _launch(tmp_path, timeout: float, *worker_args: str, n: int = 2):
  """Starts ``n`` workers (each its own process group), waits up to
  ``timeout`` seconds in all, and kills every group that is left, whatever
  happens. Returns [(returncode, stdout, stderr)] and the wall time."""
  port = launch_local.free_port()
  # 4 virtual devices per process, and a cheaper (unoptimised) LLVM backend:
  # compilation dominates these tiny runs on a 2-core machine.
  env = _child_env("--xla_force_host_platform_device_count=4 "
                   "--xla_backend_optimization_level=0")
  return _run_processes(tmp_path, timeout, [
      [sys.executable, str(WORKER), "--process-id", str(i),
       "--num-processes", str(n), "--coordinator", f"localhost:{port}",
       "--out", str(tmp_path), *worker_args] for i in range(n)], env)


def _run_processes(tmp_path, timeout: float, commands, env,
                   fail_fast: bool = False):
  """Runs ``commands`` (one process group each), waits up to ``timeout``
  seconds in all, and kills every group that is left, whatever happens;
  with ``fail_fast``, as soon as one exits non-zero. Returns
  [(returncode, stdout, stderr)] and the wall time."""
  procs, files = [], []
  start = time.monotonic()
  try:
    for i, cmd in enumerate(commands):
      out = open(tmp_path / f"stdout{i}", "w+")
      err = open(tmp_path / f"stderr{i}", "w+")
      files.append((out, err))
      procs.append(subprocess.Popen(
          cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
          cwd=ROOT, start_new_session=True))
    if fail_fast:
      while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
          break     # the others would wait for it in a collective
        if time.monotonic() - start > timeout:
          pytest.fail(f"processes still running after {timeout:.0f} s:\n"
                      + _logs(files))
        time.sleep(0.2)
    for p in procs:
      left = timeout - (time.monotonic() - start)
      try:
        p.wait(timeout=max(left, 0.1) if not fail_fast else 0.1)
      except subprocess.TimeoutExpired:
        if not fail_fast:
          pytest.fail(f"workers still running after {timeout:.0f} s:\n"
                      + _logs(files))
  finally:
    launch_local.stop(procs)
  wall = time.monotonic() - start
  results = []
  for p, (out, err) in zip(procs, files):
    out.seek(0)
    err.seek(0)
    results.append((p.returncode, out.read(), err.read()))
    out.close()
    err.close()
  return results, wall


def _logs(files) -> str:
  text = []
  for i, (out, err) in enumerate(files):
    for name, f in (("stdout", out), ("stderr", err)):
      f.flush()
      f.seek(0)
      body = "".join(line for line in f if "[Gloo]" not in line)
      text.append(f"--- worker {i} {name}:\n{body[-4000:]}")
  return "\n".join(text)


@pytest.mark.multiprocess
def test_two_processes_cp_attention_matches_reference(tmp_path):
  results, wall = _launch(tmp_path, 240, "--scenario", "attention")
  for i, (rc, out, err) in enumerate(results):
    assert rc == 0, f"worker {i} exited with {rc}:\n{out}\n{err[-4000:]}"
  print(f"two-process run: {wall:.1f} s wall")
  reports = [json.loads((tmp_path / f"result{i}.json").read_text())
             for i in range(2)]
  # The rows each process loaded: only its own where dp spans processes.
  rows = {"cp8": lambda i: [0, 1], "dp2_cp4": lambda i: [i],
          "dp4_cp2_interleaved": lambda i: [i, i + 2],
          "dp2_cp4_spanning": lambda i: [0, 1, 2, 3]}
  want_cases = {f"{m}/{s.value}" for m in rows for s in S}
  for i, rep in enumerate(reports):
    assert set(rep["results"]) == want_cases
    for case, res in rep["results"].items():
      bad = {k: e for k, e in res["errors"].items() if not e < 1e-4}
      assert not bad, f"worker {i} {case}: {bad}"
      assert res["rows"] == rows[case.split("/")[0]](i), (i, case)
    for case in want_cases:
      if case.startswith(("cp8", "dp2_cp4/")):   # cases that check attention
        assert {"out", "dq", "dk", "dv"} <= set(rep["results"][case]["errors"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("dying", [1, 0], ids=["worker", "coordinator"])
def test_dead_process_makes_the_other_exit(tmp_path, dying):
  """One process exits (status 3) right before the first collective; the
  other, blocked in the cp all-gather, must exit non-zero with a message
  naming the failure well within the timeout. A dead worker is found by the
  coordination service's heartbeat check (timeout 5 s in the worker; JAX's
  default is 100 s), a dead coordinator (process 0) by the lost connection.
  The worker's watchdog (status 70) is only a backstop."""
  results, wall = _launch(tmp_path, 90, "--scenario", "die",
                          "--dying-process", str(dying),
                          "--heartbeat", "5", "--watchdog", "75")
  rc, out, err = results[dying]
  assert rc == 3, f"worker {dying} exited with {rc}:\n{out}\n{err[-4000:]}"
  rc, out, err = results[1 - dying]
  assert rc != 0, f"the survivor exited with 0:\n{out}\n{err[-4000:]}"
  assert rc != 70, f"only the watchdog stopped the survivor:\n{err[-4000:]}"
  assert "another task died" in err, err[-4000:]
  if dying:
    assert "stopped sending heartbeats" in err, err[-4000:]
  print(f"process {dying} died: the survivor exited with {rc} after "
        f"{wall:.1f} s")


# ------------------------------------------- the training example, 2 x 4

EXAMPLE = ["-m", "examples.packed_lm"]
EXAMPLE_ARGS = ["--seq-len", "256", "--layers", "1", "--d-model", "64",
                "--steps", "3", "--batch", "2", "--backend", "xla",
                "--no-compare", "--quiet"]


@pytest.mark.slow    # whole training runs in two processes
@pytest.mark.multiprocess
@requires_devices(8)      # the single-process run, in this process
@pytest.mark.parametrize("dp,cp", [(2, 4), (1, 8)],
                         ids=["dp2_cp4_dp_across", "dp1_cp8_cp_across"])
def test_two_process_training_matches_single_process(tmp_path, dp, cp):
  """python -m examples.packed_lm on 2 processes x 4 CPU devices trains like
  one process of 8 devices on the same (dp, cp) mesh: same losses, each
  process loading only its own rows. With dp=2, the 2 processes also save
  an orbax checkpoint (shared local dir) that one process then resumes."""
  args = EXAMPLE_ARGS + ["--dp", str(dp), "--cp", str(cp)]
  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")] if dp == 2 else []
  port = launch_local.free_port()
  results, wall = _run_processes(tmp_path, 240, [
      [sys.executable, *EXAMPLE, *args, *ckpt,
       "--coordinator", f"localhost:{port}", "--num-processes", "2",
       "--process-id", str(i),
       "--report", str(tmp_path / "report{process}.json")]
      for i in range(2)], _child_env("--xla_backend_optimization_level=0"),
                                fail_fast=True)
  for i, (rc, out, err) in enumerate(results):
    body = "".join(l for l in err.splitlines(True) if "[Gloo]" not in l)
    assert rc == 0, f"process {i} exited with {rc}:\n{out[-2000:]}\n" \
        f"{body[-4000:]}"
  reports = [json.loads((tmp_path / f"report{i}.json").read_text())
             for i in range(2)]
  from examples.packed_lm import main  # pylint: disable=import-outside-toplevel
  t = time.monotonic()
  single = main.main(args)      # in this process: 8 devices
  print(f"2 processes: {wall:.1f} s wall; 1 process: "
        f"{time.monotonic() - t:.1f} s")
  assert single["num_processes"] == 1 and len(single["losses"]) == 3
  for i, rep in enumerate(reports):
    assert rep["process_index"] == i and rep["num_processes"] == 2
    # Only its own rows: one data shard each, or both rows when cp spans
    # the processes.
    assert rep["local_rows"] == ([i] if dp == 2 else [0, 1])
    np.testing.assert_allclose(rep["losses"], single["losses"], rtol=1e-5)
  if ckpt:        # the 2-process checkpoint, resumed by one process
    resumed = main.main(args + ckpt)
    assert resumed["start_step"] == 3 and resumed["losses"] == []
