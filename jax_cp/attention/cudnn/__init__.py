"""The ``"cudnn"`` attention backend and what it is made of.

* :mod:`~jax_cp.attention.cudnn.backend`: the backend, cuDNN SDPA over
  packed segments through XLA FFI (:data:`~jax_cp.attention.cudnn.backend.
  BACKEND`); importing it loads the compiled extension.
* :mod:`~jax_cp.attention.cudnn.workspace`: the backward's scratch memory,
  as a formula, and the bound on it.
* :mod:`~jax_cp.attention.cudnn.split`: a backward kept within that bound,
  in sub-calls over GQA head groups and K/V slices.
* :mod:`~jax_cp.attention.cudnn.kv_slices`: a backward in sub-calls over
  ranges of the K/V rows.

Importing this package loads no extension, so the formulas work on any
machine. The backend module's names are this package's as well
(``jax_cp.attention.cudnn.BACKEND``, ``.FWD_TARGET``,
``.retry_cudnn_handle()``, ...): the first use of one imports
:mod:`~jax_cp.attention.cudnn.backend`, which raises
``ModuleNotFoundError`` where the extension is not built. Code that must
know whether the backend loads imports ``jax_cp.attention.cudnn.backend``.
"""

import importlib

_SUBMODULES = ("backend", "kv_slices", "split", "workspace")


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"{__name__}.{name}")
  if name.startswith("__"):
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  backend = importlib.import_module(f"{__name__}.backend")
  try:
    return getattr(backend, name)
  except AttributeError:
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}") from None
