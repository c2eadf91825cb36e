"""benchmarks/bench_memory.py on CPU: one tiny run per cp size writes the
JSON and the report with every field; the longest-T search doubles, then
bisects to its step, against a stand-in for the runs."""

from __future__ import annotations

import json
import os
import types

import pytest

from benchmarks import bench_memory
from tests._devices import requires_devices


def test_tokens():
  assert bench_memory.parse_tokens("64k") == 65536
  assert bench_memory.parse_tokens("1M") == 1 << 20
  assert bench_memory.parse_tokens("300") == 300
  assert bench_memory.fmt_tokens(3 << 18) == "768k"
  with pytest.raises(Exception, match="not a token count"):
    bench_memory.parse_tokens("1.5M")


def _args(argv):
  args = bench_memory.build_parser().parse_args(argv)
  args.started = 0.0
  return args


@pytest.mark.parametrize("limit, start, want, want_fail", [
    (200_000, "16k", 192 * 1024, 208 * 1024),   # doubles 16k..256k, bisects
    (10_000, "16k", None, 16 * 1024),           # the first T fails
    (10**9, "1M", 2 << 20, None),               # all fit up to --search-max
])
def test_search_doubles_then_bisects(monkeypatch, limit, start, want,
                                     want_fail):
  """A stand-in run trains up to ``limit`` tokens: the search finds the
  largest multiple of 16k below it, and tries each T at most once."""
  seen = []

  def fake(args, t, cp, remat, timed=True):
    seen.append(t)
    return dict(model="m", seq_len=t, cp=cp, remat=remat,
                status="ok" if t <= limit else "oom")

  monkeypatch.setattr(bench_memory, "measure", fake)
  args = _args(["--search", "--search-start", f"save_context={start}",
                "--search-max", "2M"])
  got, tried = bench_memory.longest_trainable(args, 1, "save_context", [])
  assert [r["seq_len"] for r in tried] == seen
  assert got["longest_seq_len"] == want
  assert got["first_failing_seq_len"] == want_fail
  assert len(seen) == len(set(seen))
  assert all(t % (16 * 1024) == 0 for t in seen)
  if want is not None and want_fail is not None:
    assert want_fail - want == 16 * 1024


@requires_devices(2, "cpu")  # --cp 1 2
def test_cpu_run_writes_json_and_report(tmp_path):
  """Two tiny runs (cp 1 and 2, xla backend): compiled sizes, timings and
  the scratch formula in the JSON, one table row each in MEMORY.md."""
  md = tmp_path / "MEMORY.md"
  path = bench_memory.main([
      "--device", "cpu", "--backend", "xla", "--layers", "1", "--d-model",
      "32", "--heads", "2", "--kv-heads", "1", "--seq-lens", "256",
      "--cp", "1", "2", "--steps", "1", "--max-doc-len", "96",
      "--out", str(tmp_path), "--markdown", str(md)])
  with open(path) as f:
    data = json.load(f)
  runs = [r for r in data["records"] if r["kind"] == "run"]
  assert [r["cp"] for r in runs] == [1, 2]
  for r in runs:
    assert r["status"] == "ok" and r["backend"] == "xla"
    assert r["temp_bytes"] > 0 and r["argument_bytes"] > 0
    assert r["ms_per_step"] > 0 and r["tok_per_s"] > 0
    assert r["max_seqlen"] <= 96
    t = 256 // r["cp"]
    assert r["attention_scratch_bytes"] == t * 2 * (12 * 16 + 4)
    assert r["temp_bytes_per_token_per_layer"] == pytest.approx(
        r["temp_bytes"] / t)
  text = md.read_text()
  assert text.count("| cpu | example* | 1 | 256 |") == 2
  assert os.path.basename(path).startswith("memory_")


