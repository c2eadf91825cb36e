"""Result files and the tables built from them.

A command writes ``<benchmark>_<date>_<device>[_<tag>].json`` (the date in
ISO 8601's basic form, UTC) into ``--out`` (default ``benchmarks/results``)
holding ``{"benchmark", "env", "args", "records"}``. ``env`` records when
(``date``, UTC), which code (``git_commit``: ``$JAX_CP_SOURCE_COMMIT`` when
set, else ``git rev-parse HEAD``; ``git_dirty``; ``commit_by_date`` where
the commit is the one that was HEAD at the file's date), how (``command``,
the exact command line) and on what (device, versions, ``XLA_FLAGS``).
Each record is one row of the benchmark's table.

:func:`write_table` rebuilds ``<benchmark>.md`` (:data:`TABLES`: fused,
cp, step, memory, scaling) from every file of that benchmark in a folder:
one row per record naming its run (its file), and each run once under the
table with its date, commit, device, file and command; above the table the
benchmark's picture (:mod:`benchmarks.plots`) where matplotlib draws one.
``python -m benchmarks.results [FOLDER]`` rebuilds them all.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import plots
from benchmarks.workload import DIST_LABEL, fmt_tokens

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_line(module: str, argv: Sequence[str] | None) -> str:
  """The command that ran ``module`` with ``argv`` (None: this process's
  own arguments)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  return shlex.join(["python", "-m", f"benchmarks.{module}", *argv])


def source_tree(folder: str = ROOT) -> dict[str, Any]:
  """``git_commit`` and ``git_dirty`` of the code: ``$JAX_CP_SOURCE_COMMIT``
  when set (a copy of the tree; ``git_dirty`` None), else the checkout's
  HEAD and whether tracked files differ from it (None without git)."""
  named = os.environ.get("JAX_CP_SOURCE_COMMIT")
  if named:
    return {"git_commit": named, "git_dirty": None}

  def git(*args: str) -> str | None:
    try:
      return subprocess.run(("git", "-C", folder, *args), check=True,
                            capture_output=True, text=True,
                            timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return None
  commit = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no") if commit \
      else None
  return {"git_commit": commit,
          "git_dirty": None if status is None else bool(status)}


def environment(command: str, **extra: Any) -> dict[str, Any]:
  """The ``env`` block: date (UTC), commit, ``command``, device, versions,
  ``XLA_FLAGS``, and ``extra``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel

  import jax_cp  # pylint: disable=import-outside-toplevel
  env = {"date": datetime.datetime.now(datetime.UTC).replace(
             microsecond=0).isoformat(),
         **source_tree(), "commit_by_date": False, "command": command,
         "device_kind": jax.devices()[0].device_kind,
         "device_count": jax.device_count(),
         "platform": jax.default_backend(), "jax": jax.__version__,
         "jaxlib": jaxlib.__version__, "jax_cp": jax_cp.__version__,
         "python": sys.version.split()[0],
         "xla_flags": os.environ.get("XLA_FLAGS", "")}
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    env["cudnn"] = int(cuda_versions.cudnn_get_version())
  except Exception:  # noqa: BLE001  (no CUDA in this jaxlib)
    env["cudnn"] = None
  return {**env, **extra}


def result_path(out_dir: str, benchmark: str, env: dict,
                tag: str | None = None) -> str:
  """``<out_dir>/<benchmark>_<date>_<device>[_<tag>].json``."""
  date = datetime.datetime.fromisoformat(env["date"])
  parts = [benchmark, date.strftime("%Y%m%dT%H%M%SZ"),
           re.sub(r"[^A-Za-z0-9]+", "_", env["device_kind"]).strip("_")]
  if tag:
    parts.append(re.sub(r"[^A-Za-z0-9.-]+", "_", tag))
  return os.path.join(out_dir, "_".join(parts) + ".json")


def write(path: str, benchmark: str, env: dict, args: dict,
          records: list[dict], **extra: Any) -> str:
  """Writes a result file atomically (a run cut short, or one rewriting
  its file after every record, leaves a valid file); returns ``path``."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  payload = dict(benchmark=benchmark, env=env, args=args, records=records,
                 **extra)
  with open(path + ".tmp", "w") as f:
    json.dump(payload, f, indent=1, default=str)
  os.replace(path + ".tmp", path)
  return path


