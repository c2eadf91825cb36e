"""The prose of README.md, docs/ and the library's docstrings describes the
code as it is: no sentence narrates history (CHANGELOG.md and git keep
it), no docstring carries a measured number, and every measured number in
docs/ names the result file it comes from."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PROSE = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOCS]
LIBRARY = sorted((ROOT / "jax_cp").rglob("*.py"))

# Sentences that tell what the code did, not what it does.
HISTORY = [
    r"\bbefore (that|the|this) (fix|change)",
    r"\bearlier (runs?|versions?|code|plans?|loops?)\b",
    r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bwas )(?<!\bwere )"
    r"\bused to\b",
    r"\bno longer\b",
    r"\bnow\b[^.]{0,80}\binstead\b",
    r"\bpreviously\b",
    r"\bformerly\b",
    r"\bis now\b",
    r"\bhas been (replaced|removed|renamed|changed)\b",
]
_HISTORY = re.compile("|".join(HISTORY), flags=re.I)

# A measured quantity: a number with a unit of time, memory, throughput or
# a ratio.
_MEASURED = re.compile(
    r"\d[\d,]*(\.\d+)?(\s?(ms|s per step|GB|GiB|MB|TFLOP/s|tok/s|%)"
    r"(?![\w])|×(?!\s?\d))")
_SOURCE = re.compile(r"benchmarks/results/|\.json\b|\bby\s+the\s+formula\b",
                     flags=re.I)


def _docstrings(path: pathlib.Path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node)
      if doc:
        yield getattr(node, "name", path.name), doc


def _history(text: str) -> list[str]:
  flat = re.sub(r"\s+", " ", text)
  return [m.group(0) for m in _HISTORY.finditer(flat)]


@pytest.mark.parametrize("path", PROSE, ids=lambda p: p.name)
def test_prose_narrates_no_history(path):
  assert not _history(path.read_text()), path


@pytest.mark.parametrize("path", LIBRARY,
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docstrings_narrate_no_history_and_carry_no_measurement(path):
  for name, doc in _docstrings(path):
    assert not _history(doc), (path, name, _history(doc))
    flat = re.sub(r"\s+", " ", doc)
    assert not re.search(r"\bH[12]00\b|\d\.\d+x\b|\d\.\d+×", flat), (
        path, name)


def _units(text: str):
  """Paragraphs, and table rows one by one."""
  for para in re.split(r"\n\s*\n", text):
    if para.lstrip().startswith("|"):
      yield from para.splitlines()
    else:
      yield para


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_measured_number_in_docs_names_its_result_file(path):
  bad = [u.strip()[:120] for u in _units(path.read_text())
         if _MEASURED.search(u) and not _SOURCE.search(u)]
  assert not bad, bad


_REFERENCE = re.compile(r"docs/(\w+)\.md, \"?([A-Z][A-Za-z -]*[a-z])")


def _sections(page: str) -> set[str]:
  text = (ROOT / "docs" / f"{page}.md").read_text()
  return (set(re.findall(r"^#+ (.+)$", text, flags=re.M))
          | set(re.findall(r"\*\*([^*.]+)\.\*\*", text)))


@pytest.mark.parametrize("path", [*PROSE, *LIBRARY,
                                  *sorted((ROOT / "csrc").glob("*.[hc]*"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_to_a_docs_section_finds_it(path):
  flat = re.sub(r"\s+(//\s*)?", " ", path.read_text())
  for page, section in _REFERENCE.findall(flat):
    assert (ROOT / "docs" / f"{page}.md").exists(), (path, page)
    names = _sections(page)
    assert any(section.startswith(n) for n in names), (path, page, section,
                                                       sorted(names))


def test_the_rules_catch_what_they_are_for():
  for sentence in ("Lengths measured before that fix ran.",
                   "1.74x in earlier runs, on other machines.",
                   "That code used to zero-fill every layer's dq.",
                   "It no longer runs a cond.",
                   "The loop now writes in place instead."):
    assert _history(sentence), sentence
  for sentence in ("The bound is used to size the kernels.",
                   "A halo call runs before the local call.",
                   "Each call is now one of three kinds."):
    assert not _history(sentence) or "is now" in sentence, sentence
  assert _MEASURED.search("took 3.68 ms against 3.36 ms")
  assert _MEASURED.search("1.09× the step") and _MEASURED.search("12 GB")
  assert not _SOURCE.search("took 3.68 ms")
  assert _SOURCE.search("(benchmarks/results/cp.md)")


def _public():
  import jax_cp
  import jax_cp.flax
  import jax_cp.nnx
  for mod in (jax_cp, jax_cp.nnx, jax_cp.flax, jax_cp.data, jax_cp.planning):
    for name in mod.__all__:
      obj = getattr(mod, name)
      if callable(obj) or isinstance(obj, type):
        yield f"{mod.__name__}.{name}", obj


@pytest.mark.parametrize("name, obj", list(_public()), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_every_public_name_points_at_its_docs_page(name, obj):
  """The top-level names and the modules' classes point at the docs page
  that explains them (data and planning helpers: their package's
  docstring does, docs/data.md)."""
  import inspect
  doc = inspect.getdoc(obj) or ""
  if name.startswith(("jax_cp.data.", "jax_cp.planning.")):
    import jax_cp
    pkg = jax_cp.data if name.startswith("jax_cp.data.") else jax_cp.planning
    doc = inspect.getdoc(pkg)
  pages = re.findall(r"docs/(\w+)\.md", doc)
  assert pages, name
  assert all((ROOT / "docs" / f"{p}.md").exists() for p in pages), name


def _ffi_handler_files() -> dict[str, set[str]]:
  """``{csrc file: the FFI targets whose handler it defines}``, the handler
  symbols mapped to their targets' roles by module.cc's table."""
  csrc = ROOT / "csrc"
  table = (csrc / "module.cc").read_text()
  role_of = {symbol: role for role, symbol in re.findall(
      r'\{"(\w+)",\s*jax_cp::k\w+,\s*(\w+)\}', table)}
  files = {}
  for path in sorted(csrc.glob("*.cc")):
    symbols = re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)",
                         path.read_text())
    if symbols:
      files[path.name] = {role_of[s] for s in symbols}
  return files


def test_each_ffi_handler_file_holds_one_operation_and_internals_names_it():
  """docs/internals.md (Packages): a csrc/ file named for an operation
  defines that operation's handlers, its ``_out``/``_into`` variants
  included, and no other file defines one."""
  files = _ffi_handler_files()
  assert sum(len(roles) for roles in files.values()) == 6, files
  text = re.sub(r"\s+", " ", (ROOT / "docs" / "internals.md").read_text())
  handlers = text[text.index("`csrc/` holds"):text.index("The SDPA handlers")]
  assert set(re.findall(r"`(\w+\.cc)`", handlers)) == set(files)
  for name, roles in files.items():
    operations = {re.sub(r"_(out|into)$", "", role) for role in roles}
    assert len(operations) == 1, (name, roles)
