"""Result files and their summaries.

* Writing (``bench_cp``): :func:`environment`, :func:`derive` (TFLOP/s,
  speed-ups, exchange shares, reference ratios), :func:`write_json`,
  :func:`print_table`.
* Reading and rendering (``report``): :func:`load` and :func:`load_paired`
  merge result files (the newest wins per configuration),
  :func:`render_markdown` writes ``RESULTS.md`` and :func:`plot` draws
  ``speedup.png`` (with matplotlib; skipped without it).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

DIST_ORDER = ("one_doc", "short_128_1k", "uniform_1k_8k", "stdlib_mix")
DIST_LABEL = {"one_doc": "one document", "short_128_1k": "128–1k docs",
              "uniform_1k_8k": "1k–8k docs",
              "stdlib_mix": "stdlib .py sizes"}
STRATEGIES = ("dual_chunk_swap", "no_load_balance")
SHORT = {"dual_chunk_swap": "DCS", "no_load_balance": "NLB", None: "cp=1"}
PASS_LABEL = {"fwd": "forward", "fwd_bwd": "forward+backward"}
TARGET_T = 65536
# Result files without a ``timing`` field hold synced timings.
DEFAULT_TIMING = "synced"


# ----------------------------------------------------------------- loading


def load(paths: Sequence[str]) -> tuple[list[dict[str, Any]],
                                        list[dict[str, Any]]]:
  """All records (newest file wins on duplicates) and the files' envs."""
  files = []
  for pattern in paths:
    matches = sorted(glob.glob(pattern)) or [pattern]
    for path in matches:
      with open(path) as f:
        data = json.load(f)
      data["_path"] = path
      files.append(data)
  files.sort(key=lambda d: d.get("env", {}).get("date", ""))
  merged: dict[tuple, dict[str, Any]] = {}
  for data in files:
    for r in data.get("records", []):
      key = (r["kind"], r["row_id"], r["cp"], r["strategy"], r["pass_name"],
             r["hkv"], r["hq"], r["head_dim"], r["dtype"], r.get("bound"))
      merged[key] = dict(r, _file=os.path.basename(data["_path"]))
  return list(merged.values()), [dict(d.get("env", {}), path=d["_path"],
                                      args=d.get("args", {}),
                                      summary=d.get("summary", {}))
                                 for d in files]


