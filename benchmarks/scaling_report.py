"""``SCALING.md``: the weak-scaling tables, targets and plot of the
``scaling_*.json`` files that ``bench_step --weak`` writes.

    python -m benchmarks.scaling_report [FILES_OR_GLOBS ...] [--out DIR]

Records of several files merge by configuration (row, model, dtype, batch,
remat, tokens per GPU, cp), the newest file winning. The efficiency of a
program is its TFLOP/s per GPU over that of cp=1 with the same row, model
and tokens per GPU. The targets are ``targets.json``'s ``scaling`` entry.
Standard library only (the plot needs matplotlib; without it, none).
"""

from __future__ import annotations

import argparse
import collections
import os
from collections.abc import Sequence

from benchmarks import results
from benchmarks.names import MODELS, SCALING_ROW_LABEL, SCALING_ROWS, fmt_tokens
from benchmarks.tables import number, percent, verdict
from benchmarks.targets import load_targets

MARKDOWN = "SCALING.md"
PLOT = "scaling.png"


def scaling_key(r: dict) -> tuple:
  """A weak-scaling record's configuration."""
  return (r["row"], r["model"], r["dtype"], r["batch"], r.get("remat"),
          r["tokens_per_gpu"], r["cp"])


def series_key(r: dict) -> tuple:
  """The configuration but cp: one line of the plot."""
  return scaling_key(r)[:-1]


def with_efficiency(records: Sequence[dict]) -> list[dict]:
  """The records (sorted by series, then cp), each with ``efficiency``:
  its TFLOP/s per GPU over cp=1's of its series (None without cp=1)."""
  base = {series_key(r): r["tflops_per_gpu"] for r in records
          if r["cp"] == 1}
  out = []
  for r in sorted(records, key=_order):
    b = base.get(series_key(r))
    out.append(dict(r, efficiency=r["tflops_per_gpu"] / b if b else None))
  return out


def _order(r: dict) -> tuple:
  row = SCALING_ROWS.index(r["row"]) if r["row"] in SCALING_ROWS else 99
  return (r["model"], r["dtype"], r["batch"], str(r.get("remat")),
          r["tokens_per_gpu"], row, r["cp"])


def strategy_ratios(records: Sequence[dict]) -> list[dict]:
  """NO_LOAD_BALANCE over DUAL_CHUNK_SWAP step time on the one-document
  row, per (model, tokens per GPU, cp) where both ran, against the
  predicted ``(2 cp - 1) / cp`` (cp > 1: at cp=1 both are one program)."""
  dcs = {scaling_key(r)[1:]: r for r in records if r["row"] == "dcs_one_doc"}
  out = []
  for r in sorted(records, key=_order):
    d = dcs.get(scaling_key(r)[1:])
    if r["row"] == "nlb_one_doc" and d is not None and r["cp"] > 1:
      cp = r["cp"]
      out.append(dict(model=r["model"], tokens_per_gpu=r["tokens_per_gpu"],
                      cp=cp, measured=r["ms"] / d["ms"],
                      predicted=(2 * cp - 1) / cp))
  return out


def target_rows(records: Sequence[dict], targets: dict | None = None
                ) -> list[tuple[str, str, str]]:
  """``(target, measured, verdict)`` per model measured, row and cp of
  ``targets.json``'s ``scaling`` entry (efficiency at its tokens per
  GPU)."""
  spec = (load_targets() if targets is None else targets).get("scaling")
  if not spec:
    return []
  n = spec["tokens_per_gpu"]
  recs = [r for r in with_efficiency(records) if r["tokens_per_gpu"] == n]
  out = []
  for model in sorted({r["model"] for r in recs}) or ["example"]:
    for row in spec["rows"]:
      for cp, least in sorted(spec["min_efficiency"].items(),
                              key=lambda kv: int(kv[0])):
        got = [r["efficiency"] for r in recs if r["model"] == model
               and r["row"] == row and r["cp"] == int(cp)
               and r["efficiency"] is not None]
        e = min(got) if got else None
        out.append((f"{model}, {SCALING_ROW_LABEL[row]}, "
                    f"{fmt_tokens(n)}/GPU, "
                    f"cp={cp}: efficiency ≥ {least:.0%}", percent(e),
                    verdict(None if e is None else e >= least)))
  return out