def test_search_predicts_the_limit(monkeypatch):
  """With a memory limit and runs whose planned bytes grow linearly, the
  search tries around the predicted limit first: a few tries, not the
  doubling's and bisection's dozen, and still the exact answer."""
  per_token, fixed, limit = 50_000, 3 * 10**9, 40e9
  seen = []

  def fake(args, t, cp, remat, timed=True):
    seen.append(t)
    need = fixed + per_token * t
    return dict(model="m", seq_len=t, cp=cp, remat=remat,
                status="ok" if need <= limit else "oom",
                temp_bytes=per_token * t, argument_bytes=fixed)

  monkeypatch.setattr(bench_memory, "measure", fake)
  args = _args(["--search", "--memory-limit", "40", "--search-start",
                "64k"])
  got, _ = bench_memory.longest_trainable(args, 1, "none", [])
  want = int((limit - fixed) / per_token) // 16384 * 16384
  assert got["longest_seq_len"] == want
  assert got["first_failing_seq_len"] == want + 16384
  assert len(seen) <= 6, seen
  assert bench_memory.predict_longest([(10, 30), (20, 50)], 0, 90) == 40
  assert bench_memory.predict_longest([(10, 30)], 10, 90) == 40


def test_paired_ab_carries_the_donated_state(monkeypatch):
  """The A/B calls each step with the state the previous call returned
  (the example's step donates it), and reports save_context / none."""
  import jax
  import jax.numpy as jnp

  calls = {"none": 0, "save_context": 0}

  def fake_build(args, t, cp, remat):
    work = 2 if remat == "none" else 1

    @jax.jit
    def fn(state, batch):
      x = state
      for _ in range(20 * work):
        x = jnp.tanh(x @ batch)
      return x, jnp.sum(x)

    def counted(state, batch):
      calls[remat] += 1
      return fn(state, batch)

    x = jnp.ones((64, 64)) / 64
    return bench_memory.Step(counted, x, x, None, None, 0, None, 0.0)

  monkeypatch.setattr(bench_memory, "build_step", fake_build)
  args = _args(["--ab", "256", "--ab-reps", "2"])
  got = bench_memory.paired_ab(args, 256, 1)
  assert got["kind"] == "ab" and got["a"] == "none"
  assert got["ms_a"] > 0 and got["ms_b"] > 0
  assert got["save_context_over_none"] == pytest.approx(
      got["ms_b"] / got["ms_a"], rel=0.5)
  assert calls["none"] > 2 and calls["save_context"] > 2


def test_json_holds_each_record_as_it_is_measured(monkeypatch, tmp_path):
  """The result file is rewritten after every record: a run stopped at
  the second T (here a crash) leaves the first T's record on disk."""
  def fake(args, t, cp, remat, timed=True):
    if t > 1024:
      raise KeyboardInterrupt  # stands for a time limit's kill
    return dict(model="m", seq_len=t, cp=cp, remat=remat, status="ok")

  monkeypatch.setattr(bench_memory, "measure", fake)
  monkeypatch.setattr(bench_memory, "_print", lambda rec: None)
  with pytest.raises(KeyboardInterrupt):
    bench_memory.main(["--device", "cpu", "--seq-lens", "1024", "2048",
                       "--out", str(tmp_path), "--markdown", ""])
  (path,) = tmp_path.glob("memory_*.json")
  with open(path) as f:
    data = json.load(f)
  assert [r["seq_len"] for r in data["records"]] == [1024]
  assert data["env"]["args"]["seq_lens"] == [1024, 2048]


def test_search_stops_at_its_budget(monkeypatch):
  monkeypatch.setattr(bench_memory, "measure", lambda *a, **k: 1 / 0)
  args = _args(["--search", "--search-start", "64k"])
  got, tried = bench_memory.longest_trainable(args, 1, "none", [],
                                             budget_s=0.0)
  assert tried == []
  assert got["stopped_early"] and got["tries"] == []
  assert got["longest_seq_len"] is None


