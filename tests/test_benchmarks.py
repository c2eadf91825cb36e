"""Tests of the benchmarks package: rows, timing, result files, targets,
trace parsing, and each command-line script's main path with tiny sizes
on CPU."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

import jax_cp
from benchmarks import (
  bench_cp,
  names,
  profiling,
  report,
  results,
  tables,
  targets,
  timing,
  workload,
)
from tests._devices import requires_devices

HQ, HKV, D, T = 4, 2, 16, 256


def test_pack_row_layouts():
  for dist in names.DISTS:
    for mult in (1, 4, 16):
      cu, cuP = workload.pack_row(dist, 4096, mult, seed=3)
      lens, plens = np.diff(cu), np.diff(cuP)
      assert cuP[-1] == 4096 and (plens % mult == 0).all()
      assert (lens <= plens).all() and (lens > 0).all()
      assert (plens[:-1] - lens[:-1] < mult).all()   # only rounding padding
  # Same documents whatever the padding (up to the trimmed tail).
  a, _ = workload.pack_row("short_128_1k", 8192, 1)
  b, _ = workload.pack_row("short_128_1k", 8192, 8)
  n = min(len(a), len(b)) - 2
  assert np.array_equal(np.diff(a)[:n], np.diff(b)[:n])
  lens = np.diff(workload.pack_row("uniform_1k_8k", 65536, 1)[0])
  assert lens[:-1].min() >= 1024 and lens.max() <= 8192
  assert len(workload.STDLIB_PY_SIZES) == 683
  assert workload.pack_row("one_doc", 512, 8)[0].tolist() == [0, 512]


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  path = bench_cp.main([
      "--backend", "xla", "--tokens", str(T), "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--dtype", "float32", "--cp", "1", "2",
      "--dists", "one_doc", "short_128_1k", "--passes", "fwd_bwd",
      "--reps", "1", "--warmup", "1", "--compile-workers", "2",
      "--out", str(out)])
  assert os.path.exists(path)
  with open(path) as f:
    return path, json.load(f)


@requires_devices(2)
def test_bench_json_fields(bench_json):
  path, data = bench_json
  env = data["env"]
  for key in ("date", "device_kind", "jax", "jaxlib", "cudnn", "platform"):
    assert key in env
  # ISO 8601 dates: extended in the field, basic (the same moment) in the
  # name.
  date = results.parse_date(env["date"])
  assert date.tzinfo is not None and env["date"] == date.isoformat()
  assert os.path.basename(path) == (
      f"results_{date.strftime('%Y%m%dT%H%M%SZ')}_"
      f"{re.sub('[^A-Za-z0-9]+', '_', env['device_kind']).strip('_')}.json")
  s = data["summary"]
  # One XLA compile per program plus a few for the random inputs: nothing
  # is recompiled per measurement.
  assert s["programs"] <= s["measurements"]
  assert s["programs"] <= s["xla_compiles"] <= s["programs"] + 8
  recs = data["records"]
  assert not [r for r in recs if r.get("error")], [r["error"] for r in recs
                                                    if r.get("error")]
  kinds = {r["kind"] for r in recs}
  assert kinds == {"cp_attention", "cp_attention_nocomm",
                   "exchange_standalone", "fused_primitive", "dense_reference"}
  cpa = [r for r in recs if r["kind"] == "cp_attention"]
  for r in cpa:
    assert r["ms_median"] > 0 and r["reps"] == 1 and len(r["ms_all"]) == 1
    assert r["tflops_per_gpu"] > 0
    assert r["speedup"] > 0
    assert r["efficiency"] == pytest.approx(r["speedup"] / r["cp"])
    lens = np.diff(np.asarray(workload.pack_row(
        r["dist"], T, 4 if r["layout"] == "pad4" else 1)[0], np.int64))
    assert r["flops"] == pytest.approx(
        3.5 * 4 * HQ * D * float((lens * (lens + 1) // 2).sum()))
    if r["cp"] == 1:
      assert r["strategy"] is None
      assert "overhead_vs_primitive" in r and r["primitive_ms"] > 0
      assert r["speedup"] == 1.0
    else:
      assert r["strategy"] in names.STRATEGIES
      assert "exposed_exchange_fraction" in r
      assert 0 < r["standalone_exchange_fraction"]
  one = {(r["strategy"], r["cp"]): r for r in cpa if r["dist"] == "one_doc"}
  assert one[("dual_chunk_swap", 2)]["predicted_imbalance"] == 1.0
  assert one[("no_load_balance", 2)]["predicted_imbalance"] == pytest.approx(
      1.5, rel=0.01)
  assert one[(None, 1)]["dense_ms"] > 0
  assert one[(None, 1)]["max_seqlen"] == T
  short = [r for r in cpa if r["dist"] == "short_128_1k"]
  # (At T=256 a 128-1k document fills the row: the "short" row is one
  # document too, which also exercises program sharing between rows.)
  assert all(r["max_seqlen"] == r["longest_padded_doc"] for r in short)
  assert {r["layout"] for r in short} == {"pad4", "unpadded"}


@requires_devices(2)
def test_report_markdown_and_plot(bench_json, tmp_path):
  path, _ = bench_json
  md, png = report.main([path, "--out", str(tmp_path)])
  with open(md) as f:
    text = f.read()
  assert "## Targets" in text and "## Which strategy should I pick?" in text
  assert f"## T={T}, Hq={HQ}, Hkv={HKV}, forward+backward" in text
  assert "| DCS |" in text and "| NLB |" in text
  assert "### one document" in text and "### 128–1k docs" in text
  assert "vs fused_attention" in text
  if importlib.util.find_spec("matplotlib") is None:
    pytest.skip("matplotlib missing: PNG not drawn")
  assert png and os.path.getsize(png) > 1000
  assert glob.glob(str(tmp_path / "speedup.png"))


@requires_devices(2)
def test_speedup_ab_pairs(tmp_path):
  from benchmarks import speedup_ab
  path = speedup_ab.main([
      "--backend", "xla", "--tokens", str(T), "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--dtype", "float32", "--cp", "2",
      "--dists", "one_doc", "--passes", "fwd", "--reps", "2",
      "--out", str(tmp_path)])
  with open(path) as f:
    rec, = json.load(f)["records"]
  assert rec["dist"] == "one_doc" and rec["cp"] == 2 and len(rec["ratios"]) == 2
  assert rec["speedup_min"] <= rec["speedup_median"] <= rec["speedup_max"]
  assert rec["ms_base"] > 0 and rec["ms_other"] > 0


@requires_devices(2)
def test_speedup_ab_doc_orders(tmp_path):
  """--doc-order packed balanced: each row twice, the balanced one with the
  same documents reordered, its busiest rank no heavier."""
  from benchmarks import speedup_ab
  path = speedup_ab.main([
      "--backend", "xla", "--tokens", "2048", "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--dtype", "float32", "--cp", "2",
      "--dists", "short_128_1k", "--passes", "fwd", "--reps", "1",
      "--doc-order", "packed", "balanced", "--out", str(tmp_path)])
  with open(path) as f:
    recs = json.load(f)["records"]
  assert [r["doc_order"] for r in recs] == ["packed", "balanced"]
  row = workload.make_row("short_128_1k", 2048, "no_load_balance", 2,
                          "auto", 0)
  bal = workload.balanced_row(row, "no_load_balance", 2)
  assert [r["row_id"] for r in recs] == [row.row_id, bal.row_id]
  np.testing.assert_array_equal(np.sort(np.diff(bal.cu)),
                                np.sort(np.diff(row.cu)))
  work = [max(jax_cp.estimate_cp_imbalance(x.cu, x.cuP, 2,
                                           "no_load_balance").pairs_per_rank)
          for x in (row, bal)]
  assert work[1] <= work[0]
  # The report keeps both orders apart (newest file wins per configuration,
  # the order part of it).
  rows = tables.paired_rows(results.load([path], results.paired_key).records)
  assert sum("| 128–1k docs" in r for r in rows) == 2
  assert sum("documents reordered" in r for r in rows) == 1


@requires_devices(2)
def test_speedup_ab_times_the_guard(tmp_path):
  """--against fallback pairs the cp=N program with the fallback guard (A)
  against the same program checked on the host (B); the A program holds
  the guard's conditional, the B one none."""
  from benchmarks import speedup_ab
  tokens = 2048   # 128-1k documents: a bound below the row, so a guard
  argv = ["--backend", "xla", "--tokens", str(tokens), "--hq", str(HQ), "--hkv",
          str(HKV), "--head-dim", str(D), "--dtype", "float32", "--cp", "2",
          "--strategy", "no_load_balance", "--dists", "short_128_1k",
          "--passes", "fwd", "--reps", "1", "--out", str(tmp_path)]
  with pytest.raises(SystemExit):
    speedup_ab.main(argv + ["--against", "fallback"])
  path = speedup_ab.main(argv + ["--against", "fallback",
                                 "--max-seqlen-violation", "checked_on_host"])
  with open(path) as f:
    rec, = json.load(f)["records"]
  assert rec["against"] == "fallback"
  assert rec["max_seqlen_violation"] == "checked_on_host"
  row = workload.make_row("short_128_1k", tokens, "no_load_balance", 2,
                          "auto", 0)
  assert row.max_seqlen < tokens
  args = workload.arg_sets(2, row, HQ, HKV, D, "float32", 0)[0]
  hlo = {v: speedup_ab.program(2, row, "no_load_balance", "xla", "fwd",
                               violation=v).lower(*args).as_text()
         for v in ("fallback", "checked_on_host")}
  assert "stablehlo.case" in hlo["fallback"]
  assert "stablehlo.case" not in hlo["checked_on_host"]


