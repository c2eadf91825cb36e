"""The benchmark suite: paired timing on a fake clock, rows, result files
and tables (synthetic and the kept historical files), the suite's line
budget and import order, and bench_fused, bench_cp and bench_step run tiny
on CPU (xla backend) with their JSON and table rows checked."""

from __future__ import annotations

import ast
import datetime
import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

import jax_cp
from benchmarks import (
  bench_cp,
  bench_fused,
  bench_step,
  exactness,
  peers,
  plots,
  results,
  scaling,
  timing,
  workload,
)
from tests._devices import requires_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


# ---------------------------------------------------------------- timing


class FakeClock:
  """A clock that only the fake programs move."""

  def __init__(self):
    self.t = 0.0

  def __call__(self) -> float:
    return self.t


def fake_program(clock: FakeClock, seconds: float, drift: float = 0.0):
  """A program whose call takes ``seconds`` times ``1 + drift * (time so
  far)``: a machine that slows down as it runs."""
  def call(*_):
    clock.t += seconds * (1.0 + drift * clock.t)
    return 0.0
  return call


def test_paired_ratio_cancels_drift_that_separate_stretches_keep():
  """A costs ``k`` times B on a machine that slows down as it runs: every
  rep's ratio is ``k`` within 1 %, while A and B timed in stretches a few
  seconds apart are off by more than 10 %."""
  rng = np.random.default_rng(0)
  for _ in range(3):
    clock, k, b = FakeClock(), rng.uniform(1.5, 4.0), rng.uniform(1e-3, 5e-3)
    fa, fb = (fake_program(clock, s, drift=0.05) for s in (k * b, b))
    r = timing.paired(fa, [()], fb, [()], reps=int(rng.integers(3, 8)),
                      clock=clock)
    assert all(abs(x / k - 1) < 1e-2 for x in r.ratios), (k, r.ratios)
    q1, q3 = r.quartiles()
    assert q1 <= r.ratio <= q3 and abs(r.ratio / k - 1) < 1e-2
    assert r.ms_a / r.ms_b == pytest.approx(k, rel=0.05)
    apart = timing.steady(fa, [()], r.depth_a, clock)
    clock.t += 4.0                               # a later stretch of the run
    apart /= timing.steady(fb, [()], r.depth_b, clock)
    assert abs(apart / k - 1) > 0.1, (apart, k)


def test_paired_gives_each_program_as_many_timings_after_a_switch():
  """Two identical programs whose first calls after the other one ran
  are slower (a timing's worth): every rep's ratio is 1, the first rep's
  too (each program is timed three times after a switch in every rep)."""
  clock, last, seconds = FakeClock(), {"name": None, "n": 0}, 3e-3
  calls = 6 * timing.pipeline_depth(seconds, 40.0)   # one steady() timing

  def program(name):
    def call(*_):
      if last["name"] != name:
        last.update(name=name, n=0)
      last["n"] += 1
      clock.t += seconds * (1.5 if last["n"] <= calls else 1.0)
    return call
  r = timing.paired(program("a"), [()], program("b"), [()], reps=4,
                    clock=clock)
  assert r.ratios == pytest.approx([1.0] * 4, rel=1e-9)
  assert max(r.seconds_a) / min(r.seconds_a) == pytest.approx(1.5)


def test_paired_cancels_quadratic_drift():
  """A costs ``k`` times B while the machine first speeds up and then
  slows down (drift quadratic in time): every rep's ratio is ``k`` to
  2e-4, which the order ``A B B A`` misses."""
  for k in (1.0, 2.5):
    clock = FakeClock()

    def program(seconds, clock=clock):
      def call(*_):
        x = clock.t / 5.0
        clock.t += seconds * (1.0 - 0.1 * x + 0.05 * x * x)
      return call
    r = timing.paired(program(3e-3 * k), [()], program(3e-3), [()], reps=4,
                      clock=clock)
    assert r.ratios == pytest.approx([k] * 4, rel=2e-4), (k, r.ratios)


def test_steady_spreads_block_jitter_thinner_than_one_block():
  """Each block runs its calls a random 3 % faster or slower (the clock,
  read at a block's start and end, draws it): steady()'s spread over many
  timings is under 3 %, where the slope of the two block lengths would
  carry about 5 %."""
  rng = np.random.default_rng(0)

  class JitterClock(FakeClock):
    def __call__(self) -> float:
      self.scale = 1.0 + rng.normal(0.0, 0.03)
      return self.t
  times = []
  for _ in range(300):
    clock = JitterClock()

    def call(*_, clock=clock):
      clock.t += 1e-3 * clock.scale
    times.append(timing.steady(call, [()], 8, clock) / 1e-3)
  assert np.std(times) < 0.03 and abs(np.mean(times) - 1.0) < 0.03


