"""The table of attention backends and the choice of one by name.

The built-in backends are listed in :data:`BUILTIN_BACKENDS` and imported
here, on first use, and nowhere else: the backend modules do not import
this one. ``xla`` is always there; ``cudnn`` when the compiled extension
module ``jax_cp._jax_cp_cuda`` exists. An extension that exists but fails
to load (an undefined symbol, a missing CUDA library) is not hidden:
``backend="cudnn"`` raises its error and ``backend="auto"`` warns once with
it and falls back to ``xla``. A failed load is retried on the next request.

``backend="auto"`` also runs on ``xla`` the inputs cuDNN does not take:
q/k/v that are not bfloat16 or float16 (float32, say) run on the ``xla``
backend, with one ``logging`` warning per dtype saying so (logger
``jax_cp.attention.registry``). ``backend="cudnn"`` with such inputs
raises ``ValueError``.

:func:`register_backend` adds a user backend (any
:class:`~jax_cp.attention.backend.AttentionBackend`) under its name.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings

import jax
import numpy as np

from jax_cp.attention.backend import AttentionBackend, in_deterministic_mode
from jax_cp.attention.determinism import resolve_deterministic

#: name -> (module defining ``BACKEND``, extension module it needs or None).
BUILTIN_BACKENDS: dict[str, tuple[str, str | None]] = {
    "xla": ("jax_cp.attention.xla", None),
    "cudnn": ("jax_cp.attention.cudnn.backend", "jax_cp._jax_cp_cuda"),
}

#: How to build the cuDNN extension (named in errors and warnings).
BUILD_HINT = ('on a GPU machine with a C++ compiler (no CUDA toolkit '
              'needed), install jax_cp with its extension: '
              'pip install -e ".[cuda13]" -C cuda=13 '
              '(docs/gpu.md)')

# Backends loaded so far or registered by users, and the warnings given.
_BACKENDS: dict[str, AttentionBackend] = {}
_WARNED: set = set()
_LOG = logging.getLogger(__name__)


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


def _log_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    _LOG.warning(message)


def _takes_dtype(backend: AttentionBackend, dtype) -> bool:
  """Whether ``backend`` takes q/k/v of ``dtype`` (None: not known yet)."""
  dtypes = getattr(backend, "dtypes", None)
  return dtype is None or dtypes is None or np.dtype(dtype) in tuple(
      np.dtype(d) for d in dtypes)


#: The largest float32 score matrix (bytes, ``Hq * Tq * Tkv * 4`` of one
#: call) that ``backend="auto"`` hands to the ``xla`` backend for q/k/v of
#: a dtype cuDNN does not take, where cuDNN would otherwise run; past it
#: ``auto`` raises instead of falling back (4 GiB: a 16-head call of 16k
#: tokens).
AUTO_XLA_FALLBACK_SCORE_BYTES = 2**32


def _auto(platform: str, dtype=None, score_bytes=None) -> AttentionBackend:
  """cudnn when it loads, runs on ``platform`` and takes ``dtype``, else xla
  (with a warning once when the platform is a GPU, and a log line once per
  dtype cudnn does not take). A dtype cudnn does not take raises
  ``ValueError`` where the xla backend's scores would exceed
  :data:`AUTO_XLA_FALLBACK_SCORE_BYTES`."""
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
    if _takes_dtype(cudnn, dtype):
      return cudnn
    takes = " or ".join(np.dtype(d).name for d in cudnn.dtypes)
    if score_bytes is not None and \
        score_bytes > AUTO_XLA_FALLBACK_SCORE_BYTES:
      raise ValueError(
          f"backend='auto': q/k/v are {np.dtype(dtype).name}, which the "
          f"cuDNN backend does not take ({takes}), and the 'xla' backend "
          f"would materialise {score_bytes / 2**30:.1f} GiB of float32 "
          f"scores for this call (Hq * Tq * Tkv * 4 bytes; the limit for "
          f"falling back is {AUTO_XLA_FALLBACK_SCORE_BYTES / 2**30:.0f} "
          f"GiB). Cast q/k/v to bfloat16 to run on cuDNN, or pass "
          f"backend='xla' to run the quadratic backend anyway.")
    _log_once(f"backend='auto': q/k/v are {np.dtype(dtype).name} and the "
              f"cuDNN backend takes {takes}: running attention on the 'xla' "
              f"backend, which materialises [T, T] scores per head; cast "
              f"q/k/v to bfloat16 to run on cuDNN.")
  return _load("xla")


def resolve_backend(name: str, platform: str | None = None, dtype=None,
                    score_bytes: int | None = None,
                    deterministic: bool | None = False) -> AttentionBackend:
  """Returns the backend for ``name`` on ``platform`` (default: JAX's).

  ``"auto"`` picks ``"cudnn"`` when it loads, runs on the platform and takes
  q/k/v of ``dtype`` (bfloat16 or float16), else ``"xla"``. Inputs of
  another dtype (float32, say) on a platform where cuDNN would run go to
  ``"xla"`` with one ``logging`` warning per dtype saying so: a float32
  model runs, on the backend that materialises ``[T, T]`` scores, up to
  :data:`AUTO_XLA_FALLBACK_SCORE_BYTES` of them per call (``score_bytes``),
  past which ``"auto"`` raises ``ValueError`` naming the size. An
  explicit name is used as given, whatever the platform (a program may be
  lowered for CUDA on a CPU-only machine) and the dtype (``"cudnn"`` raises
  ``ValueError`` on float32 inputs when it is called); an unknown or
  unbuilt one raises ``ValueError`` saying how to get it, and a cudnn
  extension that fails to load raises its ``ImportError``.

  Args:
    name: ``"auto"``, ``"xla"``, ``"cudnn"`` or a registered backend's name.
    platform: the JAX platform the attention runs on (``"cpu"``,
      ``"cuda"``, ``"gpu"``); None: ``jax.default_backend()``.
    dtype: the q/k/v dtype, for ``"auto"``'s choice; None: not known (the
      choice then ignores the dtype).
    score_bytes: ``Hq * Tq * Tkv * 4``, the float32 scores the ``xla``
      backend would hold for the call (None: not known).
    deterministic: the deterministic mode (docs/determinism.md): True
      returns the backend with its deterministic backward
      (:func:`~jax_cp.attention.backend.in_deterministic_mode`), None
      does so when XLA was asked for deterministic execution
      (:func:`~jax_cp.attention.determinism.xla_requests_determinism`),
      False (the default here) returns it as registered.

  A backend with a ``configure`` function comes back as it configures it
  (the cudnn backend with its scratch bound from
  ``JAX_CP_CUDNN_BWD_SCRATCH_GIB``), read here, once per call, and not
  while attention is traced.

  Raises:
    ValueError: an unknown or unbuilt backend, a bad ``deterministic``, or
      the mode on for a backend without a deterministic backward.
  """
  backend = _resolve(name, platform, dtype, score_bytes)
  configure = getattr(backend, "configure", None)
  if configure is not None:
    backend = configure(backend)
  return in_deterministic_mode(backend, resolve_deterministic(deterministic))


def _resolve(name: str, platform: str | None, dtype,
             score_bytes: int | None) -> AttentionBackend:
  """:func:`resolve_backend` before the deterministic mode."""
  if not isinstance(name, str):
    raise ValueError(f"backend must be a string, got {name!r}")
  if name == "auto":
    return _auto(platform or jax.default_backend(), dtype, score_bytes)
  backend = _load(name)
  if backend is None:
    hint = ""
    if name == "cudnn":
      hint = f" The cuDNN extension is not built: {BUILD_HINT}."
    raise ValueError(
        f"backend={name!r} is not available; available backends: "
        f"{sorted(registered_backends()) + ['auto']}.{hint}")
  return backend
