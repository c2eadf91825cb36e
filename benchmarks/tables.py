"""Tables of ``bench_cp`` and ``speedup_ab`` records.

:func:`render_markdown` writes ``RESULTS.md`` (the files read, the target
rows it is given, the paired speed-ups, one table per configuration and a
"which strategy" paragraph); :func:`print_table` is the plain-text table
``bench_cp`` prints. :func:`number`, :func:`percent` and :func:`verdict`
format cells.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.derived import one, select
from benchmarks.names import (
  DIST_LABEL,
  PASS_LABEL,
  SHORT,
  STRATEGIES,
  dist_rank,
)
from benchmarks.results import DEFAULT_TIMING

# ----------------------------------------------------------------- cells


def number(x, fmt: str, suffix: str = "") -> str:
  """``x`` formatted with ``fmt`` and ``suffix``; ``–`` for None."""
  return "–" if x is None else format(x, fmt) + suffix


def percent(x) -> str:
  """A fraction as ``12.3 %``; ``–`` for None."""
  return "–" if x is None else f"{100 * x:.1f} %"


def verdict(ok: bool | None) -> str:
  """A target's verdict: met, missed, or (None) not measured."""
  return {True: "✅ met", False: "❌ missed", None: "— not measured"}[ok]


def paired_rows(paired) -> list[str]:
  """Markdown table of the paired speed-ups."""
  if not paired:
    return []
  out = ["## Paired speed-ups (`speedup_ab.py`)", "",
         ("cp=N and cp=1 on the same row timed in alternation (A B B A per "
          "rep, steady per-call times: pipeline fill and clock drift "
          "cancel); median of the per-rep ratios and their interquartile "
          "range."), "",
         ("| row | pass | strategy | cp | cp=1 ms | cp=N ms | speed-up | IQR "
          "| reps | file |"), "|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(paired, key=lambda r: (r["tokens"], dist_rank(r["dist"]),
                                         r["pass_name"] != "fwd", r["cp"])):
    extra = "".join(
        (f", window {r['window']}" if r.get("window") is not None else "",
         f", plan {r['dcs_window_plan']}"
         if r.get("dcs_window_plan", "split") != "split" else "",
         ", documents reordered" if r.get("doc_order") == "balanced" else "",
         ", A: fallback guard" if r.get("against") == "fallback" else ""))
    out.append(
        f"| {DIST_LABEL.get(r['dist'], r['dist'])}, T={r['tokens']}, "
        f"Hkv={r['hkv']}{extra} | {PASS_LABEL[r['pass_name']]} | "
        f"{SHORT.get(r['strategy'], r['strategy'])} | {r['cp']} | "
        f"{r['ms_base']:.3f} | {r['ms_other']:.3f} | "
        f"**{r['speedup_median']:.3f}×** | {r['speedup_q1']:.3f}–"
        f"{r['speedup_q3']:.3f} | {r['reps']} | `{r['_file']}` |")
  return out + [""]


def _cell(r: dict[str, Any] | None) -> str:
  """A configuration table's cell."""
  if r is None:
    return "–"
  if r.get("ms_median") is None:
    return "error"
  parts = [f"**{number(r.get('speedup'), '.2f', '×')}**"
           if r["cp"] > 1 else "1.00×"]
  if r["cp"] > 1:
    parts.append(number(r.get("efficiency") and 100 * r["efficiency"],
                        ".0f", " %"))
  parts.append(f"{r['ms_median']:.3f} ms")
  parts.append(number(r.get("tflops_per_gpu"), ".0f", " TF/s"))
  parts.append("imb " + number(r.get("predicted_imbalance"), ".2f"))
  return " · ".join(parts)


def imbalance_rows(records) -> list[str]:
  """NLB on one document: measured speed-up vs the bound cp / ((2cp-1)/cp)."""
  out = []
  for r in sorted(select(records, kind="cp_attention", dist="one_doc",
                         strategy="no_load_balance"),
                  key=lambda r: (r["tokens"], r["hkv"], r["pass_name"],
                                 r["cp"])):
    if r.get("speedup") is None:
      continue
    cp = r["cp"]
    bound = cp * cp / (2 * cp - 1)
    out.append(f"| {r['tokens']} | {r['hkv']} | {r['pass_name']} | {cp} | "
               f"{(2 * cp - 1) / cp:.3f} | "
               f"{number(r.get('predicted_imbalance'), '.3f')} | "
               f"{bound:.2f}× | {r['speedup']:.2f}× | "
               f"{100 * r['speedup'] / bound:.0f} % |")
  return out


