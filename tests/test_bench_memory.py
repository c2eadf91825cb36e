"""benchmarks/bench_memory.py on CPU: tiny runs (cp 1 and 2, layer chunks,
the generic A/B, the stand-in's plan) with their JSON and table rows; the
exactness check that turns a run inexact; the longest-T search against a
stand-in for the runs."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

from benchmarks import bench_memory, exactness
from tests._devices import requires_devices

TINY = ["--device", "cpu", "--backend", "xla", "--layers", "1",
        "--d-model", "32", "--heads", "2", "--kv-heads", "1", "--steps", "1"]


def _records(path: str) -> list[dict]:
  data = json.loads(pathlib.Path(path).read_text())
  assert data["benchmark"] == "memory"
  assert data["env"]["command"].startswith("python -m benchmarks.bench_memory")
  return data["records"]


def _rows(folder: pathlib.Path) -> list[list[str]]:
  lines = (folder / "memory.md").read_text().splitlines()
  header = next(i for i, x in enumerate(lines) if x.startswith("|"))
  return [[c.strip() for c in re.split(r"(?<!\\)\|", x)[1:-1]]
          for x in lines[header + 2:] if x.startswith("|")]


@pytest.mark.slow    # the memory benchmark end to end, every path
@requires_devices(2, "cpu")
def test_cpu_runs_and_the_generic_ab(tmp_path):
  """cp 1 and 2: compiled sizes, the scratch formula, timings, the
  attention call checked exact, one table row each; --ab pairs two remat
  presets at cp=1 (A: none, B: full)."""
  path = bench_memory.main([*TINY, "--seq-lens", "256", "--cp", "1", "2",
                            "--max-doc-len", "96", "--ab", "256", "--ab-a",
                            "remat=none", "--ab-b", "remat=full",
                            "--ab-reps", "1", "--out", str(tmp_path)])
  ab, *runs = _records(path)
  assert ab["kind"] == "ab" and (ab["a"], ab["b"]) == ("remat=none",
                                                       "remat=full")
  assert ab["ratio"] > 0 and ab["ms_a"] > 0 and ab["ms_b"] > 0
  assert [r["cp"] for r in runs] == [1, 2]
  for r in runs:
    assert r["status"] == "ok" and r["backend"] == "xla", r
    assert r["temp_bytes"] > 0 and r["argument_bytes"] > 0
    assert r["ms_per_step"] > 0 and r["tok_per_s"] > 0
    assert r["dot_flops"] > 0 and r["max_seqlen"] <= 96
    t = 256 // r["cp"]   # float32 dq, full-head dk, dv, softmax sums
    assert r["attention_scratch_bytes"] == t * 2 * (3 * 16 * 4 + 4)
    assert max(r["exact"].values()) < 1e-4 and set(r["exact_calls"]) == {
        "row"}
  rows = _rows(tmp_path)
  assert rows[0][8] == "A/B: remat=none / remat=full"
  assert rows[0][19].startswith(f"**{ab['ratio']:.3f}**")
  assert [(r[0], r[2], r[3], r[8]) for r in rows[1:]] == [
      ("example*", "256", "1", "ok"), ("example*", "256", "2", "ok")]
  assert rows[1][18] == f"{max(runs[0]['exact'].values()):.1e}"


def test_layer_chunk_run_checks_the_chunk_calls(tmp_path):
  """--layer-chunk-size: the scratch is a chunk call's and the check runs
  the last full chunk's chunk and halo calls."""
  (run,) = _records(bench_memory.main([
      *TINY, "--seq-lens", "320", "--max-doc-len", "64",
      "--layer-chunk-size", "100", "--out", str(tmp_path)]))
  assert run["status"] == "ok" and run["layer_chunk_size"] == "100"
  assert set(run["exact_calls"]) == {"chunk", "halo"}, run
  assert max(run["exact"].values()) < 1e-4
  from jax_cp.attention.cudnn import workspace as cudnn_workspace
  assert run["attention_scratch_bytes"] == \
      cudnn_workspace.backward_workspace_bytes(100, 100, 2, 1, 16)
  assert _rows(tmp_path)[0][7] == "100"