def load_paired(paths: Sequence[str]) -> list[dict[str, Any]]:
  """speedup_ab.py records, newest file wins per configuration."""
  files = []
  for pattern in paths:
    for path in sorted(glob.glob(pattern)):
      with open(path) as f:
        data = json.load(f)
      files.append((data.get("env", {}).get("date", ""), path, data))
  merged: dict[tuple, dict[str, Any]] = {}
  for date, path, data in sorted(files):
    for r in data.get("records", []):
      key = (r["dist"], r["pass_name"], r["cp"], r["strategy"], r["tokens"],
             r["hkv"], r["hq"], r["head_dim"], r["dtype"], r.get("window"),
             r.get("doc_order", "packed"), r.get("against", "cp1"))
      merged[key] = dict(r, _file=os.path.basename(path), _date=date)
  return list(merged.values())


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
  order = {d: i for i, d in enumerate(DIST_ORDER)}
  for r in sorted(paired, key=lambda r: (r["tokens"], order.get(r["dist"], 9),
                                         r["pass_name"] != "fwd", r["cp"])):
    extra = "".join(
        (f", window {r['window']}" if r.get("window") is not None else "",
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


def select(records: Iterable[dict[str, Any]], **where) -> list[dict[str, Any]]:
  return [r for r in records if all(r.get(k) == v for k, v in where.items())]


def one(records, **where) -> dict[str, Any] | None:
  found = [r for r in select(records, **where)
           if r.get("ms_median") is not None]
  return found[0] if found else None


# ----------------------------------------------------------------- formatting


def _f(x, fmt: str, suffix: str = "") -> str:
  return "–" if x is None else format(x, fmt) + suffix


def _pct(x) -> str:
  return "–" if x is None else f"{100 * x:.1f} %"


def _cell(r: dict[str, Any] | None) -> str:
  if r is None:
    return "–"
  if r.get("ms_median") is None:
    return "error"
  parts = [f"**{_f(r.get('speedup'), '.2f', '×')}**"
           if r["cp"] > 1 else "1.00×"]
  if r["cp"] > 1:
    parts.append(_f(r.get("efficiency") and 100 * r["efficiency"], ".0f",
                    " %"))
  parts.append(f"{r['ms_median']:.3f} ms")
  parts.append(_f(r.get("tflops_per_gpu"), ".0f", " TF/s"))
  parts.append("imb " + _f(r.get("predicted_imbalance"), ".2f"))
  return " · ".join(parts)


def _verdict(ok: bool | None) -> str:
  return {True: "✅ met", False: "❌ missed", None: "— not measured"}[ok]


# ----------------------------------------------------------------- sections


def _groups(records):
  """(tokens, hkv, pass) groups present among cp_attention records."""
  keys = {(r["tokens"], r["hkv"], r["pass_name"])
          for r in records if r["kind"] == "cp_attention"}
  return sorted(keys, key=lambda k: (k[0], k[1], k[2] != "fwd_bwd"))


def target_rows(records, paired=()) -> list[tuple[str, str, str]]:
  """(target, measured, verdict) rows for the speed targets."""
  rows = []
  cpa = select(records, kind="cp_attention")
  hkvs = sorted({r["hkv"] for r in cpa})
  hkv = 8 if 8 in hkvs else (hkvs[0] if hkvs else None)

  def get(**w):
    return one(cpa, **w)

  # 1. cp=2 one doc DCS fwd+bwd >= 1.8x.
  r = get(dist="one_doc", tokens=TARGET_T, hkv=hkv, pass_name="fwd_bwd",
          strategy="dual_chunk_swap", cp=2)
  sp = r and r.get("speedup")
  rows.append(("cp=2, one document, T=64k, DCS, fwd+bwd: speed-up ≥ 1.8×",
               _f(sp, ".2f", "×") + (
                   f" ({r['ms_cp1']:.2f} → {r['ms_median']:.2f} ms)"
                   if sp else ""),
               _verdict(None if sp is None else sp >= 1.8)))
  # 2. cp=2 short docs NLB >= 1.85x and faster than DCS.
  for pass_name in ("fwd_bwd", "fwd"):
    n = get(dist="short_128_1k", tokens=TARGET_T, hkv=hkv,
            pass_name=pass_name, strategy="no_load_balance", cp=2)
    d = get(dist="short_128_1k", tokens=TARGET_T, hkv=hkv,
            pass_name=pass_name, strategy="dual_chunk_swap", cp=2)
    sp = n and n.get("speedup")
    faster = (None if n is None or d is None
              else n["ms_median"] < d["ms_median"])
    ok = None if sp is None else (sp >= 1.85 and faster is not False)
    bound = n and n.get("max_seqlen")
    rows.append((
        (f"cp=2, 128–1k docs, T=64k, NLB (max_seqlen={bound}), "
         f"{PASS_LABEL[pass_name]}: speed-up ≥ 1.85× and faster than DCS"),
        (f"{_f(sp, '.2f', '×')}; NLB {_f(n and n['ms_median'], '.3f')} ms vs "
         f"DCS {_f(d and d['ms_median'], '.3f')} ms"), _verdict(ok)))
  # 2b. NLB with the bounded (halo) exchange, cp=2 vs cp=1 >= 1.8x. The
  # verdict follows the paired measurement when there is one (it cancels
  # drift).
  for dist in ("short_128_1k", "uniform_1k_8k"):
    for pass_name in ("fwd", "fwd_bwd"):
      n = get(dist=dist, tokens=TARGET_T, hkv=hkv, pass_name=pass_name,
              strategy="no_load_balance", cp=2)
      b = n and get(row_id=n["row_id"], hkv=hkv, pass_name=pass_name, cp=1)
      pr = [r for r in paired if r["dist"] == dist and r["cp"] == 2 and
            r["pass_name"] == pass_name and r["tokens"] == TARGET_T and
            r["strategy"] == "no_load_balance" and r["hkv"] == hkv and
            r.get("window") is None and
            r.get("doc_order", "packed") == "packed" and
            r.get("against", "cp1") == "cp1"]
      sp = n and n.get("speedup")
      text = _f(sp, ".2f", "×") + (f" ({n['ms_cp1']:.3f} → "
                                   f"{n['ms_median']:.3f} ms, "
                                   f"{n.get('timing', DEFAULT_TIMING)})"
                                   if sp else "")
      best = sp
      if n and b and n.get("ms_steady_median") and b.get("ms_steady_median"):
        best = b["ms_steady_median"] / n["ms_steady_median"]
        text += f"; steady {best:.2f}×"
      if pr:
        best = pr[0]["speedup_median"]
        text += (f"; paired {best:.3f}× (IQR {pr[0]['speedup_q1']:.3f}–"
                 f"{pr[0]['speedup_q3']:.3f})")
      rows.append((
          (f"cp=2, {DIST_LABEL[dist]}, T=64k, NLB with max_seqlen "
           f"{n and n.get('max_seqlen')} (halo exchange), "
           f"{PASS_LABEL[pass_name]}: speed-up ≥ 1.8× vs cp=1"), text,
          _verdict(None if best is None else best >= 1.8)))
  # 3. exposed exchange <= 10 % at T=64k, Hkv=8.
  for dist in DIST_ORDER:
    cands = [r for r in select(cpa, dist=dist, tokens=TARGET_T, hkv=hkv)
             if r["cp"] > 1 and r.get("exposed_exchange_fraction") is not None]
    if not cands:
      continue
    worst = max(cands, key=lambda r: r["exposed_exchange_fraction"])
    stand = [r.get("standalone_exchange_fraction") for r in cands
             if r.get("standalone_exchange_fraction") is not None]
    rows.append((
        (f"exposed all-gather (+reorder) ≤ 10 % of the step, T=64k, "
         f"Hkv={hkv}, {DIST_LABEL.get(dist, dist)} (worst of cp × strategy × "
         f"pass)"),
        (f"exposed {_pct(worst['exposed_exchange_fraction'])} "
         f"({SHORT[worst['strategy']]} cp={worst['cp']} "
         f"{worst['pass_name']}); standalone gather+reorder up to "
         f"{_pct(max(stand) if stand else None)}"),
        _verdict(worst["exposed_exchange_fraction"] <= 0.10)))
  # 4. cp=1 within 5 % of the primitive.
  for pass_name in ("fwd_bwd", "fwd"):
    cands = [r for r in select(cpa, cp=1, tokens=TARGET_T, hkv=hkv,
                               pass_name=pass_name)
             if r.get("overhead_vs_primitive") is not None]
    if not cands:
      continue
    worst = max(cands, key=lambda r: r["overhead_vs_primitive"])
    rows.append((
        (f"cp=1 cp_attention within 5 % of fused_attention, T=64k, "
         f"{PASS_LABEL[pass_name]} (worst distribution)"),
        (f"{100 * worst['overhead_vs_primitive']:+.1f} % "
         f"({DIST_LABEL.get(worst['dist'], worst['dist'])}: "
         f"{worst['ms_median']:.3f} vs {worst['primitive_ms']:.3f} ms)"),
        _verdict(worst["overhead_vs_primitive"] <= 0.05)))
  # 5./6. follow-up: cp=4 efficiencies.
  for dist, strategy, t in (("one_doc", "dual_chunk_swap", 131072),
                            ("short_128_1k", "no_load_balance", TARGET_T)):
    for tokens in sorted({t, TARGET_T, 131072}):
      r = get(dist=dist, tokens=tokens, hkv=hkv, pass_name="fwd_bwd",
              strategy=strategy, cp=4)
      if r is None and tokens != t:
        continue
      eff = r and r.get("efficiency")
      rows.append((
          (f"cp=4, {DIST_LABEL[dist]}, T={tokens // 1024}k, "
           f"{SHORT[strategy]}, fwd+bwd: efficiency ≥ 85 %"),
          _f(eff and 100 * eff, ".1f", " %"),
          _verdict(None if eff is None else eff >= 0.85)))
  return rows


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
               f"{_f(r.get('predicted_imbalance'), '.3f')} | "
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
  for dist in sorted(wins, key=lambda x: DIST_ORDER.index(x)
                     if x in DIST_ORDER else 99):
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


def render_markdown(records, envs, paired=()) -> str:
  out = ["# jax_cp context-parallel attention: benchmark results", ""]
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
        f"{_f(s.get('wall_s'), '.0f')} s; timing "
        f"{env.get('args', {}).get('timing', DEFAULT_TIMING)}")
  out += ["",
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

  out += ["## Targets", "", "| target | measured | verdict |",
          "|---|---|---|"]
  out += [f"| {a} | {b} | {c} |" for a, b, c in target_rows(records,
                                                             paired)]
  out.append("")
  out += paired_rows(paired)

  for tokens, hkv, pass_name in _groups(records):
    grp = select(records, kind="cp_attention", tokens=tokens, hkv=hkv,
                 pass_name=pass_name)
    cps = sorted({r["cp"] for r in grp})
    hq = grp[0]["hq"]
    out += [f"## T={tokens}, Hq={hq}, Hkv={hkv}, {PASS_LABEL[pass_name]}",
            "",
            ("Cells: speed-up · efficiency · median ms · TFLOP/s per GPU · "
             "predicted imbalance."),
            ""]
    for dist in DIST_ORDER + tuple(sorted({r["dist"] for r in grp}
                                          - set(DIST_ORDER))):
      drows = select(grp, dist=dist)
      if not drows:
        continue
      any_r = drows[0]
      ndocs = any_r["num_docs"]
      out += [(f"### {DIST_LABEL.get(dist, dist)} ({ndocs} "
               f"document{'s' if ndocs != 1 else ''}, longest padded "
               f"{any_r['longest_padded_doc']}, "
               f"max_seqlen {any_r['max_seqlen']})"), "",
              "| strategy | " + " | ".join(f"cp={c}" for c in cps) + " |",
              "|---|" + "---|" * len(cps)]
      for strategy in STRATEGIES:
        srows = [r for r in drows if r["strategy"] == strategy]
        if not srows:
          continue
        row_id = srows[0]["row_id"]
        cells = []
        for c in cps:
          if c == 1:
            cells.append(_cell(one(drows, cp=1, row_id=row_id)))
          else:
            cells.append(_cell(one(srows, cp=c)))
        out.append(f"| {SHORT[strategy]} | " + " | ".join(cells) + " |")
      prims = [r for r in drows if r["cp"] == 1
               and r.get("primitive_ms") is not None]
      notes = []
      for r in prims:
        notes.append(f"cp=1 ({r['layout']}) vs fused_attention: "
                     f"{r['ms_median']:.3f} vs {r['primitive_ms']:.3f} ms "
                     f"({100 * r['overhead_vs_primitive']:+.1f} %)")
      dense = one(records, kind="dense_reference", dist=dist, tokens=tokens,
                  hkv=hkv, pass_name=pass_name)
      if dense is not None:
        impl = "cuDNN" if dense.get("backend") == "cudnn" else "XLA"
        notes.append(f"jax.nn.dot_product_attention ({impl}, dense causal): "
                     f"{dense['ms_median']:.3f} ms, "
                     f"{_f(dense.get('tflops_per_gpu'), '.0f')} TFLOP/s")
      exch = [r for r in drows if r["cp"] > 1 and (
          r.get("exposed_exchange_fraction") is not None
          or r.get("standalone_exchange_fraction") is not None)]
      if exch:
        notes.append("exchange share of the step (exposed / standalone): " +
                     "; ".join(
                         f"{SHORT[r['strategy']]} cp={r['cp']} "
                         f"{_pct(r.get('exposed_exchange_fraction'))} / "
                         f"{_pct(r.get('standalone_exchange_fraction'))}"
                         for r in sorted(exch, key=lambda r: (r['strategy'],
                                                              r['cp']))))
      pred = [r for r in drows if r.get("predicted_ms") is not None
              and r.get("ms_median") is not None and r["cp"] > 1]
      if pred:
        notes.append("cost model predicted / measured ms: " + "; ".join(
            f"{SHORT[r['strategy']]} cp={r['cp']} {r['predicted_ms']:.2f} / "
            f"{r['ms_median']:.2f}" for r in sorted(
                pred, key=lambda r: (r['strategy'], r['cp']))))
      errors = [r for r in select(records, dist=dist, tokens=tokens, hkv=hkv,
                                  pass_name=pass_name) if r.get("error")]
      for r in errors:
        notes.append(f"error in {r['kind']} {SHORT.get(r['strategy'])} "
                     f"cp={r['cp']}: `{str(r['error'])[:160]}`")
      out += [""] + [f"- {n}" for n in notes] + [""]

  imb = imbalance_rows(records)
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
          recommendation_paragraph(records), ""]
  return "\n".join(out)


def plot(records, path: str) -> str | None:
  """Grouped bars: speed-up per distribution, per strategy and cp (the
  largest T and the first Hkv present, forward+backward if measured)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  cpa = [r for r in select(records, kind="cp_attention")
         if r.get("speedup") is not None and r["cp"] > 1]
  if not cpa:
    return None
  passes = [p for p in ("fwd_bwd", "fwd") if any(r["pass_name"] == p
                                                for r in cpa)]
  tokens = TARGET_T if any(r["tokens"] == TARGET_T for r in cpa) else max(
      r["tokens"] for r in cpa)
  hkvs = sorted({r["hkv"] for r in cpa})
  hkv = 8 if 8 in hkvs else hkvs[0]
  fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.2),
                           squeeze=False)
  for ax, pass_name in zip(axes[0], passes):
    sel = select(cpa, tokens=tokens, hkv=hkv, pass_name=pass_name)
    dists = [d for d in DIST_ORDER if any(r["dist"] == d for r in sel)]
    series = sorted({(r["strategy"], r["cp"]) for r in sel},
                    key=lambda s: (s[1], s[0]))
    width = 0.8 / max(len(series), 1)
    for i, (strategy, cp) in enumerate(series):
      ys = []
      for d in dists:
        r = one(sel, dist=d, strategy=strategy, cp=cp)
        ys.append(r["speedup"] if r else 0.0)
      xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(dists))]
      ax.bar(xs, ys, width, label=f"{SHORT[strategy]} cp={cp}",
             hatch="//" if strategy == "no_load_balance" else None,
             color=f"C{sorted({c for _, c in series}).index(cp)}",
             alpha=0.6 if strategy == "no_load_balance" else 1.0)
    for cp in sorted({c for _, c in series}):
      ax.axhline(cp, color="gray", lw=0.8, ls=":")
    ax.set_xticks(range(len(dists)))
    ax.set_xticklabels([DIST_LABEL.get(d, d) for d in dists])
    ax.set_ylabel("speed-up over cp=1")
    ax.set_title(f"{PASS_LABEL[pass_name]}, T={tokens}, Hkv={hkv}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ----------------------------------------------------------------- writing


def environment() -> dict[str, Any]:
  """Date, versions and devices of this process, for a result file."""
  # Imported here: rendering (report) needs only the standard library.
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel

  import jax_cp  # pylint: disable=import-outside-toplevel
  env = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
         "jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "jax_cp": jax_cp.__version__, "python": sys.version.split()[0],
         "platform": jax.default_backend(),
         "device_kind": jax.devices()[0].device_kind,
         "device_count": jax.device_count(), "cudnn": None}
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    if cuda_versions is not None:
      env["cudnn"] = int(cuda_versions.cudnn_get_version())
      env["cuda_runtime"] = int(cuda_versions.cuda_runtime_get_version())
  except Exception:  # noqa: BLE001, S110  (no CUDA in this jaxlib)
    pass
  return env


def _key(r, **override):
  k = {name: r[name] for name in ("dist", "tokens", "hq", "hkv", "head_dim",
                                  "dtype", "pass_name", "bound")}
  k.update(override)
  return tuple(sorted(k.items()))


def derive(records: list[dict[str, Any]]) -> None:
  """Adds TFLOP/s, speed-ups, efficiencies, exchange fractions and
  reference ratios to the records, in place."""
  ok = [r for r in records if r.get("ms_median") is not None]
  by = {}
  for r in ok:
    by[_key(r, kind=r["kind"], row_id=r["row_id"], cp=r["cp"],
            strategy=r["strategy"])] = r
  for r in ok:
    r["tflops_per_gpu"] = r["flops"] / (r["ms_median"] * 1e-3) / r["cp"] / 1e12
  for r in ok:
    if r["kind"] != "cp_attention":
      continue
    base = by.get(_key(r, kind="cp_attention", row_id=r["row_id"], cp=1,
                       strategy=None))
    if base is not None:
      r["ms_cp1"] = base["ms_median"]
      r["speedup"] = base["ms_median"] / r["ms_median"]
      r["efficiency"] = r["speedup"] / r["cp"]
    if r["cp"] > 1:
      nc = by.get(_key(r, kind="cp_attention_nocomm", row_id=r["row_id"],
                       cp=r["cp"], strategy=r["strategy"]))
      if nc is not None:
        if nc.get("note"):
          r["exposed_caveat"] = nc["note"]
        r["nocomm_ms"] = nc["ms_median"]
        r["exposed_exchange_ms"] = r["ms_median"] - nc["ms_median"]
        r["exposed_exchange_fraction"] = (r["exposed_exchange_ms"]
                                          / r["ms_median"])
      ex = by.get(_key(r, kind="exchange_standalone", row_id=r["row_id"],
                       cp=r["cp"], strategy=r["strategy"]))
      if ex is not None:
        r["standalone_exchange_ms"] = ex["ms_median"]
        r["standalone_exchange_fraction"] = ex["ms_median"] / r["ms_median"]
    else:
      prim = by.get(_key(r, kind="fused_primitive", row_id=r["row_id"], cp=1,
                         strategy=None))
      if prim is not None:
        r["primitive_ms"] = prim["ms_median"]
        r["overhead_vs_primitive"] = r["ms_median"] / prim["ms_median"] - 1
      dense = [x for x in ok if x["kind"] == "dense_reference"
               and _key(x) == _key(r) and r["dist"] == "one_doc"]
      if dense:
        r["dense_ms"] = dense[0]["ms_median"]


def write_json(path: str, payload: dict[str, Any]) -> None:
  """Writes ``payload`` atomically (a run cut short leaves a valid file)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, default=str)
  os.replace(tmp, path)


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


