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
