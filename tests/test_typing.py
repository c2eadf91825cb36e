"""The public API is typed to its edges: every public function and module
method of ``jax_cp``, ``jax_cp.data``, ``jax_cp.planning``, ``jax_cp.nnx``
and ``jax_cp.flax`` annotates every parameter and its return, the
annotations resolve to real objects, and the package ships ``py.typed``
(PEP 561) so type checkers read them."""

from __future__ import annotations

import inspect
import pathlib
import typing

import pytest

import jax_cp
import jax_cp.flax
import jax_cp.nnx

PUBLIC = (jax_cp, jax_cp.data, jax_cp.planning, jax_cp.nnx, jax_cp.flax)


def _callables():
  for mod in PUBLIC:
    for name in mod.__all__:
      obj = getattr(mod, name)
      if inspect.isfunction(obj):
        yield f"{mod.__name__}.{name}", obj
      elif inspect.isclass(obj) and obj.__module__.startswith("jax_cp"):
        for meth in ("__init__", "__call__"):
          f = obj.__dict__.get(meth)
          if inspect.isfunction(f):
            yield f"{mod.__name__}.{name}.{meth}", f


CALLABLES = dict(_callables())


def test_py_typed_ships_with_the_package():
  assert (pathlib.Path(jax_cp.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_public_signatures_are_annotated(name):
  f = CALLABLES[name]
  sig = inspect.signature(f)
  missing = [p for p, v in sig.parameters.items()
             if p != "self" and v.annotation is inspect.Parameter.empty]
  assert not missing, f"{name}: parameters without a type: {missing}"
  if not name.endswith("__init__"):
    assert sig.return_annotation is not inspect.Signature.empty, (
        f"{name}: no return type")
  # Every annotation names something that exists (no typo in a string
  # annotation under `from __future__ import annotations`).
  hints = typing.get_type_hints(f)
  assert set(hints) >= set(sig.parameters) - {"self"}, name
