"""PEP 517 build backend of jax_cp: scikit-build-core plus the CUDA 13 build.

The CUDA build (the cuDNN extension ``jax_cp._jax_cp_cuda``) is requested with
the config setting ``cuda=13`` (``pip install -e ".[cuda13]" -C cuda=13``) or
the environment variable ``JAX_CP_BUILD_CUDA=1``. Then:

* ``get_requires_for_build_*`` adds the wheels the build compiles against,
  read from the ``cuda13`` extra in pyproject.toml (``jax[cuda13]`` becomes
  ``jax``: the build needs JAX's FFI headers, not its CUDA plugin). pip
  installs them into the isolated build environment; with
  ``--no-build-isolation`` the ``cuda13`` extra must already be installed.
* CMake gets ``JAX_CP_BUILD_CUDA=ON``: a missing prerequisite fails the build
  with one line instead of falling back to the pure-Python package.
* A missing C++ compiler fails at once, before any download.

Everything else is scikit-build-core's, unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path

from scikit_build_core import build as _skbuild

_CUDA_KEY = "cuda"
_CUDA_VERSIONS = ("13",)
_ENV = "JAX_CP_BUILD_CUDA"
# Written by get_requires_for_build_* (which frontends call to fill an
# isolated build environment); build_* reads it back when it runs in the same
# environment for the same frontend process.
_ISOLATED_MARKER = Path("build") / "jax_cp_isolated_cuda_build.json"


def _environment_id():
  """The build frontend's process and the environment it made for us."""
  return [os.getppid(), sys.prefix, os.environ.get("PYTHONPATH", "")]


def _cuda_requested(config_settings) -> bool:
  value = (config_settings or {}).get(_CUDA_KEY)
  if value is not None:
    if str(value) not in _CUDA_VERSIONS:
      raise SystemExit(f"jax_cp: unknown -C {_CUDA_KEY}={value}; supported: "
                       f"{', '.join(_CUDA_VERSIONS)}")
    return True
  return os.environ.get(_ENV, "").upper() in ("1", "ON", "TRUE", "YES")


def _strip(config_settings):
  """Our keys removed (scikit-build-core rejects unknown settings)."""
  return {k: v for k, v in (config_settings or {}).items() if k != _CUDA_KEY}


def _define(settings, name: str, value: str):
  settings[f"cmake.define.{name}"] = value
  return settings


def _check_compiler() -> None:
  cxx = os.environ.get("CXX")
  if cxx:
    if shutil.which(shlex.split(cxx)[0]):
      return
    raise SystemExit(f"jax_cp: the cuDNN extension needs a C++ compiler; "
                     f"CXX={cxx} is not found (install it or unset CXX)")
  if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
    raise SystemExit("jax_cp: the cuDNN extension needs a C++ compiler; none "
                     "found (install one, e.g. apt-get install g++, or set "
                     "CXX)")


def _check_jax_cuda_plugin() -> None:
  """The JAX the build runs with (a --no-build-isolation build) must have its
  CUDA 13 plugin; CMake checks again for builds that bypass this backend."""
  try:
    found = importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ImportError:
    found = False
  if not found:
    raise SystemExit("jax_cp: the cuDNN extension needs JAX's CUDA 13 plugin, "
                     "which this environment's JAX lacks (pip install "
                     "\"jax[cuda13]==0.11.2\", or pip install -e "
                     "\".[cuda13]\" -C cuda=13)")


def cuda13_build_requires() -> list[str]:
  """The ``cuda13`` extra of pyproject.toml, with ``jax[cuda13]`` as ``jax``."""
  with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
    extra = tomllib.load(f)["project"]["optional-dependencies"]["cuda13"]
  return [re.sub(r"^jax\[[^\]]*\]", "jax", r) for r in extra]


def _requires(config_settings, hook) -> list[str]:
  requires = list(hook(_strip(config_settings)))
  if _cuda_requested(config_settings):
    _check_compiler()
    requires += cuda13_build_requires()
    _ISOLATED_MARKER.parent.mkdir(exist_ok=True)
    _ISOLATED_MARKER.write_text(json.dumps(_environment_id()))
  return requires


def _settings(config_settings):
  settings = _strip(config_settings)
  if _cuda_requested(config_settings):
    _check_compiler()
    _define(settings, "JAX_CP_BUILD_CUDA", "ON")
    isolated = False
    if _ISOLATED_MARKER.exists():
      isolated = json.loads(_ISOLATED_MARKER.read_text()) == _environment_id()
      _ISOLATED_MARKER.unlink()
    # An isolated environment has the build wheels but not JAX's CUDA plugin
    # (the cuda13 extra installs it next to the built package).
    plugin_check = "cmake.define.JAX_CP_REQUIRE_JAX_CUDA_PLUGIN"
    if isolated and plugin_check not in settings:
      settings[plugin_check] = "OFF"
    if str(settings.get(plugin_check, "ON")).upper() not in ("OFF", "0",
                                                            "FALSE", "NO"):
      _check_jax_cuda_plugin()
  return settings


def get_requires_for_build_wheel(config_settings=None):
  return _requires(config_settings, _skbuild.get_requires_for_build_wheel)


def get_requires_for_build_editable(config_settings=None):
  return _requires(config_settings, _skbuild.get_requires_for_build_editable)


def get_requires_for_build_sdist(config_settings=None):
  return _skbuild.get_requires_for_build_sdist(_strip(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
  return _skbuild.prepare_metadata_for_build_wheel(metadata_directory,
                                                   _strip(config_settings))


def prepare_metadata_for_build_editable(metadata_directory,
                                        config_settings=None):
  return _skbuild.prepare_metadata_for_build_editable(metadata_directory,
                                                      _strip(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
  return _skbuild.build_wheel(wheel_directory, _settings(config_settings),
                              metadata_directory)


def build_editable(wheel_directory, config_settings=None,
                   metadata_directory=None):
  return _skbuild.build_editable(wheel_directory, _settings(config_settings),
                                 metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
  return _skbuild.build_sdist(sdist_directory, _strip(config_settings))
