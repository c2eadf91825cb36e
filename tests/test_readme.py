"""Every code block of README.md runs as a test, one test per block.

The Python blocks run here, as written (8 virtual CPU devices), and their
results are checked against independent references. The bash blocks are
the README's commands: `.ci/run` runs the first two (set up and the main
job; the tests) as they stand in the README, and the GPU install is the
one docs/gpu.md documents; the tests below check that.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp.nnx import TransformerLayer
from tests import reference as ref
from tests._devices import requires_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code.strip() for lang, code in BLOCKS if lang == "bash"]


def _heading_of(code: str) -> str:
  """The README section a block belongs to."""
  before = README[:README.index(code)]
  return re.findall(r"^## (.+)$", before, flags=re.M)[-1]


def _run(code: str) -> dict:
  namespace: dict = {}
  exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
  return namespace


def test_the_readme_has_its_blocks():
  assert [_heading_of(c) for c in PYTHON] == [
      "Quick start", "Bringing your data", "Choosing a strategy"]
  assert len(README.splitlines()) <= 300
  quick = PYTHON[0]
  assert len(quick.strip().splitlines()) <= 40
  assert "xla_force_host_platform_device_count=8" in quick


@requires_devices(8)
def test_quick_start(capsys):
  ns = _run(PYTHON[0])
  layout, rows, x = ns["layout"], ns["rows"], ns["x"]
  cuP = rows.cu_seqlens_padded
  # Flax's attention with jax_cp's attention_fn equals the same module's
  # projections around plain masked attention on the unpartitioned rows.
  mha, y = ns["mha"], ns["y"]
  y = np.asarray(jax_cp.data.restore_from_cp(y, cuP, layout, seq_dim=1))
  q, k, v = (np.asarray(getattr(mha, n)(jnp.asarray(x))) for n in
             ("query", "key", "value"))
  attn = np.stack([ref.attention(q[b], k[b], v[b], rows.cu_seqlens[b],
                                 cuP[b]) for b in range(2)])
  want = np.asarray(mha.out(jnp.asarray(attn)))
  valid = np.stack([ref.valid_token_mask(rows.cu_seqlens[b], cuP[b])
                    for b in range(2)])
  assert ref.rel_err(y[valid], want[valid]) < 1e-4
  # The layer's loss and gradients are finite, and the same layer without
  # CP gives the same loss on the rows in physical order.
  assert np.isfinite(ns["loss"])
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(
      ns["grads"]))
  plain = TransformerLayer(4, 64, num_kv_heads=2,
                           layout=jax_cp.CPLayout(cp_axis=None),
                           rngs=nnx.Rngs(0))
  nnx.update(plain, nnx.state(ns["layer"], nnx.Param))
  got = jnp.mean(plain(jnp.asarray(x), jnp.asarray(rows.cu_seqlens),
                       jnp.asarray(cuP)) ** 2)
  np.testing.assert_allclose(float(got), float(ns["loss"]), rtol=1e-4)
  assert "(2, 256, 64)" in capsys.readouterr().out


def test_bringing_your_data():
  ns = _run(PYTHON[1])
  rows, seg, tokens, weights = (ns[n] for n in ("rows", "seg", "tokens",
                                                "weights"))
  w_rows = ns["w_rows"]
  # Every document starts a slot padded to a multiple of 4, its tokens and
  # its per-token weights first, in the row's order; padding weighs 0.
  assert rows.cu_seqlens_padded.tolist()[0][:4] == [0, 4, 12, 16]
  for r in range(2):
    ids = [i for i in dict.fromkeys(seg[r]) if i]
    for d, i in enumerate(ids):
      start, n = rows.cu_seqlens_padded[r][d], int((seg[r] == i).sum())
      np.testing.assert_array_equal(rows.tokens[r][start:start + n],
                                    tokens[r][seg[r] == i])
      np.testing.assert_array_equal(w_rows[r][start:start + n],
                                    weights[r][seg[r] == i])
    valid = ref.valid_token_mask(rows.cu_seqlens[r],
                                 rows.cu_seqlens_padded[r])
    np.testing.assert_array_equal(w_rows[r][~valid], 0)


def test_choosing_a_strategy(capsys):
  ns = _run(PYTHON[2])
  assert str(ns["rec"].strategy) == "no_load_balance"
  before, after = ns["before"], ns["after"]
  assert after.imbalance <= before.imbalance
  assert after.imbalance < 1.01
  # Reordering moves documents, never tokens between them: the same
  # causal pairs in all.
  assert sum(after.pairs_per_rank) == sum(before.pairs_per_rank)
  assert "busiest rank / mean" in capsys.readouterr().out


def test_the_commands_are_those_ci_and_the_gpu_docs_run():
  setup, tests, gpu = BASH
  assert setup.endswith("python -m examples.packed_lm")
  assert "pip install -e \".[test]\" -c constraints.txt" in setup
  assert tests.endswith("python -m pytest -n 2 tests")
  ci = (ROOT / ".ci" / "run").read_text()
  # .ci/run takes the first two bash blocks of README.md and runs them.
  assert "readme_command 1" in ci and "readme_command 2" in ci
  assert gpu in (ROOT / "docs" / "gpu.md").read_text()


@pytest.mark.parametrize("path", sorted(
    re.findall(r"docs/\w+\.md", README)) + ["benchmarks/README.md",
                                            "CHANGELOG.md"])
def test_the_readme_points_at_files_that_exist(path):
  assert (ROOT / path).exists(), path


def _performance_rows():
  section = README.split("## Performance")[1].split("\n## ")[0]
  return [[c.strip() for c in line.strip("|").split("|")]
          for line in section.splitlines()
          if line.startswith("| ") and not line.startswith("| measurement")]


def _rows_with_their_runs(text: str) -> list[str]:
  """A results file's table rows, each with its run's line (date, commit,
  command) appended: a row's last cell names its run, listed under Runs."""
  runs = dict(re.findall(r"^- \*\*(\d+)\*\*: (.*)$", text, flags=re.M))
  return [line + " " + runs[line.rstrip(" |").rsplit("|", 1)[1].strip()]
          for line in text.splitlines()
          if re.match(r"\|.*\| \d+ \|$", line)]


def test_performance_rows_are_rows_of_the_results_tables():
  """Each number of the README's performance table is stated once: a row
  of a results table whose run has the same date and commit, with the same
  result."""
  rows = _performance_rows()
  assert 1 <= len(rows) <= 8
  lines = [line for p in (ROOT / "benchmarks" / "results").glob("*.md")
           for line in _rows_with_their_runs(p.read_text())]
  for measurement, result, date, commit, command in rows:
    commit = commit.strip("`*")
    values = re.findall(r"\d+\.\d+|\d+k", result)
    assert values and re.fullmatch(r"\d{4}-\d\d-\d\d", date), measurement
    if command != "the same":
      assert command.startswith("`python -m benchmarks."), measurement
    for value in values:
      hits = [line for line in lines if date in line and commit in line
              and re.search(rf"\b{re.escape(value)}\b", line)]
      assert hits, (measurement, value, date, commit)