def test_growth_table_is_the_slope():
  """Bytes per added local token per layer, from a run and a search try;
  the fixed part of the temp memory drops out."""
  fixed, per = 5 * 10**9, 3000
  run = dict(kind="run", model="big", remat="full", cp=2, seq_len=1 << 16,
             temp_bytes=fixed + per * 4 * (1 << 15), layers=4)
  search = dict(kind="search", model="big", remat="full", cp=2, tries=[
      dict(seq_len=1 << 18, status="ok", layers=4,
           temp_bytes=fixed + per * 4 * (1 << 17))])
  lines = bench_memory._growth_table(
      [dict(env=dict(device_kind="H200", date="2026-12-01T10:00:00"),
            records=[run, search])])
  assert lines[0] == "## Growth per token"
  assert lines[-2] == ("| H200 | 2026-12-01T10:00 | big | full | 2 | "
                       "64k-256k | 3000 |")


def test_growth_table_keeps_invocations_apart():
  """Points of two result files (two versions of the code) give two
  slopes, never one line through both."""
  def one(date, per, seq_lens):
    return dict(env=dict(device_kind="H200", date=date), records=[
        dict(kind="run", model="big", remat="full", cp=1, seq_len=t,
             layers=2, temp_bytes=10**9 + per * 2 * t) for t in seq_lens])
  lines = bench_memory._growth_table(
      [one("2026-12-01T08:00:00", 1000, (1 << 16, 1 << 17)),
       one("2026-12-01T18:00:00", 5000, (1 << 18, 1 << 19))])
  rows = [line for line in lines if line.startswith("| H200")]
  assert rows == ["| H200 | 2026-12-01T08:00 | big | full | 1 | 64k-128k | "
                  "1000 |",
                  "| H200 | 2026-12-01T18:00 | big | full | 1 | 256k-512k | "
                  "5000 |"]


def test_layer_growth_table_is_the_slope_over_layers():
  """Bytes per local token that one more layer adds; what lies outside the
  layers (fixed or per token) drops out."""
  fixed, outside, per, t = 7 * 10**9, 900, 8200, 1 << 16
  runs = [dict(kind="run", model="big*", remat="save_context", cp=1,
               seq_len=t, layers=n, d_model=2048, heads=32, kv_heads=8,
               dtype="bfloat16", temp_bytes=fixed + (outside + per * n) * t)
          for n in (2, 6)]
  lines = bench_memory._layer_growth_table(
      [dict(env=dict(device_kind="H200"), records=runs)])
  assert lines[0] == "## Growth per layer"
  assert lines[-2] == ("| H200 | d_model 2048, 32/8 heads, bfloat16 | "
                       "save_context | 1 | 64k | 2-6 | 8200 | 4.00 |")


def test_compile_only_per_layer_slope_drops_with_save_context(tmp_path):
  """--compile-only at two layer counts (CPU, xla backend): no step runs,
  the per-layer slope under save_context is below none's, and its
  compiled matmul FLOPs (the recompute) above none's."""
  md = tmp_path / "MEMORY.md"
  for layers in ("1", "3"):
    path = bench_memory.main([
        "--device", "cpu", "--backend", "xla", "--layers", layers,
        "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--seq-lens",
        "512", "--remat", "none", "save_context", "--compile-only",
        "--max-doc-len", "128", "--out", str(tmp_path), "--markdown",
        str(md)])
  with open(path) as f:
    runs = json.load(f)["records"]
  assert [r["status"] for r in runs] == ["compiled", "compiled"]
  assert all("ms_per_step" not in r and r["temp_bytes"] > 0 for r in runs)
  # The recompute shows in the compiled matmul FLOPs.
  flops = {r["remat"]: r["dot_flops"] for r in runs}
  assert 0 < flops["none"] < flops["save_context"], flops
  assert all(r["dot_flops_unknown_loops"] == 0 for r in runs)
  text = md.read_text()
  assert "## Growth per layer" in text
  slope = {}
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 8 and cells[1].startswith("d_model 64"):
      slope[cells[2]] = float(cells[6])
  assert set(slope) == {"none", "save_context"}
  assert 0 < slope["save_context"] < slope["none"]


