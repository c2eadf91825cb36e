"""Compiling for a GPU on a machine without one: XLA's plan of a step.

The CUDA PJRT plugin makes compile-only devices from a GPU target config
(``benchmarks/gpu_targets/<name>.txtpb``: the device's limits, compute
capability, cuDNN and CUDA versions), with no GPU and no driver. A program
lowered for a mesh of those devices, on abstract arguments
(``jax.ShapeDtypeStruct`` with shardings), compiles as it would on that GPU:
its ``memory_analysis()`` and buffer assignment are XLA's GPU plan.
Nothing runs. ``bench_memory --target`` uses it with the ``cudnn``
backend (the extension built: its handlers register with the plugin's
CUDA libraries, no device needed) or the attention stand-in
(``benchmarks/standin_attention.py``).

Call :func:`configure` before the first device is used: JAX keeps the CPU
as its platform and skips the plugin's check of the local CUDA libraries
(there is no driver to ask). A plan for N GPUs (``bench_memory --target
h200 --cp N``) lowers the step for a ``(1, N)`` mesh of N compile-only
devices (:func:`compile_only_devices`), in hosts of 8 past 8.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS_DIR = os.path.join(_HERE, "gpu_targets")
#: GPUs per host of a plan of several hosts (an H200 node holds 8).
GPUS_PER_HOST = 8


def targets() -> list[str]:
  """The names of the GPU target configs beside this module."""
  return sorted(f[:-len(".txtpb")] for f in os.listdir(TARGETS_DIR)
                if f.endswith(".txtpb"))


def target_config(name: str) -> str:
  """The text of target ``name``'s config; ValueError naming the known
  ones when there is none."""
  if name not in targets():
    raise ValueError(f"target={name!r}: no {name}.txtpb in {TARGETS_DIR}; "
                     f"known targets: {targets()}")
  with open(os.path.join(TARGETS_DIR, name + ".txtpb"),
            encoding="utf-8") as f:
    return f.read()


def device_kind(name: str) -> str:
  """The ``device_description_str`` of target ``name``."""
  for line in target_config(name).splitlines():
    key, _, value = line.partition(":")
    if key.strip() == "device_description_str":
      return value.strip().strip('"')
  return name


def configure() -> None:
  """Compiling with no GPU present: the CPU as JAX's platform, and no check
  of the local CUDA libraries (before the first device is used)."""
  import jax  # pylint: disable=import-outside-toplevel
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  jax.config.update("jax_platforms", "cpu")


def topology(count: int, per_host: int = GPUS_PER_HOST) -> str:
  """The topology of ``count`` GPUs, ``per_host`` on each host:
  ``1x<hosts>x<GPUs per host>`` (a count above ``per_host`` fills whole
  hosts)."""
  if count < 1 or (count > per_host and count % per_host):
    raise ValueError(f"{count} GPUs do not fill hosts of {per_host}")
  return f"1x{max(1, count // per_host)}x{min(count, per_host)}"


def compile_only_devices(name: str, count: int) -> list:
  """``count`` compile-only devices of target ``name``, in hosts of
  :data:`GPUS_PER_HOST` (:func:`topology`).

  Raises RuntimeError saying what to install when the CUDA plugin is
  missing."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(name),
        topology=topology(count))
  except NotImplementedError as err:
    raise RuntimeError(
        "compiling for a GPU target needs JAX's CUDA plugin: pip install "
        "'jax[cuda13]==<your jax version>' (no GPU or driver needed)"
    ) from err
  return list(topo.devices)


def abstract(tree, mesh):
  """``tree``'s arrays as ``jax.ShapeDtypeStruct`` with the same partition
  specs over ``mesh`` (other leaves as they are)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel

  def one(x):
    if not isinstance(x, jax.Array):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=NamedSharding(mesh, x.sharding.spec))
  return jax.tree.map(one, tree)
