"""Shared preamble of the GPU test modules: skip the whole module cleanly
when there is no CUDA GPU or the cuDNN extension is not built."""

import jax
import pytest


def cudnn_backend_or_skip():
  """The ``jax_cp.attention.cudnn`` module; skips the calling module (at
  import) when it cannot run here."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
  try:
    from jax_cp.attention import cudnn  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built",
                allow_module_level=True)
  return cudnn