def recommendation_paragraph(records) -> str:
  """'Which strategy should I pick', from the measurements."""
  lines = []
  cpa = [r for r in select(records, kind="cp_attention")
         if r["cp"] > 1 and r.get("ms_median") is not None]
  wins = {}
  agree = total = 0
  for r in cpa:
    if r["strategy"] != "no_load_balance":
      continue
    d = next((x for x in cpa if x["strategy"] == "dual_chunk_swap"
              and x["dist"] == r["dist"] and x["tokens"] == r["tokens"]
              and x["hkv"] == r["hkv"] and x["pass_name"] == r["pass_name"]
              and x["cp"] == r["cp"] and x["hq"] == r["hq"]), None)
    if d is None:
      continue
    ratio = d["ms_median"] / r["ms_median"]       # > 1: NLB faster
    wins.setdefault(r["dist"], []).append((ratio, r))
    if r.get("predicted_ms") is not None and d.get("predicted_ms") is not None:
      total += 1
      agree += ((r["predicted_ms"] < d["predicted_ms"]) == (ratio > 1))
  if not wins:
    return "No CP configuration with both strategies was measured."
  verdicts = {}
  for dist in sorted(wins, key=dist_rank):
    ratios = wins[dist]
    n_nlb = sum(1 for x, _ in ratios if x > 1)
    lo = min(x for x, _ in ratios)
    hi = max(x for x, _ in ratios)
    if n_nlb == len(ratios):
      verdicts[dist] = "nlb"
      verdict = "pick **NO_LOAD_BALANCE**"
    elif n_nlb == 0:
      verdicts[dist] = "dcs"
      verdict = "keep **DUAL_CHUNK_SWAP**"
    else:
      verdicts[dist] = "mixed"
      won = sorted({(r["cp"], r["pass_name"]) for x, r in ratios if x > 1})
      verdict = ("it depends: NO_LOAD_BALANCE wins at " + ", ".join(
          f"cp={c} {p}" for c, p in won) + ", DUAL_CHUNK_SWAP elsewhere")
    lines.append(
        f"- **{DIST_LABEL.get(dist, dist)}**: NLB is faster in {n_nlb} of "
        f"{len(ratios)} configurations (DCS time / NLB time from "
        f"{lo:.2f} to {hi:.2f}): {verdict}.")
  text = ("Measured (DCS time ÷ NLB time > 1 means NO_LOAD_BALANCE wins):\n\n"
          + "\n".join(lines) + "\n\n")
  long_dcs = verdicts.get("one_doc") == "dcs"
  short_nlb = verdicts.get("short_128_1k") == "nlb"
  if long_dcs and short_nlb:
    text += (
        "So: when one document (or a few long ones) fills the row, the "
        "causal imbalance of contiguous chunks ((2cp−1)/cp for one "
        "document) costs more than DUAL_CHUNK_SWAP's all-gather and "
        "reorder: keep the default. When the row holds many documents much "
        "shorter than T/cp, the imbalance vanishes and NO_LOAD_BALANCE "
        "(with `max_seqlen`, its bounded exchange) wins.")
  else:
    text += (
        "These measurements do not split cleanly into \"one long document: "
        "DUAL_CHUNK_SWAP, many short ones: NO_LOAD_BALANCE\" (one document: "
        f"{verdicts.get('one_doc', 'not measured')}, 128–1k documents: "
        f"{verdicts.get('short_128_1k', 'not measured')}); decide per "
        "configuration from the tables above.")
  text += (" Per batch, `jax_cp.recommend_strategy(cu, cuP, cp, "
           "num_heads_q=..., num_heads_kv=..., max_seqlen=...)` applies the "
           "cost model")
  if total:
    text += (f"; its pick agreed with the measured winner in {agree} of "
             f"{total} configurations here.")
  else:
    text += "."
  return text


