"""Shared preamble of the GPU test modules: skip the whole module cleanly
when there is no CUDA GPU or the cuDNN extension is not built."""

import shutil
import subprocess

import jax
import pytest


def cudnn_backend_or_skip():
  """The ``jax_cp.attention.cudnn`` module; skips the calling module (at
  import) when it cannot run here."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
  try:
    from jax_cp.attention.cudnn import backend as cudnn  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built",
                allow_module_level=True)
  return cudnn


def gpu_memory_gib() -> float | None:
  """Total memory of GPU 0 in GiB (``nvidia-smi``), or None unknown."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return None
  try:
    out = subprocess.run([smi, "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return float(out.split()[0]) / 1024
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def gpu_memory_or_skip(gib: float) -> None:
  """Skips the calling test on a GPU with less than ``gib`` GiB in all (the
  reason names both); runs it where the size is unknown."""
  total = gpu_memory_gib()
  if total is not None and total < gib:
    pytest.skip(f"needs a GPU of {gib:g} GiB, GPU 0 has {total:.0f} GiB")