@requires_devices(2)
def test_no_communication_variant_has_no_collectives(bench_json):
  """The exposed-exchange baseline (cp_comm_type="local_copies") lowers
  without any collective: nothing is left to leak into "exposed"."""
  _, data = bench_json
  nocomm = [r for r in data["records"] if r["kind"] == "cp_attention_nocomm"]
  assert nocomm and not [r["note"] for r in nocomm if r.get("note")]
  assert {r["strategy"] for r in nocomm} == set(names.STRATEGIES)


def test_timing_api():
  import jax
  import jax.numpy as jnp
  fast = jax.jit(lambda x: x + 1.0)
  slow = jax.jit(lambda x: jnp.sin(x @ x.T).sum())
  sets = [(jnp.ones((64, 64)),), (jnp.full((64, 64), 2.0),)]
  assert timing.pipeline_depth(1.0) == 1 and timing.pipeline_depth(1e-6) == 32
  assert timing.steady(fast, sets) == pytest.approx(
      timing.steady(fast, sets, depth=4), abs=1.0)
  t = timing.measure(fast, sets, warmup=2, reps=3)
  assert len(t.synced) == len(t.pipelined) == len(t.steady) == 3
  assert t.first_s > 0 and 1 <= t.depth <= 32
  assert len(timing.synced(fast, sets, reps=2, warmup=1)) == 2
  r = timing.paired(slow, sets, fast, sets, reps=3)
  assert len(r.ratios) == 3 and len(r.seconds_a) == len(r.seconds_b) == 6
  assert r.ratio_min <= r.ratio_q1 <= r.ratio_median <= r.ratio_q3 \
      <= r.ratio_max
  assert r.ms_a > 0 and r.ms_b > 0
  with pytest.raises(ValueError, match="reps"):
    timing.paired(slow, sets, fast, sets, reps=0)