def test_paired_times_long_calls_synced_and_fields():
  clock = FakeClock()
  a, b = fake_program(clock, 2.0), fake_program(clock, 1.25)
  r = timing.paired(a, [()], b, [()], reps=3, warmup=1, clock=clock)
  assert (r.depth_a, r.depth_b) == (1, 1)        # calls of a second or more
  assert r.ratios == pytest.approx([1.6] * 3)
  f = r.fields()
  assert f["ms_a"] == pytest.approx(2000.0) and f["ms_b"] == 1250.0
  assert f["ratio"] == pytest.approx(1.6) and len(f["ratios"]) == 3
  odd = timing.PairedResult([1.0], [1.0], [5.0, 1.0, 3.0, 2.0, 4.0], 1, 1)
  assert odd.ratio == 3.0 and odd.quartiles() == (2.0, 4.0)
  with pytest.raises(ValueError, match="reps must be >= 1"):
    timing.paired(a, [()], b, [()], reps=0, clock=clock)


def test_pipeline_depth_makes_blocks_of_the_asked_length():
  assert timing.pipeline_depth(0.004, 40.0) == 10
  assert timing.pipeline_depth(1e-6, 40.0) == 32
  assert timing.pipeline_depth(0.2, 40.0) == 1


# ------------------------------------------------------------------ rows


@pytest.mark.parametrize("dist", workload.DISTS)
def test_rows_fill_t_and_keep_their_documents(dist):
  rng = np.random.default_rng(workload.DISTS.index(dist))
  t, seed = int(rng.integers(8, 64)) * 1024, int(rng.integers(100))
  for mult in (1, 4, 16):
    cu, cuP = workload.pack_row(dist, t, mult, seed)
    lens, plens = np.diff(cu), np.diff(cuP)
    assert cuP[-1] == t and (plens % mult == 0).all()
    assert (lens > 0).all() and (lens <= plens).all()
    assert (plens[:-1] - lens[:-1] < mult).all()
  a, b = (np.diff(workload.pack_row(dist, t, m, seed)[0]) for m in (1, 8))
  n = min(len(a), len(b)) - 1
  assert np.array_equal(a[:n], b[:n])             # same documents
  cu, cuP = workload.make_row(dist, t, "no_load_balance", 4, seed,
                              "balanced")
  assert sorted(np.diff(cu)) == sorted(a)         # reordered, same docs
  dcs, dcsP = workload.make_row(dist, t, "dual_chunk_swap", 4, seed)
  assert (np.diff(dcsP) % 8 == 0).all()


