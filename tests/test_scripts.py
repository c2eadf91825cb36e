"""The shell scripts of CI and the GPU suite parse, and none of their
checks reads a pipe with a consumer that exits early (``grep -q``,
``grep -m``, ``head``): under ``set -o pipefail`` the writer then dies of
SIGPIPE, the pipeline fails, and an ``if`` takes the failure for "not
found", so the check could pass whatever the log says."""

import pathlib
import re
import shutil
import subprocess

import pytest

from tests import _toolchain

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted([ROOT / ".ci" / "run", ROOT / ".ci" / "find_python",
                  ROOT / ".ci" / "hide_cuda_toolkit",
                  *(ROOT / "tests" / "gpu").glob("*.sh")])
# A pipe into grep with -q or -m among its short options, or into head.
_EARLY_EXIT = re.compile(r"\|\s*(grep\s+(-\w*[qm]\w*\b|.*\s-\w*[qm]\w*\b)|"
                         r"head\b)")


def _logical_lines(path: pathlib.Path):
  """The script's lines with backslash continuations joined and full-line
  comments dropped."""
  text = re.sub(r"\\\n", " ", path.read_text())
  return [line for line in text.splitlines()
          if not line.lstrip().startswith("#")]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(path):
  bash = shutil.which("bash")
  if bash is None:
    pytest.skip("no bash here")
  proc = subprocess.run([bash, "-n", str(path)], capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_pipe_into_an_early_exiting_reader(path):
  bad = [line for line in _logical_lines(path) if _EARLY_EXIT.search(line)]
  assert not bad, bad


def test_the_rule_catches_the_pipelines_it_is_for():
  for line in ('if grep -E "x" log | grep -q "y"; then',
               'grep a log | grep -qi b', 'cat log | head -n 1',
               'grep a log | grep -E -q b', 'grep a log | grep -m1 b'):
    assert _EARLY_EXIT.search(line), line
  for line in ('grep -q "y" <<< "$lines"', 'cmd 2>&1 | tee log',
               'grep -E -- "-- jax_cp:|Linking" log'):
    assert not _EARLY_EXIT.search(line), line


# tests/gpu/asan_preload.sh: which runtimes an ASan build runs under.
ASAN_PRELOAD = ROOT / "tests" / "gpu" / "asan_preload.sh"


def _compiler_with_asan() -> str:
  cxx = _toolchain.cxx()
  if cxx is None or shutil.which("bash") is None:
    pytest.skip("no C++ compiler or bash here")
  if _toolchain.asan_runtime(cxx) is None:
    pytest.skip(f"{cxx} has no AddressSanitizer runtime")
  return cxx


def _preload(cxx, *args):
  return subprocess.run([str(ASAN_PRELOAD), *map(str, args)],
                        capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
                             "CXX": str(cxx)}, timeout=120)


def test_asan_preload_gives_the_compilers_runtimes(tmp_path):
  cxx = _compiler_with_asan()
  run = _preload(cxx)
  assert run.returncode == 0, run.stderr
  asan, cxxrt = run.stdout.split()
  assert pathlib.Path(asan).name.startswith("libasan.so")
  assert pathlib.Path(cxxrt).name.startswith("libstdc++.so")
  assert asan.startswith("/") and pathlib.Path(asan).exists()
  assert cxxrt.startswith("/") and pathlib.Path(cxxrt).exists()


def test_asan_preload_without_the_compilers_cxx_runtime(tmp_path):
  """A toolchain beside the system's can know its libasan.so and no shared
  libstdc++ (`-print-file-name` answers the bare name): the C++ runtime
  then is the one the module loads, else the loader cache's."""
  cxx = _compiler_with_asan()
  fake = tmp_path / "c++"
  fake.write_text(
      "#!/usr/bin/env bash\n"
      'case "$*" in *-print-file-name=libstdc++*) '
      'echo "${1#-print-file-name=}"; exit 0;; esac\n'
      f'exec {cxx} "$@"\n')
  fake.chmod(0o755)
  src = tmp_path / "m.cc"
  src.write_text("#include <string>\n"
                 "std::string jax_cp_probe() {\n"
                 "  return std::string(40, 'x');\n}\n")
  module = tmp_path / "libm.so"
  subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(module)],
                 check=True, timeout=120)
  ldd = subprocess.run(["ldd", str(module)], capture_output=True,
                       text=True).stdout
  linked = [line.split()[2] for line in ldd.splitlines()
            if line.split()[:1] == ["libstdc++.so.6"]]
  run = _preload(fake, module)
  assert run.returncode == 0, run.stderr
  asan, cxxrt = run.stdout.split()
  assert pathlib.Path(asan).name.startswith("libasan.so")
  assert cxxrt == linked[0]
  # No module: the loader cache's copy.
  run = _preload(fake)
  assert run.returncode == 0, run.stderr
  assert run.stdout.split()[1].endswith("libstdc++.so.6")
  assert pathlib.Path(run.stdout.split()[1]).exists()


def test_asan_preload_fails_naming_what_is_missing(tmp_path):
  if shutil.which("bash") is None:
    pytest.skip("no bash here")
  run = _preload("/bin/false")
  assert run.returncode == 1
  assert "libasan.so" in run.stderr and "/bin/false" in run.stderr
  assert run.stdout == ""
