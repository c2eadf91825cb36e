"""What ``bench_cp`` records give once compared with each other.

:func:`derive` adds, in place, the quantities formed across records
(TFLOP/s per GPU, speed-up and efficiency against cp=1 on the same row,
the exposed and standalone exchange shares, the ratios to the references);
:func:`select` and :func:`one` pick records by their fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def select(records: Iterable[dict[str, Any]], **where) -> list[dict[str, Any]]:
  """The records whose fields equal ``where`` (a missing field is None)."""
  return [r for r in records if all(r.get(k) == v for k, v in where.items())]


def one(records, **where) -> dict[str, Any] | None:
  """The first measured record (one with ``ms_median``) matching
  ``where``, or None."""
  found = [r for r in select(records, **where)
           if r.get("ms_median") is not None]
  return found[0] if found else None


def _key(r, **override):
  k = {name: r[name] for name in ("dist", "tokens", "hq", "hkv", "head_dim",
                                  "dtype", "pass_name", "bound")}
  k.update(override)
  return tuple(sorted(k.items()))


def derive(records: list[dict[str, Any]]) -> None:
  """Adds TFLOP/s, speed-ups, efficiencies, exchange fractions and
  reference ratios to the records (of one ``bench_cp`` run), in place."""
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