def load_files(benchmark: str, folder: str = RESULTS_DIR) -> list[dict]:
  """The benchmark's files in ``folder``, oldest first, each ``env``
  naming its ``file``."""
  files = []
  for path in glob.glob(os.path.join(folder, f"{benchmark}_*.json")):
    with open(path) as f:
      files.append(json.load(f))
    files[-1]["env"]["file"] = os.path.basename(path)
  files.sort(key=lambda d: (d["env"]["date"], d["env"]["file"]))
  for d in files:       # searches written before they named their settings
    runs = [r for r in d["records"] if r.get("kind") == "run"]
    for r in d["records"]:
      same = [x for x in runs if r.get("kind") == "search" and
              (x.get("cp"), x.get("remat")) == (r.get("cp"), r.get("remat"))]
      for key in ("strategy", "comm_type", "scan_layers", "layers"):
        if same and key not in r and key in same[-1]:
          r[key] = same[-1][key]
  return files


def load(benchmark: str, folder: str = RESULTS_DIR
         ) -> list[tuple[dict, dict]]:
  """``(env, record)`` of every record of the benchmark's files in
  ``folder``, oldest file first."""
  return [(d["env"], r) for d in load_files(benchmark, folder)
          for r in d["records"]]


# ---------------------------------------------------------------- tables


def _num(v, fmt: str = ".2f") -> str:
  return "-" if v is None else format(v, fmt)


def _ratio(r: dict) -> str:
  if r.get("error"):
    return "error: " + r["error"][:80].replace("|", "/")
  if r.get("ratio") is None:
    return "-"
  return f"**{r['ratio']:.3f}** ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f})"


def _gb(v) -> str:
  return "-" if v is None else f"{v / 1e9:.2f}"


def _mix(r: dict) -> str:
  return f"{DIST_LABEL.get(r['dist'], r['dist'])} ({r.get('docs', '?')})"


def _pct(v) -> str:
  return "-" if v is None else f"{v:.1%}"


def _memory_status(r: dict) -> str:
  if r.get("kind") == "search":
    fail = r.get("first_failing_seq_len")
    planned = any(t.get("status") == "compiled" for t in r.get("tries", []))
    return (("longest planned" if planned else "longest that trains")
            + (f" (fails at {fmt_tokens(fail)})" if fail else ""))
  if r.get("kind") == "ab":
    return f"A/B: {r['a']} / {r['b']}"
  return r.get("status", "?")


def _memory_seq(r: dict) -> str:
  t = r.get("longest_seq_len") if r.get("kind") == "search" \
      else r.get("seq_len")
  return fmt_tokens(t) if t else "-"


def _memory_layers(r: dict) -> str:
  return f"{r.get('layers', '-')}{' (scan)' if r.get('scan_layers') else ''}"


def _memory_cp(r: dict) -> str:
  """How a memory row splits its row: ``-`` at cp = 1; NO_LOAD_BALANCE's
  exchange outside the ring is the halo (the example's layouts carry the
  row's ``max_seqlen``)."""
  if r.get("cp", 1) == 1 or r.get("kind") not in ("run", "search"):
    return "-"
  return f"{r.get('strategy', '?')} / {plots.exchange(r)}{_split(r)}"


def _split(r: dict) -> str:
  """The cp mesh of a hierarchical exchange: `` (outer x inner)``."""
  ci = r.get("cp_inner")
  return f" ({r['cp'] // ci}x{ci})" if ci else ""


def _exact(r: dict) -> str:
  if r.get("exact"):
    return f"{max(r['exact'].values()):.1e}"
  return "-" if r.get("kind") != "run" or r.get("status") in (
      "compiled", "oom") else "not checked"