def row_label(r: dict) -> str:
  """A record's row as tables name it; short documents with their cut."""
  label = SCALING_ROW_LABEL.get(r["row"], r["row"])
  if r["row"] == "nlb_short" and r.get("max_doc_len"):
    label = label.replace("≤ 1k", f"≤ {fmt_tokens(r['max_doc_len'])}")
  return label


def _model_title(r: dict) -> str:
  preset = " (the example's)" if r["model"] == "example" else ""
  return (f"{r['model']}{preset}: {r['layers']} layers, d_model "
          f"{r['d_model']}, {r['heads']}/{r['kv_heads']} heads, "
          f"{r['dtype']}, remat {r.get('remat')}, {r['batch']} row(s)")


def summary(records: Sequence[dict]) -> str:
  """Markdown: per model a table of every program, then the strategy
  ratios on one document and the programs that failed (``weak_error``
  records)."""
  failed = [r for r in records if r.get("kind") == "weak_error"]
  records = [r for r in records if r.get("kind") == "weak"]
  groups = collections.defaultdict(list)
  for r in with_efficiency(records):
    groups[_model_title(r)].append(r)
  parts = []
  for title, recs in groups.items():
    lines = [f"### {title}", "",
             "| row | tokens/GPU | cp | T | documents | step ms | "
             "TFLOP/s/GPU | MFU | efficiency vs cp=1 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
      lines.append(
          f"| {row_label(r)} | "
          f"{fmt_tokens(r['tokens_per_gpu'])} | {r['cp']} | "
          f"{r['seq_len']:,} | "
          f"{r['documents']} | {r['ms']:.2f} | {r['tflops_per_gpu']:.1f} | "
          f"{percent(r['mfu'])} | {percent(r['efficiency'])} |")
    parts.append("\n".join(lines))
  ratios = strategy_ratios(records)
  if ratios:
    lines = ["### NO_LOAD_BALANCE / DUAL_CHUNK_SWAP step time, one document",
             "", "| model | tokens/GPU | cp | measured | predicted "
             "(2cp−1)/cp |", "|---|---|---|---|---|"]
    lines += [f"| {x['model']} | {fmt_tokens(x['tokens_per_gpu'])} | "
              f"{x['cp']} | {number(x['measured'], '.3f')} | "
              f"{number(x['predicted'], '.3f')} |" for x in ratios]
    parts.append("\n".join(lines))
  if failed:
    parts.append("Failed programs:\n\n" + "\n".join(
        f"* {r['model']}, {SCALING_ROW_LABEL.get(r['row'], r['row'])}, "
        f"{fmt_tokens(r['tokens_per_gpu'])}/GPU, cp={r['cp']}: "
        f"`{r['error']}`" for r in failed))
  return "\n\n".join(parts) + "\n" if parts else "(no weak-scaling records)\n"


def plot(records: Sequence[dict], path: str) -> str | None:
  """TFLOP/s per GPU against cp (log 2 axis), one line per (row, model,
  tokens per GPU). Returns ``path``, or None when nothing was drawn (no
  matplotlib, or no record)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  if not records:
    return None
  lines = collections.defaultdict(list)
  for r in with_efficiency(records):
    lines[series_key(r)].append(r)
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  models = sorted({k[1] for k in lines})
  most = max(k[5] for k in lines)
  for (row, model, _, _, _, n), recs in lines.items():
    ax.plot([r["cp"] for r in recs], [r["tflops_per_gpu"] for r in recs],
            marker="o" if n == most else "s",
            color=f"C{SCALING_ROWS.index(row) if row in SCALING_ROWS else 9}",
            ls=("-", "--", ":", "-.")[models.index(model) % 4],
            alpha=1.0 if n == most else 0.6,
            label=f"{SCALING_ROW_LABEL.get(row, row)}, {model}, "
            f"{fmt_tokens(n)}/GPU")
  ax.set_xscale("log", base=2)
  cps = sorted({r["cp"] for r in records})
  ax.set_xticks(cps)
  ax.set_xticklabels([str(c) for c in cps])
  ax.set_xlabel("cp (GPUs)")
  ax.set_ylabel("model TFLOP/s per GPU")
  ax.set_ylim(bottom=0)
  ax.set_title("Weak scaling: tokens per GPU fixed, T = cp × tokens/GPU")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def markdown(loaded: results.Loaded, plot_name: str | None) -> str:
  """The whole ``SCALING.md``."""
  recs = [r for r in loaded.records if r.get("kind") == "weak"]
  done = {_where(r) for r in recs}
  failed = [r for r in loaded.records if r.get("kind") == "weak_error"
            and _where(r) not in done]      # and not measured since
  env = loaded.files[-1] if loaded.files else {}
  head = [
      "# Weak scaling: model TFLOP/s per GPU", "",
      "Tokens per GPU fixed, the row grows with the GPUs (T = cp × tokens "
      "per GPU, one row, a 1 × cp mesh): `python -m benchmarks.bench_step "
      "--weak ...` (benchmarks/README.md). Model FLOPs in the MFU "
      "convention (`jax_cp.model_flops`: 6 per matmul parameter per token, "
      "causal attention per document, backward 2× forward, no recompute) "
      "over the device-only steady step time and the cp GPUs; efficiency = "
      "TFLOP/s per GPU at cp / at cp=1 of the same row, model and tokens "
      "per GPU.", "",
      "Models: " + "; ".join(
          f"`--model {k}` {m['layers']} layers, d_model {m['d_model']}, "
          f"{m['heads']}/{m['kv_heads']} heads" for k, m in MODELS.items())
      + ".",
      f"Device: {env.get('device_kind', '?')}, jax {env.get('jax', '?')}, "
      f"cuDNN {env.get('cudnn', '?')}.", ""]
  body = [summary(recs + failed)]
  targets = target_rows(recs)
  if targets:
    body += ["### Targets", "", "| target | measured | verdict |",
             "|---|---|---|"]
    body += [f"| {t} | {m} | {v} |" for t, m, v in targets]
    body.append("")
  if plot_name:
    body += [f"![TFLOP/s per GPU against cp]({plot_name})", ""]
  body += ["Files: " + ", ".join(
      f"`{os.path.basename(f['path'])}`" for f in loaded.files), ""]
  return "\n".join(head + body)


def write(patterns: str | Sequence[str], out_dir: str) -> str:
  """Reads the result files of ``patterns`` and writes ``SCALING.md`` (and
  ``scaling.png`` with matplotlib) in ``out_dir``; returns the markdown's
  path."""
  loaded = results.load([patterns] if isinstance(patterns, str)
                        else patterns, key=_key_or_none)
  recs = [r for r in loaded.records if r.get("kind") == "weak"]
  drawn = plot(recs, os.path.join(out_dir, PLOT))
  path = os.path.join(out_dir, MARKDOWN)
  os.makedirs(out_dir, exist_ok=True)
  with open(path, "w") as f:
    f.write(markdown(loaded, drawn and PLOT))
  return path


def _where(r: dict) -> tuple:
  return (r["row"], r["model"], r["tokens_per_gpu"], r["cp"])


def _key_or_none(r: dict) -> tuple:
  """Merge key: the configuration of a weak-scaling record, the program of
  a failed one; other records are kept apart."""
  if r.get("kind") == "weak":
    return scaling_key(r)
  if r.get("kind") == "weak_error":
    return ("error", *_where(r))
  return (id(r),)


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("files", nargs="*", default=[
      os.path.join(results.RESULTS_DIR, "scaling_*.json")])
  p.add_argument("--out", default=results.RESULTS_DIR)
  args = p.parse_args(argv)
  path = write(args.files, args.out)
  print(path)
  return path


if __name__ == "__main__":
  main()