def test_attention_flops_count_causal_pairs():
  cu = np.array([0, 100, 356, 400])
  pairs = sum(n * (n + 1) // 2 for n in (100, 256, 44))
  assert workload.attention_flops(cu, 8, 64, "fwd") == 4 * 8 * 64 * pairs
  assert workload.attention_flops(cu, 8, 64, "fwd_bwd") == \
      3.5 * 4 * 8 * 64 * pairs
  windowed = sum(min(j + 1, 16) for n in (100, 256, 44) for j in range(n))
  assert workload.attention_flops(cu, 1, 1, "fwd", 15) == 4 * windowed
  assert workload.parse_tokens("64k") == 65536
  assert workload.fmt_tokens(3 << 18) == "768k"
  assert workload.fmt_tokens(1000) == "1000"


def test_exactness_cases_cover_their_rows():
  """The large-call cases of tests/gpu/exact_call.py: documents tile the
  row; a CP rank's call holds the last 1/cp of each document's queries."""
  rng = np.random.default_rng(9)
  t, seed = int(rng.integers(20, 40)) * 1024, int(rng.integers(100))
  for layout in ("one_doc", "mixed", "short", "cp"):
    case = exactness.Case(layout, t, 8, 2, 64, cp=4)
    ql, kl, qo, ko, max_q, max_kv, tq, mask, tiled = exactness.segments_for(
        case, seed)
    ql, kl, qo, ko = (np.asarray(x) for x in (ql, kl, qo, ko))
    assert kl.sum() == t and (ko == np.cumsum(kl) - kl).all()
    assert (qo == np.cumsum(ql) - ql).all() and ql.sum() == tq
    assert max_q == ql.max() and max_kv == kl.max()
    assert tiled == (layout == "one_doc")
    assert mask == ("causal_bottom_right" if layout == "cp"
                    else "causal_top_left")
    if layout == "cp":
      assert (ql == -(-kl // 4)).all()
    if layout == "short":
      assert kl[:-1].min() >= 1024 and kl.max() <= 8192 + 1024
  assert exactness.Case("mixed", t, 8, 2, 64).name == f"mixed T={t} 8/2/64 " \
      "bfloat16"


# ---------------------------------------------------------- result files


def _env(date: str, **kw) -> dict:
  return {**dict(date=date, git_commit="0123456789abcdef", git_dirty=False,
                 commit_by_date=False, command="python -m benchmarks.bench_cp",
                 device_kind="Fake GPU", xla_flags=""), **kw}


def _cp_record(rng, **kw) -> dict:
  ratio = float(rng.uniform(1.0, 4.0))
  return dict(strategy="no_load_balance", dist="short_128_1k",
              doc_order="packed", window=None, cp=2, tokens=65536, hq=32,
              hkv=8, head_dim=128, docs=int(rng.integers(50, 150)),
              ms_a=float(rng.uniform(1, 9)), ms_b=float(rng.uniform(1, 9)),
              ratio=ratio, ratio_q1=ratio - 0.01, ratio_q3=ratio + 0.01,
              tflops_b=float(rng.uniform(10, 500)), **{"pass": "fwd_bwd"},
              **kw)


def _cells(line: str) -> list[str]:
  return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_tables_from_synthetic_files(tmp_path):
  """Two files, written out of date order: rows oldest first, each naming
  its run, listed once with its date, commit (marked), device, file and
  command; an error row; cells as many as the header; a pipe in a command
  escaped."""
  rng = np.random.default_rng(5)
  old = _env("2026-11-30T10:00:00+00:00", commit_by_date=True,
             command="python -m benchmarks.speedup_ab --cp 2")
  new = _env("2026-12-04T09:30:00+00:00", git_dirty=True,
             command="python -m benchmarks.bench_cp --tag 'a|b'",
             xla_flags="--xla_foo=1")
  recs_new = [_cp_record(rng), _cp_record(rng, error="OOM: 90 GiB")]
  recs_old = [_cp_record(rng)]
  for env, recs in ((new, recs_new), (old, recs_old)):
    results.write(results.result_path(str(tmp_path), "cp", env), "cp", env,
                  {}, recs)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "cp_20261130T100000Z_Fake_GPU.json", "cp_20261204T093000Z_Fake_GPU.json"]
  text = pathlib.Path(results.write_table("cp", str(tmp_path))).read_text()
  rows = [line for line in text.splitlines() if line.startswith("|")]
  header, body = _cells(rows[0]), rows[2:]
  assert len(body) == 3 and all(len(_cells(r)) == len(header) for r in body)
  first, second, third = (_cells(r) for r in body)
  col = header.index
  assert [r[col("run")] for r in (first, second, third)] == ["1", "2", "2"]
  assert first[col("speed-up (IQR)")] == (
      f"**{recs_old[0]['ratio']:.3f}** ({recs_old[0]['ratio_q1']:.3f}–"
      f"{recs_old[0]['ratio_q3']:.3f})")
  assert third[col("speed-up (IQR)")].startswith("error: OOM")
  assert third[col("documents")] == f"128–1k docs ({recs_new[1]['docs']})"
  runs = _runs(text)
  assert runs == {
      "1": "2026-11-30 10:00, `0123456` (commit by date), Fake GPU, "
           "`cp_20261130T100000Z_Fake_GPU.json`: `python -m "
           "benchmarks.speedup_ab --cp 2`",
      "2": "2026-12-04 09:30, `0123456` (modified), Fake GPU, "
           "`cp_20261204T093000Z_Fake_GPU.json`: `XLA_FLAGS=--xla_foo=1 "
           "python -m benchmarks.bench_cp --tag 'a\\|b'`"}
  assert text.count("benchmarks.bench_cp") == 1


def _runs(text: str) -> dict[str, str]:
  """A results file's Runs: run -> its line after the run."""
  runs = text.split("\n## Runs\n")[1]
  return dict(re.findall(r"^- \*\*(\d+)\*\*: (.*)$", runs, flags=re.M))


KEPT = {"fused": 238, "cp": 14, "step": 4, "memory": 377, "scaling": 36}


@pytest.mark.parametrize("benchmark", sorted(KEPT))
def test_kept_results_load_and_make_their_tables(benchmark):
  """Every kept file's records become rows with a date, a commit and a
  command, and the committed table is the one they make: each row names a
  run, each file is a run listed once with its date, commit and command,
  and the command appears nowhere else."""
  rows = results.load(benchmark)
  assert len(rows) == KEPT[benchmark]
  for env, r in rows:
    assert datetime.datetime.fromisoformat(env["date"]).tzinfo is not None
    assert re.fullmatch(r"[0-9a-f]{7,40}", env["git_commit"])
    assert env["command"].startswith("python -m benchmarks.")
    # Measured on an H200 or H100, planned for an H200 (bench_memory
    # --target), or modeled on the host (scaling).
    assert env["device_kind"] in (
        ("cpu",) if benchmark == "scaling" else
        ("NVIDIA H200", "NVIDIA H200 (plan)", "NVIDIA H100 80GB HBM3"))
    if "kind" not in r or r["kind"] != "search":
      assert r.get("ratio", 1.0) is None or r.get("ratio", 1.0) > 0
  picture = f"{benchmark}.png"
  text = results.table(benchmark, rows, picture if (
      BENCH / "results" / picture).exists() else None)
  assert (BENCH / "results" / f"{benchmark}.md").read_text() == text
  header, body = _cells(_table(text)[0]), [_cells(x) for x in
                                           _first_table(text)]
  assert len(body) == KEPT[benchmark] and header[-1] == "run"
  assert all(len(c) == len(header) for c in body)
  envs = list({id(env): env for env, _ in rows}.values())
  runs = _runs(text)
  assert sorted(runs, key=int) == [str(i + 1) for i in range(len(envs))]
  assert {c[-1] for c in body} == set(runs)
  for run, env in zip(sorted(runs, key=int), envs):
    date, commit, command = results.provenance(env)
    assert runs[run].startswith(f"{date}, `{commit.split()[0]}`")
    assert runs[run].endswith(f"`{env['file']}`: {command}")
    assert text.count(command) == 1, command
  quoted = {"fused": "**1.006**", "cp": "**3.754**", "step": "**1.809**",
            "memory": "longest that trains (fails at 3360k)",
            "scaling": "3.234 (3.129)"}[benchmark]
  assert quoted in text


def test_results_command_draws_its_pictures(tmp_path, capsys):
  """``python -m benchmarks.results`` on a copy of the kept files: every
  table as committed, each with its picture shown, a PNG of at most 200 KB;
  the fused picture's points are the newest ratio of each reference,
  layout and pass, the scaling picture's lines the modeled efficiencies
  per cp."""
  pytest.importorskip("matplotlib")
  for f in (BENCH / "results").glob("*.json"):
    shutil.copy(f, tmp_path)
  results.main([str(tmp_path)])
  assert "matplotlib" not in capsys.readouterr().out
  for b in results.TABLES:
    text = (tmp_path / f"{b}.md").read_text()
    assert text == (BENCH / "results" / f"{b}.md").read_text()
    assert ("![" in text) == (b in plots.PLOTS)
  for b in plots.PLOTS:
    png = (tmp_path / f"{b}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 200_000
    assert f"]({b}.png)" in (BENCH / "results" / f"{b}.md").read_text()
  plt = plots.pyplot()
  files = results.load_files("fused")
  newest = {}
  for d in files:
    for r in d["records"]:
      if (r["reference"] in plots.PEERS and r.get("ratio")
          and not r.get("versus")):
        newest[d["env"]["device_kind"], r["pass"], r["dist"], r["head_dim"],
               r.get("window"), r["reference"]] = r["ratio"]
  fig = plots.PLOTS["fused"](plt, files)
  drawn = sorted(float(y) for ax in fig.axes for line in ax.lines
                 for y in line.get_ydata() if line.get_linestyle() == "None")
  assert drawn == pytest.approx(sorted(newest.values()))
  scaling_rows = results.load("scaling")
  fig = plots.PLOTS["scaling"](plt, results.load_files("scaling"))
  for ax, grows in zip(fig.axes, (False, True)):
    for line in ax.lines:
      if "GB/s" not in line.get_label():
        continue
      want = sorted((r["cp"], r["efficiency"]) for _, r in scaling_rows
                    if line.get_label() == f"{r['strategy']} / "
                    f"{r['comm_type']}, {r['bandwidth'] / 1e9:.0f} GB/s"
                    and (r["cp"] == 1 or grows == (
                        r["seq_len"] > r["profiled_seq_len"])))
      assert list(zip(line.get_xdata(), line.get_ydata())) == want
  plt.close("all")


def test_results_command_without_matplotlib(tmp_path, monkeypatch, capsys):
  """Without matplotlib the tables come out without a picture, and one
  line says so."""
  monkeypatch.setattr(plots, "pyplot", lambda: None)
  for f in (BENCH / "results").glob("scaling_*.json"):
    shutil.copy(f, tmp_path)
  results.main([str(tmp_path)])
  out = capsys.readouterr().out
  assert out.count("matplotlib not installed") == 1
  assert not list(tmp_path.glob("*.png"))
  text = (tmp_path / "scaling.md").read_text()
  assert "![" not in text and len(_first_table(text)) == KEPT["scaling"]


def test_planned_rows_over_cp1():
  """memory.md's summary: each longest planned row over the cp = 1 row of
  its model, layers, remat and chunks; none where there is no such row."""
  env = {"date": "2026-12-05T00:00:00+00:00", "git_commit": "abcdef0"}
  search = lambda cp, t, **kw: {
      "kind": "search", "model": "big", "layers": 16, "remat": "full",
      "cp": cp, "longest_seq_len": t, "strategy": "dual_chunk_swap",
      "tries": [{"status": "compiled"}], **kw}
  rows = [(env, search(1, 1 << 20)), (env, search(8, 6 << 20)),
          (env, search(8, 7 << 20, scan_layers=True)),
          (env, search(8, 13 << 19, strategy="no_load_balance")),
          (env, {**search(4, 1 << 22), "tries": [{"status": "ok"}]})]
  lines = results.planned_by_cp(rows)
  body = [_cells(x) for x in lines if x.startswith("| big")]
  assert [(c[1], c[3], c[4], c[5], c[6]) for c in body] == [
      ("16", "1", "-", "1M", "1.00"),
      ("16", "8", "dual_chunk_swap / all_gather", "6M", "6.00"),
      ("16", "8", "no_load_balance / halo", "6656k", "6.50"),
      ("16 (scan)", "8", "dual_chunk_swap / all_gather", "7M", "-")]


def test_environment_names_commit_command_and_device(monkeypatch):
  monkeypatch.setenv("JAX_CP_SOURCE_COMMIT", "feedbeef")
  env = results.environment(results.command_line("bench_cp", ["--cp", "2"]))
  assert env["git_commit"] == "feedbeef" and env["git_dirty"] is None
  assert env["command"] == "python -m benchmarks.bench_cp --cp 2"
  assert env["device_kind"] == jax.devices()[0].device_kind
  assert env["jax"] == jax.__version__ and env["jax_cp"] == jax_cp.__version__
  monkeypatch.delenv("JAX_CP_SOURCE_COMMIT")
  tree = results.source_tree()
  assert tree["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}",
                                                    tree["git_commit"])


# ------------------------------------------------------------ the suite


def _imports(path: pathlib.Path) -> set[str]:
  """The benchmark modules a module imports (anywhere in it)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "benchmarks":
        out |= {a.name for a in node.names}
      elif node.module.startswith("benchmarks."):
        out.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      out |= {a.name.split(".")[1] for a in node.names
              if a.name.startswith("benchmarks.")}
  return out


def test_line_budget_and_downward_imports():
  """Under a third as many lines of Python as the library; no benchmark
  module imports a command (bench_*) and the imports form no circle."""
  lines = lambda folder: sum(len(f.read_text().splitlines())
                             for f in folder.rglob("*.py"))
  assert 3 * lines(BENCH) < lines(ROOT / "jax_cp")
  files = sorted(BENCH.rglob("*.py"))
  graph = {f.stem: _imports(f) - {f.stem} for f in files
           if f.parent == BENCH and f.stem != "__init__"}
  for mod, deps in graph.items():
    assert deps <= set(graph), (mod, deps)
    assert not {d for d in deps if d.startswith("bench_")}, (mod, deps)
  done: set[str] = set()
  while len(done) < len(graph):
    ready = {m for m, deps in graph.items() if m not in done and deps <= done}
    assert ready, f"import circle among {set(graph) - done}"
    done |= ready


def _dcs_pairs(rows, cp: int) -> list[int]:
  """Causal pairs per rank under DUAL_CHUNK_SWAP, token by token: each
  padded document in 2 cp chunks, rank r holding chunks r and 2cp-1-r."""
  per_rank = [0] * cp
  cu, cup = rows.cu_seqlens[0], rows.cu_seqlens_padded[0]
  for i in range(len(cu) - 1):
    valid, chunk = cu[i + 1] - cu[i], (cup[i + 1] - cup[i]) // (2 * cp)
    for j in range(valid):
      k = j // chunk
      per_rank[k if k < cp else 2 * cp - 1 - k] += j + 1
  return per_rank


def test_scaling_model(tmp_path):
  """benchmarks.scaling: attention by the busiest rank's pairs (counted
  here token by token), the other kernels by tokens per rank, gaps kept,
  collectives at the bandwidth with only the unhidden ones and the excess
  over compute exposed; the row and table written."""
  from examples.packed_lm import config, data
  profile = tmp_path / "step_profile.json"
  profile.write_text(json.dumps({"records": [
      {"seq_len": 32768, "max_doc_len": 16384}], "profiles": {
          "dual_chunk_swap (packed) cp=1": {"groups_ms": {
              "attention": 30.0, "matmul": 10.0, "elementwise": 5.0,
              "copy": 1.0}, "idle_ms": 0.5}}}))
  kinds = {"all-gather": {"bytes": 4e9, "unhidden_bytes": 1e9},
           "reduce-scatter": {"bytes": 1e8, "unhidden_bytes": 0}}
  plan = tmp_path / "plan.json"
  plan.write_text(json.dumps({
      "args": {"strategy": "dual_chunk_swap", "max_doc_len": 16384,
               "seed": 0},
      "records": [{"kind": "run", "model": "example", "cp": 4,
                   "seq_len": 32768, "schedule": {"kinds": kinds}}]}))
  path = scaling.main(["--profile", str(profile), "--plans", str(plan),
                       "--bandwidth", "1e11", "--measured", "4=3.1",
                       "--out", str(tmp_path)])
  (r,) = _json(path, "scaling", "scaling")["records"]
  cfg = config.Config(strategy="dual_chunk_swap", seq_len=32768)
  one = sum(_dcs_pairs(data.load_rows(cfg, 1, 1), 1))
  busiest = max(_dcs_pairs(data.load_rows(cfg, 1, 4), 4))
  assert r["attention_ms"] == pytest.approx(30.0 * busiest / one)
  assert r["other_ms"] == pytest.approx(16.0 / 4)
  unhidden = 0.75 * 1e9 / 1e11 * 1e3
  hidden = (0.75 * 3e9 + 3 * 1e8) / 1e11 * 1e3
  compute = r["attention_ms"] + r["other_ms"]
  assert hidden > compute
  assert r["exposed_ms"] == pytest.approx(unhidden + hidden - compute)
  assert r["collectives_ms"] == pytest.approx(unhidden + hidden)
  assert r["step_ms"] == pytest.approx(compute + 0.5 + r["exposed_ms"])
  assert r["speedup"] == pytest.approx(46.5 / r["step_ms"])
  assert r["measured"] == 3.1
  (row,) = _table_rows(tmp_path, "scaling")
  assert row[2] == "4" and row[-4] == f"{r['step_ms']:.2f}"
  # A plan compiled without --schedule has nothing to model.
  plan.write_text(json.dumps({
      "args": {"strategy": "dual_chunk_swap", "max_doc_len": 16384,
               "seed": 0},
      "records": [{"kind": "run", "model": "example", "cp": 4,
                   "seq_len": 32768}]}))
  with pytest.raises(SystemExit, match="--schedule"):
    scaling.main(["--profile", str(profile), "--plans", str(plan),
                  "--out", str(tmp_path)])


def test_scaling_model_after_an_all_to_all(tmp_path):
  """all_to_all: every rank attends the whole row's pairs over cp (1/cp of
  the heads); all_to_all+ring (2x2): the busiest of 2 outer ranks' pairs
  over 2; an all-to-all moves (ci-1)/ci of its bytes, ci the inner size."""
  from examples.packed_lm import config, data
  profile = tmp_path / "step_profile.json"
  profile.write_text(json.dumps({"records": [
      {"seq_len": 32768, "max_doc_len": 16384}], "profiles": {
          "dual_chunk_swap (packed) cp=1": {"groups_ms": {
              "attention": 30.0}, "idle_ms": 0.0}}}))
  kinds = {"all-to-all": {"bytes": 4e9, "unhidden_bytes": 4e9}}
  plan = tmp_path / "plan.json"
  run = lambda **kw: {"kind": "run", "model": "example", "cp": 4,
                      "seq_len": 32768, "schedule": {"kinds": kinds}, **kw}
  plan.write_text(json.dumps({
      "args": {"strategy": "dual_chunk_swap", "max_doc_len": 16384,
               "seed": 0},
      "records": [run(comm_type="all_to_all"),
                  run(comm_type="all_to_all+ring", cp_inner=2)]}))
  path = scaling.main(["--profile", str(profile), "--plans", str(plan),
                       "--bandwidth", "1e11", "--out", str(tmp_path)])
  a2a, hier = _json(path, "scaling", "scaling")["records"]
  cfg = config.Config(strategy="dual_chunk_swap", seq_len=32768)
  one = sum(_dcs_pairs(data.load_rows(cfg, 1, 1), 1))
  rows4 = data.load_rows(cfg, 1, 4)
  assert a2a["attention_ms"] == pytest.approx(
      30.0 * sum(_dcs_pairs(rows4, 4)) / 4 / one)
  assert hier["attention_ms"] == pytest.approx(
      30.0 * max(_dcs_pairs(rows4, 2)) / 2 / one)
  assert a2a["collectives_ms"] == pytest.approx(0.75 * 4e9 / 1e11 * 1e3)
  assert hier["collectives_ms"] == pytest.approx(0.5 * 4e9 / 1e11 * 1e3)
  assert hier["cp_inner"] == 2
  assert [r[1] for r in _table_rows(tmp_path, "scaling")] == [
      "dual_chunk_swap / all_to_all",
      "dual_chunk_swap / all_to_all+ring (2x2)"]


# -------------------------------------------------------------- commands


def _json(path: str, benchmark: str, module: str) -> dict:
  data = json.loads(pathlib.Path(path).read_text())
  env = data["env"]
  assert data["benchmark"] == benchmark
  assert env["command"].startswith(f"python -m benchmarks.{module} ")
  assert datetime.datetime.fromisoformat(env["date"]).tzinfo is not None
  assert "git_commit" in env and "git_dirty" in env
  assert env["device_kind"] and env["jax"] == jax.__version__
  return data


def _table(text: str) -> list[str]:
  """The lines of a results file's main table, header first (the summary
  of planned rows after it, in memory.md, is not)."""
  lines = text.splitlines()
  start = next(i for i, x in enumerate(lines) if x.startswith("|"))
  end = next((i for i, x in enumerate(lines) if i > start
              and not x.startswith("|")), len(lines))
  return lines[start:end]


def _first_table(text: str) -> list[str]:
  """The body lines of a results file's main table."""
  return _table(text)[2:]


