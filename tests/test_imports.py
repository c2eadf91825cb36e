"""The package's import structure: no module reaches for another module's
underscore names, and the host-side modules import one way only
(``cost_model`` -> ``document_order`` -> ``host_metadata``,
``pair_counts``)."""

import ast
import pathlib

import pytest

import jax_cp

ROOT = pathlib.Path(jax_cp.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  return ".".join(("jax_cp",) + path.relative_to(ROOT).with_suffix("").parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: pathlib.Path):
  """``(imported jax_cp modules, names the module takes from them)``: the
  names as ``module.name``, from ``from m import name`` and from attribute
  reads ``alias.name`` of an imported module."""
  tree = ast.parse(path.read_text())
  modules, names, aliases = set(), set(), {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in MODULES:
          modules.add(a.name)
          aliases[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "jax_cp"):
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in MODULES:
          modules.add(full)
          aliases[a.asname or a.name] = full
        else:
          modules.add(node.module)
          names.add(full)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases):
      names.add(f"{aliases[node.value.id]}.{node.attr}")
  return modules, names


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_takes_another_modules_private_names(module):
  _, names = _imports(MODULES[module])
  private = sorted(n for n in names
                   if n.rsplit(".", 1)[1].startswith("_")
                   and not n.rsplit(".", 1)[1].startswith("__")
                   and n.rsplit(".", 1)[0] != module)
  assert not private, private


@pytest.mark.parametrize("module, never", [
    ("jax_cp.document_order", {"jax_cp.cost_model"}),
    ("jax_cp.host_metadata", {"jax_cp.cost_model", "jax_cp.document_order"}),
    ("jax_cp.pair_counts", {"jax_cp.cost_model", "jax_cp.document_order"}),
])
def test_host_modules_import_one_way(module, never):
  modules, _ = _imports(MODULES[module])
  assert not modules & never, modules & never
