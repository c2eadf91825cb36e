"""Several processes (one per host): start JAX's multi-controller runtime
(:func:`init_distributed`) and build a ``(data, cp)`` mesh with each cp
group inside a host (:func:`make_cp_mesh`).

One process per host (GPU: it drives all the host's GPUs; CPU: it drives
its virtual CPU devices). On every host, run the same script with the same
arguments except the process id::

    JAX_CP_COORDINATOR=host0:29500 JAX_CP_NUM_PROCESSES=2 \\
        JAX_CP_PROCESS_ID=0 python train.py      # on host0
    JAX_CP_COORDINATOR=host0:29500 JAX_CP_NUM_PROCESSES=2 \\
        JAX_CP_PROCESS_ID=1 python train.py      # on host1

Environment variables read by :func:`init_distributed` when its arguments
are ``None``:

* coordinator: ``JAX_CP_COORDINATOR``, else ``JAX_COORDINATOR_ADDRESS``
  (which ``jax.distributed.initialize`` reads itself too); ``host:port`` of
  process 0, reachable from every host.
* ``JAX_CP_NUM_PROCESSES``, ``JAX_CP_PROCESS_ID``: JAX 0.11 has no
  environment variables of its own for these (it detects them only under
  SLURM, Open MPI, Kubernetes or Cloud TPU; pass ``auto_detect=True`` there).

Usage::

    import jax_cp
    jax_cp.data.init_distributed()   # before any JAX computation
    mesh = jax_cp.data.make_cp_mesh(dp=2, cp=4)

Each process then loads only the rows of its batch shards
(:func:`jax_cp.data.process_batch_rows`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np

ENV_COORDINATOR = "JAX_CP_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_CP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_CP_PROCESS_ID"


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r} is not an integer") from None


def init_distributed(coordinator: str | None = None,
                     num_processes: int | None = None,
                     process_id: int | None = None, *,
                     cpu_devices: int | None = None,
                     auto_detect: bool = False,
                     **initialize_kwargs) -> bool:
  """Starts JAX's multi-controller runtime if several processes are asked.

  Call it first, before anything creates a JAX array or queries devices.

  Args:
    coordinator: ``host:port`` of process 0 (``None``: from the environment,
      see the module docstring).
    num_processes: number of processes (``None``: ``$JAX_CP_NUM_PROCESSES``).
    process_id: this process's index (``None``: ``$JAX_CP_PROCESS_ID``).
    cpu_devices: on CPU, the number of virtual devices of this process
      (``jax_num_cpu_devices``); ``None`` leaves it to ``XLA_FLAGS``.
    auto_detect: when nothing is configured, let JAX detect a cluster
      (SLURM, Open MPI, Kubernetes, Cloud TPU) instead of running single
      process.
    **initialize_kwargs: passed on to ``jax.distributed.initialize``, e.g.
      ``heartbeat_timeout_seconds`` (how soon the others notice a dead
      process; JAX's default is 100 s), ``initialization_timeout``,
      ``shutdown_timeout_seconds``, ``local_device_ids``.

  Returns:
    True if ``jax.distributed.initialize`` was called, False for a single
    process run (nothing configured, or one process).

  Raises:
    ValueError: the configuration is incomplete (e.g. a process count but no
      coordinator) or inconsistent.
  """
  coordinator = (coordinator or os.environ.get(ENV_COORDINATOR)
                 or os.environ.get("JAX_COORDINATOR_ADDRESS") or None)
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  # Gloo is JAX 0.11's default for cross-process CPU collectives; older
  # versions had none, so ask for it explicitly. Both options must be set
  # before the CPU backend starts.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
  given = (coordinator, num_processes, process_id)
  if all(x is None for x in given):
    if not auto_detect:
      return False
    jax.distributed.initialize(**initialize_kwargs)
    return True
  if num_processes == 1 and process_id in (None, 0):
    return False
  missing = [name for name, x in zip(
      (f"coordinator (${ENV_COORDINATOR})",
       f"num_processes (${ENV_NUM_PROCESSES})",
       f"process_id (${ENV_PROCESS_ID})"), given) if x is None]
  if missing:
    raise ValueError(f"multi-process setup is incomplete: missing "
                     f"{', '.join(missing)}")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is outside [0, "
                     f"num_processes={num_processes})")
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=num_processes,
                             process_id=process_id, **initialize_kwargs)
  return True


def make_cp_mesh(dp: int | None, cp: int, *,
              axis_names: Sequence[str] = ("data", "cp"),
              axis_types=None, devices=None) -> jax.sharding.Mesh:
  """A ``(dp, cp)`` mesh with each cp group on as few processes as possible.

  Devices are ordered by (process, device id) and cut into consecutive
  groups of ``cp``: with ``cp <=`` the local device count (and dividing it)
  every cp group sits inside one process, i.e. one host and its NVLink
  domain, and dp spans hosts; a larger cp spans ``cp / local`` consecutive
  processes (a multiple of the local count keeps whole hosts together).

  Args:
    dp: data-parallel size; ``None``: all devices / ``cp``.
    cp: context-parallel size.
    axis_names: names of the two axes.
    axis_types: ``jax.sharding.AxisType`` per axis; ``None``: JAX's default
      of ``jax.make_mesh`` (Explicit in JAX 0.11).
    devices: the devices to use (default ``jax.devices()``, all processes).

  Raises:
    ValueError: ``dp * cp`` is not the number of devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if cp < 1 or len(devices) % cp:
    raise ValueError(f"cp={cp} must divide the device count {len(devices)}")
  dp = len(devices) // cp if dp is None else dp
  if dp * cp != len(devices):
    raise ValueError(f"dp*cp = {dp}*{cp} = {dp * cp} must equal the number "
                     f"of devices, {len(devices)} (over "
                     f"{jax.process_count()} processes)")
  devices.sort(key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(dp, cp)
  if axis_types is None:
    axis_types = (jax.sharding.AxisType.Explicit,) * 2
  return jax.sharding.Mesh(grid, tuple(axis_names),
                           axis_types=tuple(axis_types))


__all__ = ("ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID",
           "init_distributed", "make_cp_mesh")