def _table_rows(folder: pathlib.Path, benchmark: str) -> list[list[str]]:
  return [_cells(x) for x in
          _first_table((folder / f"{benchmark}.md").read_text())]


@pytest.mark.slow    # the fused benchmark end to end, every reference
def test_bench_fused_on_cpu(tmp_path):
  """The primitive against jax.nn (xla implementation) on one windowed
  document, both passes: positive ratios, FLOPs of the windowed pairs,
  and JAX's packed cuDNN call recorded as an error without cuDNN."""
  seed = int(np.random.default_rng(1).integers(1000))
  path = bench_fused.main([
      "--backend", "xla", "--jax-nn-implementation", "xla", "--tokens",
      "256", "--head-dim", "8", "--hq", "2", "--hkv", "1", "--dtype",
      "float32", "--dists", "one_doc", "--window", "15", "--reps", "1",
      "--seed", str(seed), "--out", str(tmp_path)])
  recs = _json(path, "fused", "bench_fused")["records"]
  nn = [r for r in recs if r["reference"] == "jax_nn"]
  assert [r["pass"] for r in nn] == ["fwd", "fwd_bwd"]
  for r in nn:
    assert r["ratio"] > 0 and r["ms_a"] > 0 and r["ms_b"] > 0
    assert r["flops"] == 4 * 2 * 8 * (136 + 240 * 16) * (
        3.5 if r["pass"] == "fwd_bwd" else 1)
    assert r["tflops_b"] == pytest.approx(r["flops"] / r["ms_b"] / 1e9)
  packed = [r for r in recs if r["reference"] == "jax_packed"]
  if jax.default_backend() == "cpu":
    assert len(packed) == 2 and all("error" in r for r in packed)
  for ref in ("ours", "constant_metadata", "cp_attention",
              "cp_attention_constant", "deterministic", "cp_attention_slots",
              "cp_attention_slots_ragged", "fused_offsets",
              "fused_offsets_ragged"):
    mine = [r for r in recs if r["reference"] == ref]
    assert [r["pass"] for r in mine] == ["fwd", "fwd_bwd"]
    assert all(r["ratio"] > 0 and "error" not in r for r in mine), mine
    assert all(r["rel_err"] < 1e-5 for r in mine), mine
    assert all(r.get("versus") == bench_fused.VERSUS.get(ref)
               for r in mine), mine
  assert all(r["rel_err"] == 0 for r in recs if r["reference"] == "ours")
  for r in recs:  # A peer runs, or is reported with why it did not.
    if r["reference"] in peers.PEERS:
      assert r.get("error") or r["ratio"] > 0, r
  rows = _table_rows(tmp_path, "fused")
  labels = [ref + (f" vs {bench_fused.VERSUS[ref]}"
                   if ref in bench_fused.VERSUS else "")
            for ref in bench_fused.REFERENCES]
  assert [r[6] for r in rows] == labels * 2
  row = rows[bench_fused.REFERENCES.index("jax_nn")]
  assert row[9] == (f"**{nn[0]['ratio']:.3f}** ({nn[0]['ratio_q1']:.3f}"
                    f"–{nn[0]['ratio_q3']:.3f})")


