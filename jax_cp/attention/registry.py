"""The table of attention backends and the choice of one by name.

The built-in backends are listed in :data:`BUILTIN_BACKENDS` and imported
here, on first use, and nowhere else: the backend modules do not import
this one. ``xla`` is always there; ``cudnn`` when the compiled extension
module ``jax_cp._jax_cp_cuda`` exists. An extension that exists but fails
to load (an undefined symbol, a missing CUDA library) is not hidden:
``backend="cudnn"`` raises its error and ``backend="auto"`` warns once with
it and falls back to ``xla``. A failed load is retried on the next request.

:func:`register_backend` adds a user backend (any
:class:`~jax_cp.attention.backend.AttentionBackend`) under its name.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import jax

# Names other modules import from here.
from jax_cp.attention.backend import (  # noqa: F401
    MASK_TYPES,
    AttentionBackend,
    Backend,
    InPlaceAttentionBackend,
    Segments,
)

#: name -> (module defining ``BACKEND``, extension module it needs or None).
BUILTIN_BACKENDS: dict[str, tuple[str, str | None]] = {
    "xla": ("jax_cp.attention.xla", None),
    "cudnn": ("jax_cp.attention.cudnn", "jax_cp._jax_cp_cuda"),
}

#: How to build the cuDNN extension (named in errors and warnings).
BUILD_HINT = ('on a GPU machine with a C++ compiler (no CUDA toolkit '
              'needed), install jax_cp with its extension: '
              'pip install -e ".[cuda13]" -C cuda=13 '
              '(README: Building the cuDNN extension)')

# Backends loaded so far or registered by users, and the warnings given.
_BACKENDS: dict[str, AttentionBackend] = {}
_WARNED: set = set()


def register_backend(backend: AttentionBackend) -> None:
  """Registers (or replaces) a backend under ``backend.name``."""
  _BACKENDS[backend.name] = backend


def _extension_exists(module: str | None) -> bool:
  if module is None:
    return True
  try:
    return importlib.util.find_spec(module) is not None
  except ImportError:
    return False


def _load(name: str) -> AttentionBackend | None:
  """The backend ``name``: from the table of loaded ones, else imported
  from :data:`BUILTIN_BACKENDS`. None when it is unknown or its extension
  does not exist; the import's own error when the module fails to load."""
  if name in _BACKENDS:
    return _BACKENDS[name]
  if name not in BUILTIN_BACKENDS:
    return None
  module, extension = BUILTIN_BACKENDS[name]
  if not _extension_exists(extension):
    return None
  backend = importlib.import_module(module).BACKEND
  _BACKENDS[name] = backend
  return backend


def registered_backends() -> tuple[str, ...]:
  """Names of the backends that load in this installation."""
  names = [n for n in BUILTIN_BACKENDS if _try_load(n) is not None]
  return tuple(names + [n for n in _BACKENDS if n not in names])


def _try_load(name: str) -> AttentionBackend | None:
  try:
    return _load(name)
  except ImportError:
    return None


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _auto(platform: str) -> AttentionBackend:
  """cudnn when it loads and runs on ``platform``, else xla (with a warning
  once when the platform is a GPU)."""
  on_gpu = platform in ("cuda", "gpu")
  try:
    cudnn = _load("cudnn")
  except ImportError as e:
    _warn_once(f"backend='auto': jax_cp's cuDNN extension is installed but "
               f"failed to load ({type(e).__name__}: {e}); using the 'xla' "
               f"backend, which materialises [T, T] scores per head.")
    cudnn = None
  else:
    if cudnn is None and on_gpu:
      _warn_once(f"backend='auto' on a GPU without jax_cp's cuDNN extension: "
                 f"using the 'xla' backend, which materialises [T, T] "
                 f"scores per head (memory grows with T^2). To build the "
                 f"extension, {BUILD_HINT}.")
  if cudnn is not None and cudnn.is_available(platform):
    return cudnn
  return _load("xla")


def resolve_backend(name: str, platform: str | None = None
                    ) -> AttentionBackend:
  """Returns the backend for ``name`` on ``platform`` (default: JAX's).

  ``"auto"`` picks ``"cudnn"`` when it loads and runs on the platform, else
  ``"xla"``. An explicit name is used as given, whatever the platform (a
  program may be lowered for CUDA on a CPU-only machine); an unknown or
  unbuilt one raises ``ValueError`` saying how to get it, and a cudnn
  extension that fails to load raises its ``ImportError``.
  """
  if not isinstance(name, str):
    raise ValueError(f"backend must be a string, got {name!r}")
  if name == "auto":
    return _auto(platform or jax.default_backend())
  backend = _load(name)
  if backend is None:
    hint = ""
    if name == "cudnn":
      hint = f" The cuDNN extension is not built: {BUILD_HINT}."
    raise ValueError(
        f"backend={name!r} is not available; available backends: "
        f"{sorted(registered_backends()) + ['auto']}.{hint}")
  return backend