def test_exact_calls_follow_the_documents():
  """The whole row's call holds every document; a layer chunk's halo call
  exists exactly when a document straddles the last full chunk's start."""
  rng = np.random.default_rng(7)
  lens = rng.integers(10, 60, size=12)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)

  class Rows:
    cu_seqlens, cu_seqlens_padded = cu[None], cu[None]
    max_seqlen = int(lens.max())

  class Cfg:
    layer_chunk_size, seq_len = None, int(cu[-1])
  (seg, tq, tkv, mask), = bench_memory.exact_calls(Rows, Cfg).values()
  assert tq == tkv == cu[-1] and mask == "causal_top_left"
  assert np.asarray(seg.q_lens).tolist() == lens.tolist()
  Cfg.layer_chunk_size = 64
  calls = bench_memory.exact_calls(Rows, Cfg)
  start = (int(cu[-1]) // 64 - 1) * 64
  straddles = start not in cu
  assert set(calls) == ({"chunk", "halo"} if straddles else {"chunk"})
  assert calls["chunk"][1:3] == (64, 64)


def test_a_failing_check_makes_the_run_inexact(monkeypatch, tmp_path):
  errors = dict.fromkeys(exactness.OUTPUTS, 1e-6)
  errors["dk"] = 0.2
  monkeypatch.setattr(exactness, "check_call", lambda *a, **k: errors)
  (run,) = _records(bench_memory.main([
      *TINY, "--seq-lens", "128", "--max-doc-len", "64", "--out",
      str(tmp_path)]))
  assert run["status"] == "inexact" and run["exact"]["dk"] == 0.2


def test_standin_plans_without_the_score_matrix(tmp_path, monkeypatch):
  """--backend standin --compile-only plans the step with an O(T)
  stand-in for attention: far less temp than the xla backend's dense
  scores; without --compile-only it refuses."""
  from jax_cp.attention import registry
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  temps = {}
  for backend in ("xla", "standin"):
    argv = [*TINY, "--backend", backend, "--heads", "4", "--kv-heads", "2",
            "--seq-lens", "2048", "--compile-only", "--max-doc-len", "2048",
            "--out", str(tmp_path / backend)]
    (run,) = _records(bench_memory.main(argv))
    assert run["status"] == "compiled" and run["backend"] == backend
    temps[backend] = run["temp_bytes"]
  assert temps["xla"] - temps["standin"] > 4 * 2048 ** 2 * 4, temps
  with pytest.raises(SystemExit, match="standin is not attention"):
    bench_memory.main([*TINY, "--backend", "standin", "--seq-lens", "256"])


@requires_devices(4, "cpu")
def test_all_to_all_plans_on_one_or_two_cp_axes(tmp_path):
  """--comm-type all_to_all (one cp axis) and all_to_all+ring --cp-inner 2
  (a 2x2 cp mesh): the compiled step has its all-to-alls, the main call
  attends H/ci heads, the record and the table name the split; a
  --cp-inner that does not divide cp is refused."""
  argv = [*TINY, "--heads", "4", "--kv-heads", "2", "--seq-lens", "256",
          "--cp", "4", "--max-doc-len", "96", "--compile-only",
          "--strategy", "dual_chunk_swap", "--schedule"]
  for comm, inner in (("all_to_all", []), ("all_to_all+ring",
                                            ["--cp-inner", "2"])):
    out = tmp_path / comm
    (r,) = _records(bench_memory.main([*argv, "--comm-type", comm, *inner,
                                       "--out", str(out)]))
    assert r["status"] == "compiled" and r["comm_type"] == comm, r
    assert r["schedule"]["kinds"]["all-to-all"]["count"] > 0
    assert r.get("cp_inner") == (2 if inner else None)
    split = " (2x2)" if inner else ""
    assert _rows(out)[0][4] == f"dual_chunk_swap / {comm}{split}"
  from examples.packed_lm import config  # the main call after it
  c = config.Config(heads=4, kv_heads=2, seq_len=256, cp=4,
                    strategy="dual_chunk_swap", comm_type="all_to_all+ring",
                    cp_inner=2)
  assert bench_memory.main_call_tokens(c, 4, 96) == (128, 128, 2, 1)
  c = config.Config(heads=4, kv_heads=2, seq_len=256, cp=4,
                    strategy="dual_chunk_swap", comm_type="all_to_all")
  assert bench_memory.main_call_tokens(c, 4, 96) == (256, 256, 1, 1)
  with pytest.raises(SystemExit, match="--cp-inner"):
    bench_memory.main([*argv, "--comm-type", "all_to_all+ring",
                       "--cp-inner", "3"])


def _args(argv):
  return bench_memory.build_parser().parse_args(argv)


@pytest.mark.parametrize("limit, start, want, want_fail", [
    (200_000, "16k", 192 * 1024, 208 * 1024),   # doubles 16k..256k, bisects
    (10_000, "16k", None, 16 * 1024),           # the first T fails
    (10**9, "1M", 2 << 20, None),               # all fit up to --search-max
    (700_000, "48k", 672 * 1024, 688 * 1024),
])
def test_search_doubles_then_bisects(monkeypatch, limit, start, want,
                                     want_fail):
  """A stand-in run trains up to ``limit`` tokens: the search finds the
  largest multiple of 16k not above it, trying each T once."""
  seen = []

  def fake(args, t, cp, remat, timed=True):
    seen.append(t)
    return dict(model="m", seq_len=t, cp=cp, remat=remat,
                status="ok" if t <= limit else "oom")

  monkeypatch.setattr(bench_memory, "measure", fake)
  monkeypatch.setattr(bench_memory, "print_record", lambda rec: None)
  args = _args(["--search", "--search-start", start, "--search-max", "2M"])
  got, tried = bench_memory.longest_trainable(args, 1, "full", [], None)
  assert [r["seq_len"] for r in tried] == seen
  assert got["longest_seq_len"] == want
  assert got["first_failing_seq_len"] == want_fail
  assert len(seen) == len(set(seen)) and all(t % 16384 == 0 for t in seen)
  assert got["remat"] == "full" and not got["stopped_early"]


def test_search_stops_at_its_budget_and_on_errors(monkeypatch):
  monkeypatch.setattr(bench_memory, "print_record", lambda rec: None)
  args = _args(["--search", "--search-start", "64k"])
  monkeypatch.setattr(bench_memory, "measure", lambda *a, **k: 1 / 0)
  got, tried = bench_memory.longest_trainable(args, 1, "none", [], 0.0)
  assert tried == [] and got["stopped_early"] and not got["longest_seq_len"]
  monkeypatch.setattr(bench_memory, "measure", lambda a, t, cp, remat, **k:
                      dict(seq_len=t, cp=cp, remat=remat, status="error"))
  got, tried = bench_memory.longest_trainable(args, 1, "none", [], None)
  assert len(tried) == 1 and got["stopped_early"]


def test_ab_settings_are_checked():
  assert bench_memory.parse_setting(["remat=full", "mlp_chunk_size=none"]) \
      == {"remat": "full", "mlp_chunk_size": "none"}
  with pytest.raises(SystemExit, match="KEY=VALUE"):
    bench_memory.parse_setting(["dtype=float32"])
  with pytest.raises(SystemExit, match="nothing to do"):
    bench_memory.main(["--device", "cpu"])