def _files_section(envs) -> list[str]:
  """One line per result file read, and how to read the times."""
  out = []
  for env in envs:
    s = env.get("summary", {})
    out.append(
        f"- `{os.path.basename(env['path'])}`: {env.get('date')} on "
        f"{env.get('device_count')}× {env.get('device_kind')} "
        f"({env.get('platform')}), jax {env.get('jax')}, jaxlib "
        f"{env.get('jaxlib')}, cuDNN {env.get('cudnn')}, backend "
        f"`{env.get('args', {}).get('backend')}`; "
        f"{s.get('measurements')} measurements, {s.get('programs')} programs, "
        f"{s.get('xla_compiles')} XLA compiles, wall "
        f"{number(s.get('wall_s'), '.0f')} s; timing "
        f"{env.get('args', {}).get('timing', DEFAULT_TIMING)}")
  return out + [
      "",
      ("Times are medians of host-clock timings (see "
       "`benchmarks/README.md`): *pipelined* = per call of a block of "
       "calls dispatched back to back, *synced* = one call waited for "
       "(each file's timing is listed above; where files overlap, the "
       "newest wins); files with *steady* timings (the per-call time "
       "with the pipeline's fill and drain cancelled) also give the "
       "steady speed-ups of the targets. FLOPs are exact causal pairs "
       "(`4·Hq·D·L(L+1)/2` per document forward, ×3.5 forward+backward). "
       "Speed-up is against cp=1 on the same row (same strategy's "
       "padding); efficiency = speed-up / cp; *imb* is the cost model's "
       "predicted max/mean per-rank work."), ""]


def _groups(records):
  """(tokens, hkv, pass, window) groups present among cp_attention
  records, without a window first."""
  keys = {(r["tokens"], r["hkv"], r["pass_name"], r.get("window"))
          for r in records if r["kind"] == "cp_attention"}
  return sorted(keys, key=lambda k: (k[3] is not None, k[3] or 0, k[0], k[1],
                                     k[2] != "fwd_bwd"))


def _dist_notes(records, drows, where) -> list[str]:
  """The notes under one distribution's table: references, exchange
  shares, the cost model and errors."""
  notes = [f"cp=1 ({r['layout']}) vs fused_attention: "
           f"{r['ms_median']:.3f} vs {r['primitive_ms']:.3f} ms "
           f"({100 * r['overhead_vs_primitive']:+.1f} %)"
           for r in drows if r["cp"] == 1 and r.get("primitive_ms") is not None]
  dense = one(records, kind="dense_reference", **where)
  if dense is not None:
    impl = "cuDNN" if dense.get("backend") == "cudnn" else "XLA"
    notes.append(f"jax.nn.dot_product_attention ({impl}, dense causal): "
                 f"{dense['ms_median']:.3f} ms, "
                 f"{number(dense.get('tflops_per_gpu'), '.0f')} TFLOP/s")
  by_cp = lambda r: (r["strategy"], r["cp"])
  exch = [r for r in drows if r["cp"] > 1 and (
      r.get("exposed_exchange_fraction") is not None
      or r.get("standalone_exchange_fraction") is not None)]
  if exch:
    notes.append("exchange share of the step (exposed / standalone): " +
                 "; ".join(
                     f"{SHORT[r['strategy']]} cp={r['cp']} "
                     f"{percent(r.get('exposed_exchange_fraction'))} / "
                     f"{percent(r.get('standalone_exchange_fraction'))}"
                     for r in sorted(exch, key=by_cp)))
  pred = [r for r in drows if r.get("predicted_ms") is not None
          and r.get("ms_median") is not None and r["cp"] > 1]
  if pred:
    notes.append("cost model predicted / measured ms: " + "; ".join(
        f"{SHORT[r['strategy']]} cp={r['cp']} {r['predicted_ms']:.2f} / "
        f"{r['ms_median']:.2f}" for r in sorted(pred, key=by_cp)))
  for r in select(records, **where):
    if r.get("error"):
      notes.append(f"error in {r['kind']} {SHORT.get(r['strategy'])} "
                   f"cp={r['cp']}: `{str(r['error'])[:160]}`")
  return notes