Column = tuple[str, Callable[[dict], Any]]
#: Per benchmark: the title, what the rows are, and the columns (before the
#: run every row ends with).
TABLES: dict[str, tuple[str, str, list[Column]]] = {
    "fused": (
        "The varlen primitive against JAX's cuDNN attention",
        "`benchmarks/bench_fused.py`: `jax_cp.fused_attention` (B) paired "
        "with a reference (A) on one GPU: `jax.nn.dot_product_attention("
        "implementation=\"cudnn\")` on one document (*jax.nn*), or JAX's "
        "packed cuDNN call with segment offsets (*JAX packed*), or "
        "the primitive with the metadata as constants of the program "
        "(*constant_metadata*; every other program takes them as jit "
        "arguments), or the primitive in the deterministic mode "
        "(*deterministic*: its ratio is the mode's cost); a reference *A vs "
        "B* is paired with program B instead "
        "of the primitive (*ours* then stands for B). Ratio: "
        "A's time over B's (> 1: the primitive is faster), median of the "
        "paired reps (IQR). TFLOP/s: causal pairs counted, the backward's "
        "recompute included.", [
            ("D", lambda r: r["head_dim"]),
            ("T", lambda r: fmt_tokens(r["tokens"])),
            ("Hq/Hkv", lambda r: f"{r['hq']}/{r['hkv']}"),
            ("documents", _mix),
            ("window", lambda r: r.get("window") or "-"),
            ("pass", lambda r: r["pass"]),
            ("reference", lambda r: r["reference"] + (
                f" vs {r['versus']}" if r.get("versus") else "")),
            ("ours ms", lambda r: _num(r.get("ms_b"))),
            ("reference ms", lambda r: _num(r.get("ms_a"))),
            ("reference / ours (IQR)", _ratio),
            ("ours TFLOP/s", lambda r: _num(r.get("tflops_b"), ".0f"))]),
    "cp": (
        "CP attention at cp=N against cp=1 on the same row",
        "`benchmarks/bench_cp.py`: `jax_cp.cp_attention` at cp=1 (A) and "
        "at cp=N (B) on the same packed row, timed in alternation. "
        "Speed-up: A's time over B's, median of the paired reps (IQR). "
        "Order: the documents as packed, or reordered by "
        "`balance_document_order` for the cp=N ranks. TFLOP/s per GPU at "
        "cp=N: causal pairs counted, the backward's recompute included.", [
            ("strategy", lambda r: r["strategy"] + (
                " / ring" if r.get("comm_type") == "ring" else "")),
            ("documents", _mix),
            ("order", lambda r: r.get("doc_order", "packed")),
            ("window", lambda r: r.get("window") or "-"),
            ("pass", lambda r: r["pass"]),
            ("cp", lambda r: r["cp"]),
            ("T", lambda r: fmt_tokens(r["tokens"])),
            ("Hq/Hkv/D", lambda r: f"{r['hq']}/{r['hkv']}/{r['head_dim']}"),
            ("cp=1 ms", lambda r: _num(r.get("ms_a"))),
            ("cp=N ms", lambda r: _num(r.get("ms_b"))),
            ("speed-up (IQR)", _ratio),
            ("TFLOP/s per GPU", lambda r: _num(r.get("tflops_b"), ".0f"))]),
    "step": (
        "The example's training step",
        "`benchmarks/bench_step.py`: the whole training step of "
        "`examples/packed_lm` (AdamW, FSDP), A and B timed in alternation,"
        " device-only steady step times. Ratio: A's time over B's (IQR). "
        "MFU: model FLOPs (`jax_cp.planning.model_flops`) over the peak "
        "of the devices used.", [
            ("model", lambda r: f"{r['model']} ({r['layers']} x "
             f"{r['d_model']}, {r['heads']}/{r['kv_heads']})"),
            ("T", lambda r: fmt_tokens(r["seq_len"])),
            ("docs ≤", lambda r: fmt_tokens(r["max_doc_len"])),
            ("strategy", lambda r: r["strategy"]),
            ("order", lambda r: r.get("doc_order", "packed")),
            ("A", lambda r: r["a"]), ("A ms", lambda r: _num(r.get("ms_a"))),
            ("A MFU", lambda r: _pct(r.get("mfu_a"))),
            ("B", lambda r: r["b"]), ("B ms", lambda r: _num(r.get("ms_b"))),
            ("B MFU", lambda r: _pct(r.get("mfu_b"))),
            ("A / B (IQR)", _ratio)]),
    "memory": (
        "Memory of the example's training step against the row length",
        "`benchmarks/bench_memory.py`: one packed row per step, AdamW. "
        "*temp*, *args*: XLA's compiled memory analysis; *peak*: the "
        "device's `peak_bytes_in_use`; *scratch*: the cuDNN backward "
        "workspace of the main attention call "
        "(`jax_cp.attention.cudnn.workspace`), outside XLA's buffers; "
        "*exact*: the largest relative error of that call's out, lse, dq, "
        "dk, dv against the subset reference (`benchmarks/exactness.py`; "
        "status *inexact* above 5e-3); status *compiled*: planned, not "
        "run; a device named *(plan)*: compiled for that GPU without one; "
        "*collectives*: the bytes of the results of the step's "
        "collectives; *unhidden*: of those XLA scheduled beside no "
        "matmul and no CP attention work (`--schedule`, "
        "`benchmarks/schedule.py`; a loop body's once). "
        "A/B rows: A's step time over B's, paired.", [
            ("model", lambda r: r["model"]),
            ("layers", _memory_layers),
            ("T", _memory_seq), ("cp", lambda r: r.get("cp", 1)),
            ("strategy / exchange", _memory_cp),
            ("remat", lambda r: r.get("remat", "-")),
            ("MLP chunk", lambda r: r.get("mlp_chunk_size", "-")),
            ("layer chunk", lambda r: r.get("layer_chunk_size", "-")),
            ("status", _memory_status),
            ("temp GB", lambda r: _gb(r.get("temp_bytes"))),
            ("args GB", lambda r: _gb(r.get("argument_bytes"))),
            ("out GB", lambda r: _gb(r.get("output_bytes"))),
            ("peak GB", lambda r: _gb(r.get("peak_bytes_in_use"))),
            ("scratch GB", lambda r: _gb(r.get("attention_scratch_bytes"))),
            ("collectives GB", lambda r: _gb(sum(
                k["bytes"] for k in r["schedule"]["kinds"].values())
                if r.get("schedule") else None)),
            ("unhidden GB", lambda r: _gb((r.get("schedule") or {}).get(
                "unhidden_bytes"))),
            ("ms/step", lambda r: (f"{r['ms_a']:.1f} / {r['ms_b']:.1f}"
                                   if r.get("kind") == "ab" else
                                   _num(r.get("ms_per_step"), ".1f"))),
            ("MFU", lambda r: _pct(r.get("mfu"))),
            ("exact", _exact),
            ("A / B (IQR)", lambda r: _ratio(r) if r.get("kind") == "ab"
             else "-")]),
    "scaling": (
        "The example's step at cp = N, modeled",
        "`benchmarks/scaling.py`: the busiest rank's step time at cp = N "
        "from the cp=1 step's kernel times on one GPU (`bench_step "
        "--profile`, its row length *T1*) and the collectives of the "
        "step planned for N H200s (`bench_memory --compile-only "
        "--schedule`) at the stated bandwidth per GPU and direction. "
        "*exposed*: collectives XLA scheduled beside no compute, and the "
        "rest past the step's compute; *fixed*: a cost of every cp > 1 "
        "step fitted to one measured speed-up (`--calibrate-on`). Per-GPU "
        "efficiency: throughput per GPU over one GPU's on the same row "
        "(weak scaling where T = N · T1). A model, not a measurement: the "
        "measured speed-ups are `step.md`'s.", [
            ("model", lambda r: r["model"]),
            ("strategy / exchange", lambda r: f"{r['strategy']} / "
             f"{r['comm_type']}{_split(r)}"),
            ("cp", lambda r: r["cp"]), ("T", lambda r: fmt_tokens(
                r["seq_len"])),
            ("T1", lambda r: fmt_tokens(r["profiled_seq_len"])),
            ("GB/s", lambda r: _num(r["bandwidth"] / 1e9, ".0f")),
            ("attention ms", lambda r: _num(r["attention_ms"])),
            ("other ms", lambda r: _num(r["other_ms"])),
            ("gaps ms", lambda r: _num(r["idle_ms"])),
            ("collectives ms", lambda r: _num(r["collectives_ms"])),
            ("exposed ms", lambda r: _num(r["exposed_ms"])),
            ("fixed ms", lambda r: _num(r.get("fixed_ms"))),
            ("step ms", lambda r: _num(r["step_ms"])),
            ("per-GPU efficiency", lambda r: _num(r["efficiency"], ".3f")),
            ("speed-up (measured)", lambda r: "-" if r.get("speedup") is None
             else f"{r['speedup']:.3f} ({r.get('measured') or '-'})")]),
}