def test_bench_fused_versus_another_program(tmp_path):
  """``--versus``: jax.nn paired with cp_attention over a batch of document
  slots (B), the _ragged reference still with its own program; both
  recorded and labelled so."""
  path = bench_fused.main([
      "--backend", "xla", "--jax-nn-implementation", "xla", "--tokens",
      "128", "--head-dim", "8", "--hq", "2", "--hkv", "1", "--dtype",
      "float32", "--dists", "one_doc", "--passes", "fwd", "--slots", "8",
      "--refs", "jax_nn", "fused_offsets_ragged", "--versus",
      "cp_attention_slots", "--reps", "1", "--out", str(tmp_path)])
  recs = _json(path, "fused", "bench_fused")["records"]
  assert [(r["reference"], r["versus"]) for r in recs] == [
      ("jax_nn", "cp_attention_slots"),
      ("fused_offsets_ragged", "fused_offsets")]
  assert all(r["ratio"] > 0 and r["rel_err"] < 1e-5 for r in recs), recs
  assert [r[6] for r in _table_rows(tmp_path, "fused")] == [
      "jax_nn vs cp_attention_slots", "fused_offsets_ragged vs fused_offsets"]


@requires_devices(2)
def test_bench_cp_on_cpu(tmp_path):
  """cp=2 against cp=1, NO_LOAD_BALANCE on reordered 128–1k documents
  with a window, forward+backward: one record with a positive speed-up,
  the row's documents and FLOPs, and its table row."""
  seed = int(np.random.default_rng(2).integers(1000))
  path = bench_cp.main([
      "--cp", "2", "--backend", "xla", "--tokens", "1024", "--hq", "2",
      "--hkv", "1", "--head-dim", "8", "--dtype", "float32", "--strategies",
      "no_load_balance", "--dists", "short_128_1k", "--doc-order",
      "balanced", "--passes", "fwd_bwd", "--window", "31", "--reps", "1",
      "--seed", str(seed), "--out", str(tmp_path)])
  (rec,) = _json(path, "cp", "bench_cp")["records"]
  cu, cuP = workload.make_row("short_128_1k", 1024, "no_load_balance", 2,
                              seed, "balanced", 31)
  assert rec["ratio"] > 0 and rec["ms_a"] > 0 and rec["ms_b"] > 0
  assert rec["docs"] == len(cu) - 1 and rec["max_seqlen"] == max(np.diff(cuP))
  assert rec["flops"] == workload.attention_flops(cu, 2, 8, "fwd_bwd", 31)
  assert rec["ratio_q1"] <= rec["ratio"] <= rec["ratio_q3"]
  (row,) = _table_rows(tmp_path, "cp")
  assert row[:6] == ["no_load_balance", f"128–1k docs ({len(cu) - 1})",
                     "balanced", "31", "fwd_bwd", "2"]
  assert row[10].startswith(f"**{rec['ratio']:.3f}**")