def test_report_rows_have_as_many_cells_as_their_header():
  """Every table of MEMORY.md (runs, search, A/B, growth) is rectangular."""
  run = dict(kind="run", model="big", remat="save_context", cp=1,
             seq_len=1 << 16, layers=2, d_model=2048, heads=32, kv_heads=8,
             dtype="bfloat16", status="ok", temp_bytes=7 * 10**9,
             argument_bytes=10**9, ms_per_step=900.0, tok_per_s=7e4,
             mfu=0.4, temp_bytes_per_token_per_layer=5e4)
  runs = [run, dict(run, layers=4, temp_bytes=8 * 10**9),
          dict(run, temp_bytes=9 * 10**9, seq_len=1 << 17)]
  search = dict(kind="search", model="big", cp=1, remat="save_context",
                longest_seq_len=1 << 18, first_failing_seq_len=None,
                search_max=1 << 23, stopped_early=True, tries=[
                    dict(seq_len=1 << 18, status="ok", layers=2,
                         temp_bytes=9 * 10**9)])
  ab = dict(kind="ab", model="big", seq_len=1 << 16, cp=1, ms_a=900.0,
            ms_b=990.0, save_context_over_none=1.1, ratio_q1=1.09,
            ratio_q3=1.11)
  text = bench_memory.markdown(
      [dict(env=dict(device_kind="H200", date="2026-12-01T00:00:00"),
            records=[*runs, search, ab])], None)
  # The search, the A/B and both growth tables.
  assert text.count("\n## ") == 4
  for block in text.split("\n\n"):
    rows = [line for line in block.splitlines() if line.startswith("|")]
    if rows:
      assert len({row.count("|") for row in rows}) == 1, block
  assert "| H200 | big | 64k | 1 | 900.0 | 990.0 | 1.100 (1.090-1.110) |" \
      in text
  assert "not reached" in text


def test_longest_t_table_says_whether_gradients_were_checked():
  """A search run with the exactness check says so; one without it (or
  from before the check existed) says "not checked"; a search whose first
  try failed says so instead of a length of 0."""
  def one(check, longest):
    tries = [dict(seq_len=1 << 18, status="oom", seconds=1.0,
                  temp_bytes=None, layers=16)]
    return dict(env=dict(device_kind="H200", date="2026-12-01T18:00:00",
                         args=dict(check_exact=check)),
                records=[dict(kind="search", model="big", cp=1,
                              remat="full", longest_seq_len=longest,
                              first_failing_seq_len=1 << 18,
                              search_step=16384, search_max=1 << 23,
                              stopped_early=True, tries=tries)])
  text = bench_memory.markdown([one(True, None), one(False, 1 << 17)], None)
  rows = [line for line in text.splitlines()
          if line.startswith("| H200 | big | 1 | full")]
  assert rows[0].split(" | ")[4:7] == ["none", "checked exact",
                                       "below the first try"]
  assert rows[1].split(" | ")[4:7] == ["none", "not checked", "128k"]


def test_tables_name_each_file_s_mlp_chunking():
  """The runs and the longest-T tables carry each result file's
  ``--mlp-chunk-size``: ``none`` where the file predates the option, the
  value otherwise, marked ``(scan)`` before the chunks worked in place
  and ``(mlp_dim/d)`` before ``"auto"`` counted four hidden-wide buffers;
  the run's footer line names a chunk size other than none."""
  def one(date, chunk):
    args = dict(check_exact=True, model="big", remat="full")
    if chunk is not None:
      args["mlp_chunk_size"] = chunk
    run = dict(kind="run", model="big", layers=16, seq_len=1 << 19, cp=1,
               remat="full", status="oom", temp_bytes=10**11, d_model=2048,
               heads=32, kv_heads=8, dtype="bfloat16")
    search = dict(kind="search", model="big", cp=1, remat="full",
                  longest_seq_len=None, first_failing_seq_len=1 << 19,
                  search_step=16384, search_max=1 << 23, stopped_early=True,
                  tries=[dict(seq_len=1 << 19, status="oom", seconds=1.0,
                              temp_bytes=10**11, layers=16)])
    return dict(env=dict(device_kind="H200", date=date, args=args),
                records=[run, search])
  files = [one("2026-12-01T10:00:00", None),
           one("2026-12-01T17:00:00", "auto"),
           one("2026-12-01T23:00:00", "auto"),
           one("2026-12-01T23:30:00", "none"),
           one("2026-12-01T23:40:00", "4096"),
           one("2026-12-02T04:00:00", "auto")]
  text = bench_memory.markdown(files, None)
  runs = [line.split(" | ")[6] for line in text.splitlines()
          if line.startswith("| H200 | big | 16 |")]
  searches = [line.split(" | ")[4] for line in text.splitlines()
              if line.startswith("| H200 | big | 1 | full")]
  want = ["none", "auto (scan)", "auto (mlp_dim/d)", "none", "4096",
          "auto"]
  assert sorted(runs) == sorted(want)
  assert searches == want
  footers = [line for line in text.splitlines() if line.startswith("- 2026")]
  assert ["--mlp-chunk-size" in line for line in footers] == [
      False, True, True, False, True, True]


