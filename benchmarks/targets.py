"""The speed targets, checked against measurements.

The targets are data, in ``targets.json`` (:func:`load_targets`): per
target the configuration, the threshold and the name of its check. The
checks, here, say how a target is measured:

* ``speedup``: cp=N over cp=1 on the same row, ``>= min``;
* ``speedup_and_faster``: the same, and faster than strategy ``than``;
* ``paired_speedup``: the same, judged on ``speedup_ab``'s paired speed-up
  when there is one (it cancels drift), else the steady, else the
  ``bench_cp`` speed-up;
* ``exposed_exchange``: the worst exposed exchange share of the step over
  cp > 1, strategies and passes, ``<= max``;
* ``overhead_vs_primitive``: cp=1 ``cp_attention`` over the primitive, the
  worst distribution, ``<= max``;
* ``efficiency``: speed-up / cp, ``>= min``.

:func:`target_rows` turns them into ``(target, measured, verdict)`` rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from benchmarks.derived import one, select
from benchmarks.names import DIST_LABEL, PASS_LABEL, SHORT, fmt_tokens
from benchmarks.results import DEFAULT_TIMING
from benchmarks.tables import number, percent, verdict

TARGETS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "targets.json")

Row = tuple[str, str, str]


def load_targets(path: str = TARGETS_PATH) -> dict[str, Any]:
  """The targets data: ``{"tokens": default T, "hkv": preferred Hkv,
  "targets": [...]}``."""
  with open(path) as f:
    return json.load(f)


def _where(t: dict[str, Any]) -> str:
  """``cp=2, one document, T=64k, DCS`` for a target."""
  return (f"cp={t['cp']}, {DIST_LABEL.get(t['dist'], t['dist'])}, "
          f"T={fmt_tokens(t['tokens'])}, {SHORT[t['strategy']]}")


def _get(cpa, t, hkv, **override):
  w = dict(dist=t["dist"], tokens=t["tokens"], hkv=hkv, pass_name=t["pass"],
           strategy=t["strategy"], cp=t["cp"])
  w.update(override)
  return one(cpa, **w)


def _speedup(cpa, paired, t, hkv) -> Row | None:
  r = _get(cpa, t, hkv)
  sp = r and r.get("speedup")
  if sp is None and t.get("optional"):
    return None
  return (f"{_where(t)}, {PASS_LABEL[t['pass']]}: speed-up ≥ "
          f"{t['min']:g}×",
          number(sp, ".2f", "×") + (
              f" ({r['ms_cp1']:.2f} → {r['ms_median']:.2f} ms)" if sp else ""),
          verdict(None if sp is None else sp >= t["min"]))


def _speedup_and_faster(cpa, paired, t, hkv) -> Row | None:
  n = _get(cpa, t, hkv)
  d = _get(cpa, t, hkv, strategy=t["than"])
  sp = n and n.get("speedup")
  if sp is None and t.get("optional"):
    return None
  faster = None if n is None or d is None else n["ms_median"] < d["ms_median"]
  ok = None if sp is None else (sp >= t["min"] and faster is not False)
  mine, other = SHORT[t["strategy"]], SHORT[t["than"]]
  return (f"{_where(t)} (max_seqlen={n and n.get('max_seqlen')}), "
          f"{PASS_LABEL[t['pass']]}: speed-up ≥ {t['min']:g}× and faster "
          f"than {other}",
          f"{number(sp, '.2f', '×')}; {mine} "
          f"{number(n and n['ms_median'], '.3f')} ms vs {other} "
          f"{number(d and d['ms_median'], '.3f')} ms", verdict(ok))


def _paired_speedup(cpa, paired, t, hkv) -> Row | None:
  n = _get(cpa, t, hkv)
  b = n and one(cpa, row_id=n["row_id"], hkv=hkv, pass_name=t["pass"], cp=1)
  pr = [r for r in paired if r["dist"] == t["dist"] and r["cp"] == t["cp"]
        and r["pass_name"] == t["pass"] and r["tokens"] == t["tokens"]
        and r["strategy"] == t["strategy"] and r["hkv"] == hkv
        and r.get("window") is None
        and r.get("doc_order", "packed") == "packed"
        and r.get("against", "cp1") == "cp1"]
  sp = n and n.get("speedup")
  text = number(sp, ".2f", "×") + (
      f" ({n['ms_cp1']:.3f} → {n['ms_median']:.3f} ms, "
      f"{n.get('timing', DEFAULT_TIMING)})" if sp else "")
  best = sp
  if n and b and n.get("ms_steady_median") and b.get("ms_steady_median"):
    best = b["ms_steady_median"] / n["ms_steady_median"]
    text += f"; steady {best:.2f}×"
  if pr:
    best = pr[0]["speedup_median"]
    text += (f"; paired {best:.3f}× (IQR {pr[0]['speedup_q1']:.3f}–"
             f"{pr[0]['speedup_q3']:.3f})")
  if best is None and t.get("optional"):
    return None
  return (f"{_where(t)} with max_seqlen {n and n.get('max_seqlen')} "
          f"(halo exchange), {PASS_LABEL[t['pass']]}: speed-up ≥ "
          f"{t['min']:g}× vs cp=1", text,
          verdict(None if best is None else best >= t["min"]))


def _exposed_exchange(cpa, paired, t, hkv) -> Row | None:
  cands = [r for r in select(cpa, dist=t["dist"], tokens=t["tokens"], hkv=hkv)
           if r["cp"] > 1 and r.get("exposed_exchange_fraction") is not None]
  if not cands:
    return None if t.get("optional") else (
        _exposed_label(t, hkv), "–", verdict(None))
  worst = max(cands, key=lambda r: r["exposed_exchange_fraction"])
  stand = [r.get("standalone_exchange_fraction") for r in cands
           if r.get("standalone_exchange_fraction") is not None]
  return (_exposed_label(t, hkv),
          (f"exposed {percent(worst['exposed_exchange_fraction'])} "
           f"({SHORT[worst['strategy']]} cp={worst['cp']} "
           f"{worst['pass_name']}); standalone gather+reorder up to "
           f"{percent(max(stand) if stand else None)}"),
          verdict(worst["exposed_exchange_fraction"] <= t["max"]))


def _exposed_label(t, hkv) -> str:
  return (f"exposed all-gather (+reorder) ≤ {100 * t['max']:g} % of the "
          f"step, T={fmt_tokens(t['tokens'])}, Hkv={hkv}, "
          f"{DIST_LABEL.get(t['dist'], t['dist'])} (worst of cp × strategy "
          f"× pass)")


def _overhead_vs_primitive(cpa, paired, t, hkv) -> Row | None:
  label = (f"cp=1 cp_attention within {100 * t['max']:g} % of "
           f"fused_attention, T={fmt_tokens(t['tokens'])}, "
           f"{PASS_LABEL[t['pass']]} (worst distribution)")
  cands = [r for r in select(cpa, cp=1, tokens=t["tokens"], hkv=hkv,
                             pass_name=t["pass"])
           if r.get("overhead_vs_primitive") is not None]
  if not cands:
    return None if t.get("optional") else (label, "–", verdict(None))
  worst = max(cands, key=lambda r: r["overhead_vs_primitive"])
  return (label,
          (f"{100 * worst['overhead_vs_primitive']:+.1f} % "
           f"({DIST_LABEL.get(worst['dist'], worst['dist'])}: "
           f"{worst['ms_median']:.3f} vs {worst['primitive_ms']:.3f} ms)"),
          verdict(worst["overhead_vs_primitive"] <= t["max"]))


def _efficiency(cpa, paired, t, hkv) -> Row | None:
  r = _get(cpa, t, hkv)
  if r is None and t.get("optional"):
    return None
  eff = r and r.get("efficiency")
  return (f"{_where(t)}, {PASS_LABEL[t['pass']]}: efficiency ≥ "
          f"{100 * t['min']:g} %", number(eff and 100 * eff, ".1f", " %"),
          verdict(None if eff is None else eff >= t["min"]))


CHECKS: dict[str, Callable[..., Row | None]] = {
    "speedup": _speedup, "speedup_and_faster": _speedup_and_faster,
    "paired_speedup": _paired_speedup, "exposed_exchange": _exposed_exchange,
    "overhead_vs_primitive": _overhead_vs_primitive,
    "efficiency": _efficiency}


def target_rows(records, paired=(), targets: dict[str, Any] | None = None
                ) -> list[Row]:
  """``(target, measured, verdict)`` rows, one per target of ``targets``
  (default: ``targets.json``) except optional ones not measured. Only
  records and pairs without a sliding window count."""
  targets = load_targets() if targets is None else targets
  cpa = [r for r in select(records, kind="cp_attention")
         if r.get("window") is None]
  hkvs = sorted({r["hkv"] for r in cpa})
  hkv = targets.get("hkv")
  if hkv not in hkvs:
    hkv = hkvs[0] if hkvs else None
  rows = []
  for entry in targets["targets"]:
    t = dict({"tokens": targets["tokens"]}, **entry)
    if t["check"] not in CHECKS:
      raise ValueError(f"target check {t['check']!r} unknown; expected one "
                       f"of {sorted(CHECKS)}")
    row = CHECKS[t["check"]](cpa, paired, t, hkv)
    if row is not None:
      rows.append(row)
  return rows