def provenance(env: dict) -> tuple[str, str, str]:
  """A run's date (UTC), commit and command."""
  commit = (env.get("git_commit") or "unknown")[:7]
  if env.get("git_dirty"):
    commit += " (modified)"
  if env.get("commit_by_date"):
    commit += " (commit by date)"
  if env.get("reconstructed"):
    commit += " (rebuilt from printed output)"
  date = env["date"][:16].replace("T", " ")
  flags = env.get("xla_flags")
  command = (f"XLA_FLAGS={shlex.quote(flags)} " if flags else "") + env.get(
      "command", "?")
  return date, commit, "`" + command.replace("|", "\\|") + "`"


def runs(rows: list[tuple[dict, dict]]) -> dict[int, tuple[int, str]]:
  """``id(env) -> (run, line)``: the rows' files numbered from 1, oldest
  first, each with its markdown line (date, commit, device, file and
  command)."""
  out: dict[int, tuple[int, str]] = {}
  for env, _ in rows:
    if id(env) in out:
      continue
    date, commit, command = provenance(env)
    sha, _, marks = commit.partition(" ")
    count = env.get("device_count") or 1
    device = env.get("device_kind", "?") + (f" × {count}" if count > 1 else "")
    file = f", `{env['file']}`" if env.get("file") else ""
    out[id(env)] = (len(out) + 1, f"- **{len(out) + 1}**: {date}, `{sha}`"
                    f"{' ' * bool(marks)}{marks}, {device}{file}: {command}")
  return out