def _group_section(records, tokens, hkv, pass_name, window) -> list[str]:
  """One configuration's tables: a row per strategy, a column per cp."""
  grp = select(records, kind="cp_attention", tokens=tokens, hkv=hkv,
               pass_name=pass_name, window=window)
  cps = sorted({r["cp"] for r in grp})
  title = (f"## T={tokens}, Hq={grp[0]['hq']}, Hkv={hkv}, "
           f"{PASS_LABEL[pass_name]}"
           + ("" if window is None else f", window {window}"))
  out = [title, "", ("Cells: speed-up · efficiency · median ms · TFLOP/s "
                     "per GPU · predicted imbalance."), ""]
  for dist in sorted({r["dist"] for r in grp}, key=lambda d: (dist_rank(d),
                                                              d)):
    drows = select(grp, dist=dist)
    first = drows[0]
    ndocs = first["num_docs"]
    out += [(f"### {DIST_LABEL.get(dist, dist)} ({ndocs} "
             f"document{'s' if ndocs != 1 else ''}, longest padded "
             f"{first['longest_padded_doc']}, "
             f"max_seqlen {first['max_seqlen']})"), "",
            "| strategy | " + " | ".join(f"cp={c}" for c in cps) + " |",
            "|---|" + "---|" * len(cps)]
    for strategy in STRATEGIES:
      srows = [r for r in drows if r["strategy"] == strategy]
      if not srows:
        continue
      row_id = srows[0]["row_id"]
      cells = [_cell(one(drows, cp=1, row_id=row_id) if c == 1
                     else one(srows, cp=c)) for c in cps]
      out.append(f"| {SHORT[strategy]} | " + " | ".join(cells) + " |")
    notes = _dist_notes(records, drows, dict(
        dist=dist, tokens=tokens, hkv=hkv, pass_name=pass_name,
        window=window))
    out += [""] + [f"- {n}" for n in notes] + [""]
  return out


def render_markdown(records, envs, paired=(),
                    target_rows: Sequence[tuple[str, str, str]] = ()) -> str:
  """``RESULTS.md``: the files read (``envs``), the ``(target, measured,
  verdict)`` rows, the paired speed-ups, one table per configuration (a
  sliding window is a configuration of its own), NO_LOAD_BALANCE's
  imbalance on one document and which strategy to pick (these two from
  records without a window)."""
  out = ["# jax_cp context-parallel attention: benchmark results", ""]
  out += _files_section(envs)
  out += ["## Targets", "", "| target | measured | verdict |",
          "|---|---|---|"]
  out += [f"| {a} | {b} | {c} |" for a, b, c in target_rows]
  out.append("")
  out += paired_rows(paired)
  for group in _groups(records):
    out += _group_section(records, *group)
  full = [r for r in records if r.get("window") is None]
  imb = imbalance_rows(full)
  if imb:
    out += ["## Where NO_LOAD_BALANCE's imbalance shows up (one document)",
            "",
            ("With one document, contiguous chunks give the last rank "
             "(2cp−1)/cp times the mean work, so the speed-up is bounded by "
             "cp²/(2cp−1) (1.33× at cp=2, 2.29× at cp=4, 4.27× at cp=8)."),
            "",
            ("| T | Hkv | pass | cp | (2cp−1)/cp | predicted imb | bound | "
             "measured speed-up | of bound |"),
            "|---|---|---|---|---|---|---|---|---|"] + imb + [""]
  out += ["## Which strategy should I pick?", "",
          recommendation_paragraph(full), ""]
  return "\n".join(out)


def print_table(records, out=sys.stdout) -> None:
  """One line per ``cp_attention`` record."""
  rows = [r for r in records if r["kind"] == "cp_attention"]
  hdr = (f"{'dist':<14}{'T':>7}{'Hkv':>4} {'pass':<8}{'strategy':<16}"
         f"{'cp':>3}{'ms':>10}{'TF/s/GPU':>9}{'speedup':>8}{'eff':>6}"
         f"{'imb':>6}{'expo%':>7}{'stand%':>7}{'vsPrim%':>8}")
  print(hdr, file=out)
  print("-" * len(hdr), file=out)
  f = lambda x, fmt: format(x, fmt) if isinstance(x, (int, float)) else "-"
  for r in rows:
    if r.get("ms_median") is None:
      print(f"{r['dist']:<14}{r['tokens']:>7}{r['hkv']:>4} "
            f"{r['pass_name']:<8}{r['strategy']!s:<16}{r['cp']:>3}  "
            f"ERROR {str(r.get('error'))[:60]}", file=out)
      continue
    pct = lambda k, r=r: f(100 * r[k], ".1f") if k in r else "-"
    print(f"{r['dist']:<14}{r['tokens']:>7}{r['hkv']:>4} {r['pass_name']:<8}"
          f"{r['strategy'] or '(cp=1)'!s:<16}{r['cp']:>3}"
          f"{f(r['ms_median'], '.3f'):>10}"
          f"{f(r.get('tflops_per_gpu'), '.0f'):>9}"
          f"{f(r.get('speedup'), '.2f'):>8}{f(r.get('efficiency'), '.2f'):>6}"
          f"{f(r.get('predicted_imbalance'), '.2f'):>6}"
          f"{pct('exposed_exchange_fraction'):>7}"
          f"{pct('standalone_exchange_fraction'):>7}"
          f"{pct('overhead_vs_primitive'):>8}", file=out)