def test_paired_times_long_calls_synced(monkeypatch):
  """Calls of LONG_CALL_S or more are timed as single synced calls (depth
  1, two calls per timing instead of steady blocks), and on_rep sees every
  rep with the ratio it stores."""
  import time

  import jax.numpy as jnp
  calls = {"a": 0, "b": 0}

  def prog(name, seconds):
    def fn(x):
      calls[name] += 1
      time.sleep(seconds)
      return x + 1.0
    return fn

  monkeypatch.setattr(timing, "LONG_CALL_S", 0.01)
  seen = []
  sets = [(jnp.ones(4),)]
  r = timing.paired(prog("a", 0.03), sets, prog("b", 0.015), sets, reps=2,
                    warmup=1, on_rep=lambda *a: seen.append(a))
  assert r.depth_a == r.depth_b == 1
  # warmup 1 + 3 calls to choose the timer + 2 reps x 2 timings x 2 calls.
  assert calls == {"a": 12, "b": 12}
  assert [s[0] for s in seen] == [0, 1]
  assert [s[3] for s in seen] == r.ratios
  assert 1.5 < r.ratio_median < 2.5
  assert r.ms_a == pytest.approx(30, rel=0.5)


def test_bench_fused_main(tmp_path):
  from benchmarks import bench_fused
  recs = bench_fused.main([
      "--backend", "xla", "--tokens", str(T), "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--dists", "one_doc", "--reps", "1",
      "--out", str(tmp_path)])
  ours = {(r["variant"], r["pass_"]): r for r in recs
          if r["variant"].startswith("ours")}
  assert set(ours) == {(v, p) for v in ("ours", "ours_br")
                       for p in ("fwd", "fwd+bwd")}
  assert all(r["ms"] > 0 for r in ours.values())
  assert glob.glob(str(tmp_path / "fused_*.json"))


