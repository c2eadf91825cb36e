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

Set :func:`configure` before jax is imported: JAX keeps the CPU as its
default backend and skips the plugin's check of the local CUDA libraries
(there is no driver to ask).
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS_DIR = os.path.join(_HERE, "gpu_targets")


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
  """Environment for compiling with no GPU present (before jax loads)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def compile_only_devices(name: str, count: int) -> list:
  """``count`` compile-only devices of target ``name`` (one host).

  Raises RuntimeError saying what to install when the CUDA plugin is
  missing."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(name),
        topology=f"1x1x{count}")
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