def test_preallocation_is_read_from_jax_s_variable(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  assert bench_memory.preallocates()
  for off in ("false", "False", "0"):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", off)
    assert not bench_memory.preallocates()
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
  assert bench_memory.preallocates()


def test_standin_plans_the_step_without_the_score_matrix(tmp_path, monkeypatch):
  """--backend standin (compile-only): the same step with an O(T) stand-in
  for attention plans far less than with the xla backend's dense scores
  (which grow as T^2), and the run says which backend planned it; without
  --compile-only it refuses to run."""
  from jax_cp.attention import registry
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  temps = {}
  for backend in ("xla", "standin"):
    path = bench_memory.main([
        "--device", "cpu", "--backend", backend, "--layers", "1",
        "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--seq-lens",
        "2048", "--remat", "full", "--compile-only", "--max-doc-len", "2048",
        "--out", str(tmp_path / backend), "--markdown", ""])
    with open(path) as f:
      (run,) = json.load(f)["records"]
    assert run["status"] == "compiled" and run["backend"] == backend
    temps[backend] = run["temp_bytes"]
  # The xla backend's float32 scores alone: 4 heads x 2048^2 x 4 bytes.
  assert temps["xla"] - temps["standin"] > 4 * 2048 ** 2 * 4, temps
  with pytest.raises(SystemExit, match="standin is not attention"):
    bench_memory.main(["--device", "cpu", "--backend", "standin",
                       "--seq-lens", "256", "--out", str(tmp_path)])


def test_standin_backend_keeps_the_contract_shapes():
  import jax.numpy as jnp

  from benchmarks import standin_attention
  from jax_cp.attention.backend import Segments
  q = jnp.ones((16, 4, 8), jnp.bfloat16)
  k = jnp.ones((24, 2, 8), jnp.bfloat16)
  seg = Segments(jnp.array([16]), jnp.array([24]), jnp.array([0]),
                 jnp.array([0]), 16, 24)
  out, lse = standin_attention.forward(q, k, k, seg, mask="no_mask",
                                       scale=0.5)
  assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
      q.shape, q.dtype, (16, 4), jnp.float32)
  grads = standin_attention.backward(q, k, k, out, lse, q, seg,
                                     mask="no_mask", scale=0.5)
  assert [(g.shape, g.dtype) for g in grads] == [
      (q.shape, q.dtype), (k.shape, k.dtype), (k.shape, k.dtype)]