@requires_devices(2)
def test_bench_cp_ring_on_cpu(tmp_path):
  """``--comm-type ring``: the cp=N side runs the ring, recorded and named
  in the table's strategy."""
  path = bench_cp.main([
      "--cp", "2", "--backend", "xla", "--tokens", "256", "--hq", "2",
      "--hkv", "1", "--head-dim", "8", "--dtype", "float32", "--strategies",
      "dual_chunk_swap", "--dists", "one_doc", "--passes", "fwd_bwd",
      "--reps", "1", "--comm-type", "ring", "--out", str(tmp_path)])
  (rec,) = _json(path, "cp", "bench_cp")["records"]
  assert rec["comm_type"] == "ring" and rec["ratio"] > 0, rec
  (row,) = _table_rows(tmp_path, "cp")
  assert row[0] == "dual_chunk_swap / ring"


@pytest.mark.slow    # the step benchmark end to end
@requires_devices(2)
def test_bench_step_on_cpu(tmp_path):
  """The example's step at cp=1 against cp=2, and the CP model at cp=1
  against the model without CP: positive ratios, MFU from the model
  FLOPs, and the table's rows."""
  seed = int(np.random.default_rng(3).integers(1000))
  path = bench_step.main([
      "--device", "cpu", "--cp", "2", "--strategies", "no_load_balance",
      "--backend", "xla", "--dtype", "float32", "--layers", "1",
      "--d-model", "32", "--heads", "2", "--kv-heads", "1", "--seq-len",
      "128", "--max-doc-len", "64", "--reps", "1", "--block-ms", "2",
      "--peak-tflops", "1e-3", "--seed", str(seed), "--out", str(tmp_path)])
  recs = _json(path, "step", "bench_step")["records"]
  assert [(r["a"], r["b"]) for r in recs] == [("cp=1", "cp=2"),
                                             ("nocp", "cp=1")]
  for r in recs:
    assert r["ratio"] > 0 and r["model"] == "example*"
    assert r["doc_order"] == "balanced" and r["model_flops"] > 0
    for side, devices in (("a", 1 if r["a"] != "cp=2" else 2),
                          ("b", 2 if r["b"] == "cp=2" else 1)):
      assert r[f"mfu_{side}"] == pytest.approx(
          r["model_flops"] / (r[f"ms_{side}"] / 1e3) / (1e9 * devices))
  rows = _table_rows(tmp_path, "step")
  assert [(r[5], r[8]) for r in rows] == [("cp=1", "cp=2"), ("nocp", "cp=1")]
