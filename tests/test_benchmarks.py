"""CPU smoke tests of the benchmarks package: rows, timing, and each
command-line script's main path with tiny sizes."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import numpy as np
import pytest

import jax_cp
from benchmarks import bench_cp, report, timing, workload
from tests._devices import requires_devices

HQ, HKV, D, T = 4, 2, 16, 256


def test_pack_row_layouts():
  for dist in workload.DISTS:
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
  _, data = bench_json
  env = data["env"]
  for key in ("date", "device_kind", "jax", "jaxlib", "cudnn", "platform"):
    assert key in env
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
      assert r["strategy"] in workload.STRATEGIES
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
  from benchmarks import reporting
  rows = reporting.paired_rows(reporting.load_paired([path]))
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
  assert {r["strategy"] for r in nocomm} == set(workload.STRATEGIES)


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
def test_profile_step_main(capsys):
  from benchmarks import profile_step
  profile_step.main([
      "--backend", "xla", "--tokens", str(T), "--hq", str(HQ), "--hkv",
      str(HKV), "--head-dim", str(D), "--cp", "2", "--dist", "one_doc",
      "--iters", "2", "--device-plane", "/host:CPU", "--line-filter",
      "xla", "--sequence", "--host-top", "2", "--top", "3", "--window", "5",
      "--max-seqlen-violation", "checked_on_host"])
  out = capsys.readouterr().out
  assert "ms/step" in out and "launches/step" in out
  assert "one step in time order" in out and "host events" in out
