"""The backend table (jax_cp.attention.registry): loading, fallbacks and
their warnings, ``auto``'s dtype rule, a broken extension surfaced, and no
import cycle."""

import ast
import importlib
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp.attention import registry
from jax_cp.attention.backend import Backend
from tests import reference as ref


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
    if name == "jax_cp.attention.cudnn.backend":
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


def _fake_cudnn(calls, platforms=("cuda", "gpu")):
  """A stand-in for the cuDNN backend (the extension need not be built):
  available on ``platforms``, bfloat16 or float16 only (a ValueError on
  anything else, as the real one raises), computing with the xla backend
  and counting its forward calls in ``calls``."""
  xla = registry.resolve_backend("xla")
  dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

  def forward(q, k, v, seg, **kw):
    if q.dtype not in dtypes:
      raise ValueError(f"fake cudnn got q.dtype={q.dtype}")
    calls.append(q.dtype)
    return xla.forward(q, k, v, seg, **kw)
  return Backend(name="cudnn", forward=forward, backward=xla.backward,
                 is_available=lambda platform: platform in platforms,
                 dtypes=dtypes)


def _auto_lines(caplog):
  return [r.getMessage() for r in caplog.records
          if r.name == registry.__name__]


def test_auto_runs_float32_on_xla_with_one_log_line(fresh_registry, caplog):
  """Where cuDNN would be picked, float32 q/k/v go to xla with one logged
  warning per dtype; bfloat16 and float16 go to cuDNN, without a line."""
  registry.register_backend(_fake_cudnn([]))
  caplog.set_level("WARNING", logger=registry.__name__)
  assert registry.resolve_backend("auto", "cuda", jnp.float32).name == "xla"
  lines = _auto_lines(caplog)
  assert len(lines) == 1
  assert "float32" in lines[0] and "'xla'" in lines[0]
  assert "bfloat16" in lines[0]
  assert registry.resolve_backend("auto", "gpu", np.float32).name == "xla"
  assert len(_auto_lines(caplog)) == 1                 # once per dtype
  assert registry.resolve_backend("auto", "cuda", jnp.float64).name == "xla"
  assert len(_auto_lines(caplog)) == 2 and "float64" in _auto_lines(
      caplog)[1]
  for dtype in (jnp.bfloat16, jnp.float16):
    assert registry.resolve_backend("auto", "cuda", dtype).name == "cudnn"
  # Where cuDNN does not run, xla is the plain choice: no line.
  assert registry.resolve_backend("auto", "cpu", jnp.float32).name == "xla"
  # An explicit name is used as given, whatever the dtype.
  assert registry.resolve_backend("cudnn", "cuda",
                                  jnp.float32).name == "cudnn"
  assert len(_auto_lines(caplog)) == 2


def test_auto_raises_where_the_float32_fallback_would_be_huge(
    fresh_registry, caplog):
  """Past AUTO_XLA_FALLBACK_SCORE_BYTES of xla scores, "auto" raises a
  ValueError naming the dtype and the size instead of falling back; at the
  limit it still falls back; an explicit "xla" is never refused."""
  registry.register_backend(_fake_cudnn([]))
  limit = registry.AUTO_XLA_FALLBACK_SCORE_BYTES
  assert registry.resolve_backend("auto", "cuda", jnp.float32,
                                  score_bytes=limit).name == "xla"
  with pytest.raises(ValueError, match=r"float32.*8\.0 GiB.*bfloat16"):
    registry.resolve_backend("auto", "cuda", jnp.float32,
                             score_bytes=2 * limit)
  assert registry.resolve_backend("xla", "cuda", jnp.float32,
                                  score_bytes=2 * limit).name == "xla"
  # Where cuDNN does not run, xla is the plain choice at any size.
  assert registry.resolve_backend("auto", "cpu", jnp.float32,
                                  score_bytes=2 * limit).name == "xla"


def test_auto_fused_attention_rejects_a_long_float32_call(fresh_registry):
  """fused_attention passes the call's score size: a long float32 row with
  the fake cuDNN available raises before anything runs (abstract shapes)."""
  registry.register_backend(_fake_cudnn([], platforms=("cpu",)))
  t = 2**15
  q = jax.ShapeDtypeStruct((t, 2, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((t, 1, 8), jnp.float32)
  lens = jnp.array([t], jnp.int32)
  offs = jnp.array([0], jnp.int32)
  with pytest.raises(ValueError, match="GiB"):
    jax.eval_shape(lambda q, k: jax_cp.fused_attention(
        q, k, k, lens, lens, offs, offs, attn_mask_type="causal_top_left",
        backend="auto"), q, k)


def test_auto_attention_with_float32_runs_on_xla(fresh_registry, caplog):
  """fused_attention and cp_attention without CP, backend="auto", the fake
  cuDNN available on this platform: float32 inputs run on xla (the fake
  would raise on them) with the logged line, and match the reference;
  bfloat16 inputs run on the fake."""
  calls = []
  registry.register_backend(_fake_cudnn(calls, platforms=("cpu",)))
  caplog.set_level("WARNING", logger=registry.__name__)
  rng = np.random.default_rng(0)
  cu = np.array([0, 5, 11, 15], np.int32)
  cuP = np.array([0, 6, 12, 16], np.int32)
  q = rng.standard_normal((16, 2, 8)).astype(np.float32)
  k, v = (rng.standard_normal((16, 1, 8)).astype(np.float32)
          for _ in range(2))
  want = np.asarray(ref.attention(q, k, v, cu, cuP))
  valid = ref.valid_token_mask(cu, cuP)
  meta = (cu[1:] - cu[:-1], cu[1:] - cu[:-1], cuP[:-1], cuP[:-1])
  out = jax_cp.fused_attention(q, k, v, *meta,
                               attn_mask_type="causal_bottom_right",
                               backend="auto")
  assert out.dtype == jnp.float32 and calls == []
  assert ref.rel_err(np.asarray(out)[valid], want[valid]) < 1e-5
  assert len(_auto_lines(caplog)) == 1
  out = jax_cp.cp_attention(q, k, v, (cu, cuP),
                            layout=jax_cp.CPLayout(cp_axis=None,
                                                   backend="auto"))
  assert calls == [] and len(_auto_lines(caplog)) == 1
  assert ref.rel_err(np.asarray(out)[valid], want[valid]) < 1e-5
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out = jax_cp.fused_attention(bf(q), bf(k), bf(v), *meta,
                               attn_mask_type="causal_bottom_right",
                               backend="auto")
  assert calls == [jnp.dtype(jnp.bfloat16)]
  assert ref.rel_err(np.asarray(out, np.float32)[valid], want[valid]) < 2e-2
  assert len(_auto_lines(caplog)) == 1


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
    "jax_cp.attention.registry", "jax_cp.attention.cudnn.backend",
    "jax_cp.attention.decompose.straddle", "jax_cp.cp.strategies.call_plan",
    "jax_cp.cp.vjp", "jax_cp.cp.api"])
def test_each_module_imports_alone(module):
  """A fresh interpreter imports the module first (the cudnn module only
  where its extension exists)."""
  code = (f"import importlib.util, sys\n"
          f"if {module!r}.endswith('cudnn.backend') and "
          f"importlib.util.find_spec('jax_cp._jax_cp_cuda') is None:\n"
          f"  sys.exit(0)\n"
          f"import {module}\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["backend", "xla", "cudnn/backend",
                                  "cudnn/split", "decompose/merge"])
def test_backend_modules_do_not_import_the_registry(name):
  """The registry imports the backends, never the other way round."""
  path = pathlib.Path(registry.__file__).parent / f"{name}.py"
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
