"""The backend table (jax_cp.attention.registry): loading, fallbacks and
their warnings, a broken extension surfaced, and no import cycle."""

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings

import pytest

from jax_cp.attention import registry
from jax_cp.attention.backend import Backend


@pytest.fixture
def fresh_registry(monkeypatch):
  """The registry with no backend loaded and no warning given."""
  monkeypatch.setattr(registry, "_BACKENDS", {})
  monkeypatch.setattr(registry, "_WARNED", set())
  return registry


def _no_extension(monkeypatch):
  real = importlib.util.find_spec

  def find_spec(name, *args):
    if name == "jax_cp._jax_cp_cuda":
      return None
    return real(name, *args)
  monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _broken_extension(monkeypatch, calls):
  """The extension exists, but importing the cudnn module fails the way a
  library with an undefined symbol does."""
  real_find, real_import = importlib.util.find_spec, importlib.import_module

  def find_spec(name, *args):
    if name == "jax_cp._jax_cp_cuda":
      return object()
    return real_find(name, *args)

  def import_module(name, *args):
    if name == "jax_cp.attention.cudnn":
      calls.append(name)
      raise ImportError("_jax_cp_cuda.so: undefined symbol: cudnnFoo")
    return real_import(name, *args)
  monkeypatch.setattr(importlib.util, "find_spec", find_spec)
  monkeypatch.setattr(importlib, "import_module", import_module)


def _caught(fn):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = fn()
  return result, [str(w.message) for w in caught]


def test_auto_on_gpu_without_extension_warns_once(fresh_registry,
                                                  monkeypatch):
  _no_extension(monkeypatch)
  backend, first = _caught(lambda: registry.resolve_backend("auto", "cuda"))
  assert backend.name == "xla"
  assert len(first) == 1 and 'pip install -e ".[cuda13]"' in first[0]
  _, second = _caught(lambda: registry.resolve_backend("auto", "cuda"))
  assert second == []
  # On a CPU the xla backend is the right choice: no warning.
  fresh_registry._WARNED.clear()
  _, cpu = _caught(lambda: registry.resolve_backend("auto", "cpu"))
  assert cpu == []
  with pytest.raises(ValueError, match=r"cuda13"):
    registry.resolve_backend("cudnn")


def test_broken_extension_is_surfaced_and_retried(fresh_registry,
                                                  monkeypatch):
  calls = []
  _broken_extension(monkeypatch, calls)
  with pytest.raises(ImportError, match="undefined symbol: cudnnFoo"):
    registry.resolve_backend("cudnn")
  backend, first = _caught(lambda: registry.resolve_backend("auto", "cuda"))
  assert backend.name == "xla"
  assert len(first) == 1 and "undefined symbol: cudnnFoo" in first[0]
  _, second = _caught(lambda: registry.resolve_backend("auto", "cuda"))
  assert second == []
  # Every request tried the import again: a failure is not remembered.
  assert len(calls) == 3
  with pytest.raises(ImportError, match="undefined symbol"):
    registry.resolve_backend("cudnn")
  assert len(calls) == 4


def test_unknown_backend_and_user_backend(fresh_registry):
  with pytest.raises(ValueError, match="backend='nope' is not available"):
    registry.resolve_backend("nope")
  xla = registry.resolve_backend("xla")
  mine = Backend(name="mine", forward=xla.forward, backward=xla.backward,
                 is_available=xla.is_available)
  registry.register_backend(mine)
  assert registry.resolve_backend("mine") is mine
  assert "mine" in registry.registered_backends()
  assert not xla.supports_in_place


@pytest.mark.parametrize("module", [
    "jax_cp.attention.backend", "jax_cp.attention.xla",
    "jax_cp.attention.registry", "jax_cp.attention.cudnn",
    "jax_cp.call_plan", "jax_cp.cp_vjp", "jax_cp.context_parallel"])
def test_each_module_imports_alone(module):
  """A fresh interpreter imports the module first (the cudnn module only
  where its extension exists)."""
  code = (f"import importlib.util, sys\n"
          f"if {module!r}.endswith('cudnn') and "
          f"importlib.util.find_spec('jax_cp._jax_cp_cuda') is None:\n"
          f"  sys.exit(0)\n"
          f"import {module}\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["backend", "xla", "cudnn", "merge"])
def test_backend_modules_do_not_import_the_registry(name):
  """The registry imports the backends, never the other way round."""
  path = pathlib.Path(registry.__file__).with_name(f"{name}.py")
  imported = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom):
      imported.add(node.module)
      imported.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      imported.update(a.name for a in node.names)
  assert not any(m and m.startswith("jax_cp.attention.registry")
                 for m in imported), imported
  assert "jax_cp.attention.api" not in imported
