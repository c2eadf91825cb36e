"""The import structure: packages that show the architecture.

* Every import between jax_cp's packages runs downward in the layering of
  docs/internals.md (checkpoint names < attention < cp < planning < data <
  modules < flax, nnx < the top-level package), imports inside functions
  included, and the Linen and NNX packages do not import each other.
* No module of jax_cp, and none of benchmarks/, imports in a circle.
* No module reaches for another module's underscore names.
* Inside ``jax_cp.cp``, its modules and subpackages (a subpackage one
  unit) stand on at most :data:`CP_MOST_FLOORS` floors: a unit's floor is
  one above the highest it imports (docs/internals.md, Packages).
* The cuDNN backend's modules (``jax_cp.attention.cudnn``) are imported by
  one another alone: the registry loads the backend by name, and the CP
  layer reads what it needs of a backend from the backend contract
  (``scratch_limit``, ``handles_poison``, ...).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The layer of each package (docs/internals.md, Packages).
LAYERS = {
    "jax_cp.checkpoint_names": 0,
    "jax_cp.typing": 0,
    "jax_cp.attention": 1,
    "jax_cp.cp": 2,
    "jax_cp.planning": 3,
    "jax_cp.data": 4,
    "jax_cp.modules": 5,
    "jax_cp.flax": 6,
    "jax_cp.nnx": 6,
    "jax_cp": 7,
}


def _modules(top: str) -> dict[str, pathlib.Path]:
  base = ROOT / top
  out = {}
  for path in sorted(base.rglob("*.py")):
    parts = (top,) + path.relative_to(base).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


LIBRARY = _modules("jax_cp")
BENCHMARKS = _modules("benchmarks")


def _edges(name: str, path: pathlib.Path, known: dict) -> tuple[set, set]:
  """``(modules imported, names taken from them)`` by the module ``name``:
  an ``import a.b`` or ``from a import b`` of a known module is an edge to
  it, ``from a import x`` of a name an edge to ``a``; imports anywhere in
  the file, relative ones resolved."""
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  modules, names = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      modules |= {a.name for a in node.names if a.name in known}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      for a in node.names:
        full = f"{base}.{a.name}"
        if full in known:
          modules.add(full)
        elif base in known:
          modules.add(base)
          names.add(full)
  modules.discard(name)
  return modules, names


def _graph(known: dict) -> dict[str, set]:
  return {n: _edges(n, p, known)[0] for n, p in known.items()}


def _package(module: str) -> str:
  for depth in (3, 2, 1):
    head = ".".join(module.split(".")[:depth])
    if head in LAYERS and (depth == 1 or head != "jax_cp"):
      return head
  raise AssertionError(module)


def _cycle(graph: dict[str, set]) -> list[str] | None:
  """A circle of imports, or None."""
  state, stack = {}, []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for m in sorted(graph.get(n, ())):
      if state.get(m) == "open":
        return stack[stack.index(m):] + [m]
      if m not in state and (found := visit(m)):
        return found
    state[n] = "done"
    stack.pop()
    return None

  for n in sorted(graph):
    if n not in state and (found := visit(n)):
      return found
  return None


def _upward(graph: dict[str, set]) -> list[tuple[str, str]]:
  bad = []
  for a, targets in graph.items():
    for b in targets:
      pa, pb = _package(a), _package(b)
      if pa != pb and (LAYERS[pa] <= LAYERS[pb]):
        bad.append((a, b))
  return sorted(bad)


def test_every_package_has_a_layer():
  assert {_package(m) for m in LIBRARY} == set(LAYERS)


def test_no_import_runs_upward_or_sideways():
  assert not _upward(_graph(LIBRARY))


@pytest.mark.parametrize("known", [LIBRARY, BENCHMARKS],
                         ids=["jax_cp", "benchmarks"])
def test_no_import_circle(known):
  assert _cycle(_graph(known)) is None, _cycle(_graph(known))


#: The cuDNN backend's package: no module outside it imports its modules.
CUDNN = "jax_cp.attention.cudnn"


def _outside_imports_of(package: str, graph: dict[str, set]
                        ) -> list[tuple[str, str]]:
  inside = lambda m: m == package or m.startswith(package + ".")
  return sorted((a, b) for a, targets in graph.items() if not inside(a)
                for b in targets if inside(b))


def test_only_the_cudnn_package_imports_its_modules():
  assert not _outside_imports_of(CUDNN, _graph(LIBRARY))


def test_the_checks_catch_what_they_are_for():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None
  assert _upward({"jax_cp.cp.vjp": {"jax_cp.modules.remat"}}) == [
      ("jax_cp.cp.vjp", "jax_cp.modules.remat")]
  assert _upward({"jax_cp.flax.attention": {"jax_cp.nnx.convert"}})
  assert not _upward({"jax_cp.modules.inputs": {"jax_cp.cp.api"}})
  assert _outside_imports_of(CUDNN, {
      "jax_cp.cp.exchange.ring": {"jax_cp.attention.cudnn.workspace"},
      "jax_cp.attention.cudnn.split": {"jax_cp.attention.head_groups"}}) == [
          ("jax_cp.cp.exchange.ring", "jax_cp.attention.cudnn.workspace")]


@pytest.mark.parametrize("module", sorted(LIBRARY))
def test_no_module_takes_another_modules_private_names(module):
  _, names = _edges(module, LIBRARY[module], LIBRARY)
  private = sorted(n for n in names
                   if n.rsplit(".", 1)[1].startswith("_")
                   and not n.rsplit(".", 1)[1].startswith("__"))
  assert not private, private


#: The most floors the units of ``jax_cp.cp`` may stand on.
CP_MOST_FLOORS = 6


def _unit(module: str, package: str) -> str | None:
  """The unit of ``package`` that holds ``module`` (a module or a
  subpackage directly under it), None outside it; the package's own
  ``__init__`` is a unit of its own."""
  if module == package:
    return package
  if not module.startswith(package + "."):
    return None
  return package + "." + module[len(package) + 1:].split(".")[0]


def _floors(graph: dict[str, set], package: str) -> dict[str, int]:
  """Each unit's floor: 1 for one that imports no other unit of
  ``package``, else one above the highest floor it imports."""
  units: dict[str, set] = {}
  for a, targets in graph.items():
    ua = _unit(a, package)
    if ua is None:
      continue
    units.setdefault(ua, set())
    units[ua] |= {u for b in targets
                  if (u := _unit(b, package)) not in (None, ua)}
  floors: dict[str, int] = {}

  def floor(u: str, seen: tuple = ()) -> int:
    if u not in floors:
      assert u not in seen, seen + (u,)
      floors[u] = 1 + max((floor(v, seen + (u,)) for v in units.get(u, ())),
                          default=0)
    return floors[u]

  for u in units:
    floor(u)
  return floors


def test_cp_stands_on_few_floors():
  floors = _floors(_graph(LIBRARY), "jax_cp.cp")
  top = max(floors.values())
  assert top <= CP_MOST_FLOORS, sorted(floors.items(), key=lambda x: -x[1])


def test_the_floor_count_sees_a_chain():
  chain = {f"p.m{i}": {f"p.m{i + 1}"} for i in range(7)}
  chain["p.m7"] = {"p.sub.a"}
  chain["p.sub.a"] = {"p.sub.b"}     # inside one unit: no floor
  floors = _floors(chain, "p")
  assert floors["p.m0"] == 9 and floors["p.sub"] == 1