def planned_by_cp(rows: list[tuple[dict, dict]]) -> list[str]:
  """Markdown: each compile-only search's longest row over cp = 1's."""
  ids = runs(rows)
  key = lambda r: tuple(r.get(k) or 0 for k in ("model", "layers", "remat",
      "scan_layers", "mlp_chunk_size", "layer_chunk_size"))
  found = sorted(((r, env) for env, r in rows
                  if _memory_status(r).startswith("longest planned")),
                 key=lambda x: (str(key(x[0])), x[0].get("cp", 1),
                                _memory_cp(x[0])))
  one = {key(r): r["longest_seq_len"] for r, _ in found if r["cp"] == 1}
  lines = [] if not found else [
      "", "## Longest planned row per cp", "", "Each *longest planned* row "
      "over the cp = 1 row of its model, layers, remat and chunks.", "", "| "
      "model | layers | remat | cp | strategy / exchange | T | T / T(cp = 1) "
      "| run |", "|" + "---|" * 8]
  for r, env in found:
    ratio = _num(one.get(key(r)) and r["longest_seq_len"] / one[key(r)])
    lines.append(f"| {r['model']} | {_memory_layers(r)} | "
                 f"{r['remat']} | {r['cp']} | {_memory_cp(r)} | "
                 f"{_memory_seq(r)} | {ratio} | {ids[id(env)][0]} |")
  return lines


def table(benchmark: str, rows: list[tuple[dict, dict]],
          picture: str | None = None) -> str:
  """The markdown of a benchmark's table of ``(env, record)`` rows, each
  naming its run (listed after the table), below ``picture`` (a file
  name) where given."""
  title, intro, columns = TABLES[benchmark]
  header = [c for c, _ in columns] + ["run"]
  ids = runs(rows)
  lines = [f"# {title}", "", intro, "",
           "Written by `python -m benchmarks.results` from the "
           f"`{benchmark}_*.json` files beside it; each row's *run* is "
           "listed under Runs, device and versions are in its file's "
           "`env`.", ""] + ([f"![{title}]({picture})", ""] if picture
                            else []) + [
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for env, r in rows:
    cells = [str(fn(r)) for _, fn in columns] + [str(ids[id(env)][0])]
    lines.append("| " + " | ".join(cells) + " |")
  if benchmark == "memory":
    lines += planned_by_cp(rows)
  return "\n".join(lines + [
      "", "## Runs", "", "The *run* of each row: when (UTC), which commit, "
      "on what, its file and the command that wrote it.", ""]
      + [line for _, line in ids.values()]) + "\n"


def write_table(benchmark: str, folder: str = RESULTS_DIR) -> str:
  """Rebuilds ``<folder>/<benchmark>.md``, and its picture where matplotlib
  is installed (:mod:`benchmarks.plots`), from the benchmark's files."""
  files, path = load_files(benchmark, folder), f"{folder}/{benchmark}.md"
  plots.draw(benchmark, files, folder)
  picture = f"{benchmark}.png"
  with open(path, "w") as f:
    f.write(table(benchmark, [(d["env"], r) for d in files for r in d[
        "records"]], picture if os.path.exists(f"{folder}/{picture}")
        else None))
  return path


class Run:
  """One invocation's result file: ``add`` appends records and rewrites
  the file, ``finish`` rebuilds the benchmark's table beside it."""

  def __init__(self, benchmark: str, argv: Sequence[str] | None, args,
               tag: str | None = None, module: str | None = None,
               **env: Any):
    self.benchmark, self.out, self.args = benchmark, args.out, vars(args)
    self.env = environment(command_line(module or f"bench_{benchmark}",
                                        argv), **env)
    self.path = result_path(self.out, benchmark, self.env, tag)
    self.records: list[dict] = []
    self.extra: dict[str, Any] = {}

  def add(self, *records: dict) -> None:
    self.records += records
    write(self.path, self.benchmark, self.env, self.args, self.records,
          **self.extra)

  def finish(self) -> str:
    self.add()
    print(f"wrote {self.path}\nwrote {write_table(self.benchmark, self.out)}",
          flush=True)
    return self.path


def main(argv: Sequence[str] | None = None) -> list[str]:
  """Rebuilds every table of a folder (default ``benchmarks/results``)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  folder = argv[0] if argv else RESULTS_DIR
  paths = [write_table(b, folder) for b in TABLES]
  if plots.pyplot() is None:
    print("matplotlib not installed: no pictures drawn "
          "(pip install -e \".[plots]\")")
  print("\n".join(paths))
  return paths


if __name__ == "__main__":
  main()