@requires_devices(2)
def test_profile_step_main(capsys, tmp_path):
  from benchmarks import profile_step
  path = profile_step.main([
      "--backend", "xla", "--tokens", str(T), "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--cp", "2", "--dist", "one_doc",
      "--iters", "2", "--device-plane", "/host:CPU", "--line-filter",
      "xla", "--sequence", "--host-top", "2", "--top", "3", "--window", "5",
      "--max-seqlen-violation", "checked_on_host", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert "ms/step" in out and "launches/step" in out
  assert "one step in time order" in out and "host events" in out
  assert os.path.basename(path).startswith("profile_")
  rec, = results.read_result(path)["records"]
  assert rec["plane"].startswith("/host:CPU") and rec["wall_ms"] > 0
  assert rec["kernels"] and rec["busy_ms"] > 0


# ----------------------------------------------------------------- results


_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "benchmarks", "results")


def test_results_load_the_files_written_so_far():
  """Every result file in benchmarks/results loads, names dated
  %Y%m%d-%H%M%S included: bench_cp, speedup_ab (whose env.date has that
  form too), bench_step and bench_fused files."""
  paths = sorted(glob.glob(os.path.join(_RESULTS, "*.json")))
  assert paths
  for path in paths:
    data = results.read_result(path)
    assert data["records"], path
    if not os.path.basename(path).startswith("fused_"):
      assert results.file_date(data, path).year == 2026, path
  cp = results.load([os.path.join(_RESULTS, "results_*.json")])
  assert cp.records and len(cp.files) == len(glob.glob(
      os.path.join(_RESULTS, "results_*.json")))
  dates = [results.parse_date(f["date"]) for f in cp.files]
  assert dates == sorted(dates)
  paired = results.load([os.path.join(_RESULTS, "speedup_ab_*.json")],
                        results.paired_key)
  assert paired.records
  # Windowed, reordered and guard pairs are configurations of their own.
  assert {r.get("window") for r in paired.records} >= {None, 4095}
  assert {r.get("doc_order", "packed") for r in paired.records} == {
      "packed", "balanced"}
  assert {r.get("against", "cp1") for r in paired.records} == {
      "cp1", "fallback"}


def _result(tmp_path, name, date, records):
  path = str(tmp_path / name)
  results.write_result(path, {"env": {"date": date, "device_kind": "X"},
                              "records": records})
  return path


def test_results_newest_file_wins_across_date_forms(tmp_path):
  """The file written last wins per key, whichever way its date is
  written; a glob that matches nothing adds nothing, a missing path is an
  error."""
  rec = dict(dist="one_doc", pass_name="fwd", cp=2, strategy="s", tokens=8,
             hkv=1, hq=2, head_dim=4, dtype="f32", speedup_median=1.0)
  old = _result(tmp_path, "speedup_ab_20261129-234337_X.json",
                "20261129-234337", [rec, dict(rec, window=3)])
  new = _result(tmp_path, "speedup_ab_20261130T010000Z_X.json",
                "2026-11-30T01:00:00+00:00", [dict(rec, speedup_median=2.0)])
  older = _result(tmp_path, "speedup_ab_20261128T000000Z_X.json",
                  "2026-11-28T00:00:00+00:00", [dict(rec, speedup_median=3.0)])
  got = results.load([str(tmp_path / "*.json"), str(tmp_path / "none_*")],
                     results.paired_key)
  assert [f["path"] for f in got.files] == [older, old, new]
  by_window = {r.get("window"): r for r in got.records}
  assert by_window[None]["speedup_median"] == 2.0
  assert by_window[None]["_file"] == os.path.basename(new)
  assert by_window[3]["_date"] == "2026-11-29T23:43:37+00:00"
  with pytest.raises(FileNotFoundError):
    results.load([str(tmp_path / "missing.json")])


def test_result_path_is_iso_dated():
  env = {"date": "2026-12-01T07:15:03+00:00", "device_kind": "NVIDIA H200"}
  assert results.result_path("d", "step", env, tag="nlb short") == os.path.join(
      "d", "step_20261201T071503Z_NVIDIA_H200_nlb_short.json")
  env = results.environment()
  assert results.parse_date(env["date"]) is not None
  assert set(env) >= {"git_commit", "git_dirty"}
  assert env["date"].endswith("+00:00")
  with pytest.raises(ValueError, match="date"):
    results.result_path("d", "x", {"date": "yesterday", "device_kind": "X"})


def test_source_tree(tmp_path, monkeypatch):
  """The commit and whether tracked files differ from it, or
  $JAX_CP_SOURCE_COMMIT (over any checkout) when set; else None."""
  import subprocess
  monkeypatch.delenv("JAX_CP_SOURCE_COMMIT", raising=False)
  assert results.source_tree(str(tmp_path)) == {"git_commit": None,
                                                "git_dirty": None}
  monkeypatch.setenv("JAX_CP_SOURCE_COMMIT", "abc123")
  assert results.source_tree(str(tmp_path)) == {"git_commit": "abc123",
                                                "git_dirty": None}
  monkeypatch.delenv("JAX_CP_SOURCE_COMMIT")
  repo = tmp_path / "r"
  repo.mkdir()
  run = lambda *a: subprocess.run(("git", "-C", str(repo), *a), check=True,
                                  capture_output=True, text=True)
  run("init", "-q")
  (repo / "f").write_text("a")
  run("add", "f")
  run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
  head = run("rev-parse", "HEAD").stdout.strip()
  (repo / "untracked").write_text("x")
  assert results.source_tree(str(repo)) == {"git_commit": head,
                                            "git_dirty": False}
  (repo / "f").write_text("b")
  assert results.source_tree(str(repo)) == {"git_commit": head,
                                            "git_dirty": True}
  monkeypatch.setenv("JAX_CP_SOURCE_COMMIT", "abc123")
  assert results.source_tree(str(repo)) == {"git_commit": "abc123",
                                            "git_dirty": None}


def test_write_result_is_atomic(tmp_path, monkeypatch):
  """A write that fails half way leaves the previous file as it was, and
  no temporary file."""
  path = str(tmp_path / "sub" / "r.json")
  assert results.write_result(path, {"records": [1]}) == path
  real_dump = json.dump

  def broken_dump(obj, f, **kw):
    f.write('{"records": [')
    raise OSError("disk full")
  monkeypatch.setattr(json, "dump", broken_dump)
  with pytest.raises(OSError, match="disk full"):
    results.write_result(path, {"records": [2]})
  monkeypatch.setattr(json, "dump", real_dump)
  assert results.read_result(path)["records"] == [1]
  results.write_result(path, {"records": [3]})
  assert results.read_result(path)["records"] == [3]
  assert os.listdir(tmp_path / "sub") == ["r.json"]


def test_report_of_the_files_written_so_far(tmp_path):
  """report's defaults: every bench_cp file listed, the targets table
  filled from targets.json, windowed runs in tables of their own."""
  md, _ = report.main(["--out", str(tmp_path)])
  with open(md) as f:
    text = f.read()
  for path in glob.glob(os.path.join(_RESULTS, "results_*.json")):
    assert f"`{os.path.basename(path)}`" in text
  table = text.split("## Targets")[1].split("\n## ")[0]
  n_rows = sum(line.startswith("| cp=") or line.startswith("| exposed")
               for line in table.splitlines())
  assert n_rows >= len([t for t in targets.load_targets()["targets"]
                        if not t.get("optional")])
  assert "✅ met" in table
  assert ", window 4095\n" in text


# ----------------------------------------------------------------- targets


def _cp_record(**kw):
  r = dict(kind="cp_attention", dist="one_doc", tokens=1024, hkv=2, hq=4,
           pass_name="fwd_bwd", strategy="dual_chunk_swap", cp=2, row_id=0,
           ms_median=1.0, ms_cp1=1.9, speedup=1.9, efficiency=0.95,
           max_seqlen=1024, num_docs=1, longest_padded_doc=1024)
  r.update(kw)
  return r


def test_target_rows_follow_the_targets_data():
  """Thresholds and configurations come from the data: the same record
  meets a target of 1.8x and misses one of 2x; an optional target with
  nothing measured is left out, a required one says so."""
  recs = [_cp_record(), _cp_record(window=7, speedup=9.0)]
  entry = dict(check="speedup", dist="one_doc", strategy="dual_chunk_swap",
               cp=2, **{"pass": "fwd_bwd"})
  data = {"tokens": 1024, "hkv": 2, "targets": [
      dict(entry, min=1.8), dict(entry, min=2),
      dict(entry, cp=4, min=3.5, optional=True),
      dict(entry, cp=4, min=3.5)]}
  rows = targets.target_rows(recs, (), data)
  assert len(rows) == 3
  assert rows[0] == ("cp=2, one document, T=1k, DCS, forward+backward: "
                     "speed-up ≥ 1.8×", "1.90× (1.90 → 1.00 ms)", "✅ met")
  assert rows[1][0].endswith("≥ 2×") and rows[1][2] == "❌ missed"
  assert rows[2][2] == "— not measured"
  with pytest.raises(ValueError, match="check 'nope'"):
    targets.target_rows(recs, (), {"tokens": 1, "targets": [{"check": "nope"}]})
  text = tables.render_markdown(recs, [], (), rows)
  assert ("| cp=2, one document, T=1k, DCS, forward+backward: speed-up ≥ "
          "1.8× |") in text
  assert "## T=1024, Hq=4, Hkv=2, forward+backward, window 7" in text


def test_targets_json_names_known_checks():
  data = targets.load_targets()
  assert data["targets"] and data["hkv"] in (8, 32)
  for t in data["targets"]:
    assert t["check"] in targets.CHECKS
    assert ("min" in t) != ("max" in t)
  # Nothing measured: a row for every required target, none for optional.
  rows = targets.target_rows([], (), data)
  assert len(rows) == sum(not t.get("optional") for t in data["targets"])
  assert {v for _, _, v in rows} == {"— not measured"}


# ----------------------------------------------------------------- profiling


def _event(start, duration, name):
  return SimpleNamespace(start_ns=start, duration_ns=duration, name=name)


def test_profiling_reads_a_synthetic_trace():
  """Planes, lines and events as ProfileData has them: the first
  /device:GPU:0 plane's stream lines are the kernels."""
  gpu0 = SimpleNamespace(name="/device:GPU:0", lines=[
      SimpleNamespace(name="Stream #13(compute)", events=[
          _event(300, 100, "gemm"), _event(0, 100, "gemm"),
          _event(100, 50, "fmha_fwd"), _event(400, 50, "fmha_fwd")]),
      SimpleNamespace(name="XLA Ops", events=[_event(0, 999, "dot")])])
  gpu1 = SimpleNamespace(name="/device:GPU:1", lines=[])
  host = SimpleNamespace(name="/host:CPU", lines=[SimpleNamespace(
      name="python", events=[_event(0, 2e6, "thunk"), _event(5, 1e6,
                                                             "thunk")])])
  data = SimpleNamespace(planes=[gpu1, host, gpu0])
  plane = profiling.device_plane(data)
  assert plane is gpu0 and profiling.device_plane(data, "/device:TPU") is None
  events = profiling.kernel_events(plane)
  assert [(s, n) for s, _, _, n in events] == [
      (0, "gemm"), (100, "fmha_fwd"), (300, "gemm"), (400, "fmha_fwd")]
  totals, counts = profiling.kernel_totals(events)
  assert totals == {"gemm": 200e-6, "fmha_fwd": 100e-6}
  assert counts == {"gemm": 2, "fmha_fwd": 2}
  second = profiling.one_step(events, steps=2)
  assert [(s, n) for s, _, _, n in second] == [(0.0, "gemm"),
                                               (1e-4, "fmha_fwd")]
  htot, hcnt = profiling.kernel_totals(profiling.host_events(data))
  assert htot == {"thunk": 3.0} and hcnt == {"thunk": 2}
  g = profiling.group_kernels([(s, d, n) for s, d, _, n in events], steps=2)
  assert g["groups_ms"] == pytest.approx({"matmul": 100e-6,
                                          "attention": 50e-6})
  assert g["idle"]["idle_ms"] == pytest.approx(150e-6 / 2)


def test_group_kernels_splits_exposed_and_overlapped_collectives():
  ev = [(0, 100, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"),
        (100, 50, "nvjet_sm90_tst_128x128"),
        (50, 100, "ncclDevKernel_AllGather_RING_LL"),   # 50 hidden
        (200, 10, "loop_add_fusion"),
        (210, 5, "copy_fusion")]
  got = profiling.group_kernels(ev, steps=1)
  g = got["groups_ms"]
  assert g["attention"] == pytest.approx(100e-6)
  assert g["matmul"] == pytest.approx(50e-6)
  assert g["collective_overlapped"] == pytest.approx(100e-6)
  assert g["collective_exposed"] == pytest.approx(0.0)
  assert g["elementwise"] == pytest.approx(10e-6)
  assert g["copy"] == pytest.approx(5e-6)
  assert got["busy_ms"] == pytest.approx(165e-6)
  assert [k["launches"] for k in got["kernels"]] == [1] * 5
  (nccl,) = [k for k in got["kernels"] if "exposed_ms" in k]
  assert nccl["exposed_ms"] == pytest.approx(0.0)
  assert got["kernels"][0]["name"].startswith("cudnn_generated")
  assert profiling.kernel_group("ncclDevKernel_ReduceScatter") == \
      "collective"


def test_idle_gaps_charges_each_gap_to_the_kernels_around_it():
  # Two steps: a [0,100), c [120,130), b [150,200); then the same 300 ns
  # later. Gaps: a->c 20 twice, c->b 20 (only in the second step: a
  # collective covers it in the first), b->a 100 once.
  step = [(0, 100, "a"), (120, 10, "c"), (150, 50, "b")]
  ev = step + [(s + 300, d, n) for s, d, n in step]
  ev.append((130, 40, "nccl"))          # hides the c->b gap entirely
  got = profiling.idle_gaps(ev, steps=2)
  assert got["span_ms"] == pytest.approx(500e-6 / 2)
  assert got["idle_ms"] == pytest.approx((20 + 100 + 20 + 20) / 2e6)
  pairs = {(g["before"], g["after"]): g for g in got["pairs"]}
  assert pairs[("b", "a")]["ms"] == pytest.approx(100 / 2e6)
  assert pairs[("b", "a")]["count"] == 0.5
  assert pairs[("a", "c")]["ms"] == pytest.approx(40 / 2e6)
  assert pairs[("a", "c")]["max_us"] == pytest.approx(0.02)
  assert pairs[("c", "b")]["ms"] == pytest.approx(20 / 2e6)  # second step
  assert got["pairs"][0]["before"] == "b"


def test_collectives_of_program_text():
  hlo = """
  %ag = (f32[4]{0}, f32[8,2]{1,0}) all-gather-start(%a, %b), dimensions={0}
  %rs = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, """ \
      """/*index=5*/f32[2]{0}) reduce-scatter(%a, %b, %c, %d, %e, %f)
  %ar = f32[] all-reduce(%x), to_apply=%add
  %mul = f32[4]{0} multiply(%ag, %ag)
  """
  got = profiling.hlo_collectives(hlo)
  assert got == {"all-gather": ["(f32[4], f32[8,2])"],
                 "reduce-scatter": ["(" + ", ".join(["f32[2]"] * 6) + ")"],
                 "all-reduce": ["f32[]"]}
  text = ('%0 = "stablehlo.all_gather"(%a) %1 = stablehlo.add %0 '
          '%2 = "stablehlo.collective_permute"(%1) %3 = '
          '"stablehlo.all_gather"(%2)')
  assert profiling.stablehlo_collectives(text) == ["all_gather",
                                                    "collective_permute"]


def test_plot_draws_the_targets_configuration():
  """The plot's records: cp > 1 without a window, at the targets' T and
  Hkv when measured, else the largest T and smallest Hkv."""
  from benchmarks import plots
  data = {"tokens": 1024, "hkv": 2, "targets": []}
  recs = [_cp_record(), _cp_record(pass_name="fwd"), _cp_record(hkv=8),
          _cp_record(tokens=4096), _cp_record(window=7),
          _cp_record(cp=1, strategy=None, speedup=1.0)]
  cpa, tokens, hkv, passes = plots.plotted(recs, data)
  assert (tokens, hkv, passes) == (1024, 2, ["fwd_bwd", "fwd"])
  assert len(cpa) == 2 and all(r["cp"] == 2 and "window" not in r
                               for r in cpa)
  cpa, tokens, hkv, _ = plots.plotted(recs, dict(data, tokens=5, hkv=5))
  assert (tokens, hkv, len(cpa)) == (4096, 2, 1)
  assert plots.plotted([_cp_record(cp=1)], data) is None


def test_bench_fused_parity_pairs_each_reference(tmp_path, capsys):
  """--parity pairs ours with each reference per (head dim, T) pair; on
  CPU JAX's cuDNN references fail and are recorded, not raised."""
  from benchmarks import bench_fused
  recs = bench_fused.main([
      "--parity", "--backend", "xla", "--tokens", "128", "256", "--hq",
      str(HQ), "--hkv", str(HKV), "--head-dim", "16", "32", "--dists",
      "one_doc", "--reps", "1", "--out", str(tmp_path)])
  keys = {(r["head_dim"], r["tokens"], r["pass_"], r["reference"])
          for r in recs}
  assert keys == {(d, t, p, ref) for d, t in ((16, 128), (32, 256))
                  for p in ("fwd", "fwd+bwd")
                  for ref in ("jax_dense", "jax_packed")}
  assert all("error" in r or r["ratio"] > 0 for r in recs)
  assert "ours / jax.nn" in capsys.readouterr().out
  (path,) = glob.glob(str(tmp_path / "fused_*_parity.json"))
  assert len(results.read_result(path)["records"]) == len(recs)
  with pytest.raises(SystemExit):
    bench_fused.main(["--parity", "--tokens", "1", "2", "3", "--head-dim",
                      "16", "32"])