def test_head_group_split_plans_no_gradient_buffers_per_layer(
    tmp_path, monkeypatch):
  """The backward split over head groups writes its gradients over q, k
  and v: the step's plan (4 layers, ``full``, the stand-in backend, which
  splits where the ``cudnn`` backend would) is that of one call per
  backward, within one layer's q, k and v, and not one zero-filled set of
  dq, dk, dv per layer made ahead of time."""
  from jax_cp.attention import cudnn_workspace, registry
  monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
  t, d_model, heads, kv_heads = 4096, 256, 8, 4
  temps = {}
  for name, gib in (("one", "inf"), ("split", "0.0001")):
    monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, gib)
    path = bench_memory.main([
        "--device", "cpu", "--backend", "standin", "--layers", "4",
        "--d-model", str(d_model), "--heads", str(heads), "--kv-heads",
        str(kv_heads), "--seq-lens", str(t), "--remat", "full",
        "--compile-only", "--max-doc-len", "1024",
        "--out", str(tmp_path / name), "--markdown", ""])
    with open(path) as f:
      (run,) = json.load(f)["records"]
    temps[name] = run["temp_bytes"]
    groups = run["attention_scratch_groups"]
    assert groups == (1 if name == "one" else kv_heads), run
  head_dim = d_model // heads
  layer_qkv = t * (heads + 2 * kv_heads) * head_dim * 4       # float32
  assert temps["split"] - temps["one"] < layer_qkv, (temps, layer_qkv)


def test_matmul_flops_records_why_it_has_no_count():
  """A compiled text the counter cannot read leaves the reason in the
  record instead of a count (the measurement goes on)."""
  class Text:
    def __init__(self, text):
      self.text = text

    def as_text(self):
      return self.text

  got = bench_memory.matmul_flops(Text("HloModule m\n"))
  assert set(got) == {"dot_flops_error"} and "ENTRY" in got[
      "dot_flops_error"]
  entry = ("ENTRY %main (a: f32[2,3], b: f32[3,5]) -> f32[2,5] {\n"
           "  ROOT %d = f32[2,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
           "rhs_contracting_dims={0}\n}\n")
  assert bench_memory.matmul_flops(Text(entry)) == {
      "dot_flops": 2 * 2 * 5 * 3, "dot_flops_unknown_loops": 0}


def test_layer_chunk_run_checks_the_chunk_calls(tmp_path):
  """``--layer-chunk-size``: the scratch is the chunk call's (a chunk's
  queries and keys), the exactness check runs the last full chunk's
  chunk call and halo call, and the runs table names the chunking."""
  md = tmp_path / "MEMORY.md"
  path = bench_memory.main([
      "--device", "cpu", "--backend", "xla", "--layers", "1", "--d-model",
      "32", "--heads", "2", "--kv-heads", "1", "--seq-lens", "512",
      "--cp", "1", "--steps", "1", "--max-doc-len", "64",
      "--layer-chunk-size", "100", "--out", str(tmp_path),
      "--markdown", str(md)])
  with open(path) as f:
    run = next(r for r in json.load(f)["records"] if r["kind"] == "run")
  assert run["status"] == "ok", run
  assert max(run["exact"].values()) < 1e-4, run["exact"]
  # The last full chunk (tokens [400, 500)) starts inside a document: both
  # calls were checked, its documents' rows in the chunk (top-left) and
  # the straddling document's rows against its keys in the halo.
  assert set(run["exact_calls"]) == {"chunk", "halo"}, run
  assert bench_memory.attention_calls(
      types.SimpleNamespace(layer_chunk_size=100, seq_len=512), 1,
      run["max_seqlen"]) == (100, 100)
  from jax_cp.attention import cudnn_workspace
  assert run["attention_scratch_bytes"] == \
      cudnn_workspace.backward_workspace_bytes(100, 100, 2, 1, 16)
  assert "| cpu | example* | 1 | 512 | 1 | none | layer 100 |" in \
      md.read_text()


def test_recorded_command_names_the_model_overrides():
  """A result's command line (the report's provenance) carries the flags
  that changed the model or its documents, and leaves out defaults."""
  plain = vars(_args(["--model", "big", "--seq-lens", "1M"]))
  assert bench_memory._argv(plain) == [
      "--model", "big", "--remat", "none", "--seq-lens", "1M", "--cp", "1",
      "--mlp-chunk-size", "auto"]
  small = vars(_args(["--model", "big", "--layers", "2", "--d-model", "256",
                      "--heads", "4", "--kv-heads", "2", "--max-doc-len",
                      "2048", "--seq-lens", "64k"]))
  got = bench_memory._argv(small)
  for flag, value in (("--layers", "2"), ("--d-model", "256"),
                      ("--heads", "4"), ("--kv-heads", "2"),
                      ("--max-doc-len", "2048")):
    assert got[got.index(flag) + 1] == value


def test_ab_profiles_record_both_sides(monkeypatch, capsys):
  """--ab-profile: each side's traced step runs (one untraced, one traced
  call of the runner) and its kernel groups land in profile_a/profile_b;
  without a GPU trace (profile None) nothing is recorded."""
  from benchmarks import profiling

  calls = []

  def fake_step(state, batch):
    calls.append(state)
    return state + 1, 0.5

  def fake_profile(run, steps):
    run(1)
    run(steps)
    ms = 2.0 + len(calls)
    return {"groups_ms": {"attention": ms, "matmul": 1.0}, "busy_ms": ms + 1,
            "idle": {"idle_ms": 0.1},
            "kernels": [{"name": "k", "ms": ms, "launches": 1.0}] * 20}

  steps = [bench_memory.Step(fake_step, 0, None, None, None, 0, None, 0.0)
           for _ in range(2)]
  monkeypatch.setattr(profiling, "profile", fake_profile)
  got = bench_memory.ab_profiles(steps, ("chunked", "whole"))
  assert set(got) == {"profile_a", "profile_b"}
  assert got["profile_a"]["groups_ms"]["attention"] == 4.0
  assert got["profile_b"]["groups_ms"]["attention"] == 6.0
  assert len(got["profile_a"]["kernels"]) == 12
  assert "chunked | whole" in capsys.readouterr().out
  assert [s.state for s in steps] == [2, 2]      # the state is carried
  monkeypatch.setattr(profiling, "profile", lambda run, steps: None)
  assert bench_memory.ab_profiles(steps, ("a", "b")) == {}


@pytest.mark.parametrize("peak_gb, noted", [(20.0, True), (60.0, False)])
def test_breakdown_says_when_the_live_range_peak_is_partial(peak_gb, noted):
  """A live-range peak below half of the temp and arguments is reported as
  a partial list, with both numbers."""
  run = dict(model="big", layers=16, seq_len=1 << 20, cp=1, remat="full",
             temp_bytes=70e9, argument_bytes=8e9,
             attention_scratch_bytes=1e9,
             breakdown={"allocations": {"temp": {"bytes": 70e9}},
                        "peak": {"bytes": peak_gb * 1e9,
                                 "by_category": {"state": 8e9},
                                 "top": [{"name": "v", "category": "mlp",
                                          "phase": "bwd", "shape": "bf16[1]",
                                          "bytes": 1e9}]}})
  text = "\n".join(bench_memory._breakdown_section([("H200", run)]))
  assert ("only part of what is live" in text) == noted
  if noted:
    assert "(20.000 GB with the arguments)" in text and "78.000 GB" in text


def test_a_rebuilt_result_says_so_in_its_footer():
  """A result file rebuilt on the host from a run's printed output
  (``env["reconstructed"]``) is marked in the report's footer; others
  are not."""
  def one(date, rebuilt):
    env = dict(device_kind="H200", date=date,
               args=dict(model="big", remat="full"))
    if rebuilt:
      env["reconstructed"] = "rebuilt from the log"
    run = dict(kind="run", model="big", layers=16, seq_len=1 << 20, cp=1,
               remat="full", status="ok", temp_bytes=77_710_000_000,
               d_model=2048, heads=32, kv_heads=8, dtype="bfloat16")
    return dict(env=env, records=[run])
  text = bench_memory.markdown([one("2026-12-02T14:00:00", False),
                                one("2026-12-02T15:00:00", True)], None)
  footers = [line for line in text.splitlines()
             if line.startswith("- 2026-12-02")]
  assert ["rebuilt from the run's printed output" in f for f in footers] \
      == [False, True], footers
