"""What XLA scheduled beside each collective of a compiled step.

A scheduled module's text lists each computation's instructions in the
order they run. An asynchronous collective is a ``*-start`` and a
``*-done``; the work listed between them runs while the bytes move. For
each collective of a compiled step (``compiled.as_text()``, e.g. a
deviceless plan, :mod:`benchmarks.deviceless`) :func:`collectives` gives
its kind, the bytes of its result, what ran beside it (matmul FLOPs from
:mod:`benchmarks.hlo_flops`, the CP attention work inside the
``shard_map``, other fusions) and whether it is synchronous (XLA found
nothing to overlap). :func:`summarize` totals them per kind: the bytes of
collectives with no matmul and no attention work beside them are the ones
no compute hides (``unhidden_bytes``).

``bench_memory --schedule`` records the summary with each plan.
"""

from __future__ import annotations

import re

from benchmarks import hlo_flops

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
         "all-to-all")
_OP = "|".join(KINDS)
_START = re.compile(rf"^\s*(?:ROOT )?%([\w.\-]+) = .*? ({_OP})-start\(")
_DONE = re.compile(rf"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ({_OP})-done\("
                   r"%([\w.\-]+)")
_SYNC = re.compile(rf"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ({_OP})\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BYTES = {"pred": 1, "bf16": 2}


def array_bytes(type_text: str) -> int:
  """Bytes of every array in an HLO type (a tuple's summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    size = _BYTES.get(dtype) or max(int(dtype[1:]) // 8, 1)
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * size
  return total


def _is_attention(line: str) -> bool:
  """Work of the CP attention's ``shard_map`` (its calls, merges and
  metadata), not its collectives or barriers."""
  m = _OP_NAME.search(line)
  name = m.group(1) if m else ""
  return ("shard_map/" in name and "ppermute" not in name
          and "optimization_barrier" not in name
          and (" fusion(" in line or " custom-call(" in line))


def _work(line: str, flops: dict) -> tuple[int, int, int]:
  """``(matmul FLOPs, attention ops, other fusions)`` of one
  instruction."""
  if " while(" in line:
    body = _BODY.search(line)
    trip = _TRIP.search(line)
    f = flops[body.group(1)].flops if body and body.group(1) in flops else 0
    return f * (int(trip.group(1)) if trip else 1), 0, 1
  if not (" fusion(" in line or " custom-call(" in line or " dot(" in line
          or " convolution(" in line):
    return 0, 0, 0
  m = _CALLS.search(line)
  f = flops[m.group(1)].flops if m and m.group(1) in flops else 0
  if _is_attention(line):
    return f, 1, 0
  return f, 0, 0 if f else 1


def collectives(hlo_text: str) -> list[dict]:
  """Every collective of the module, in schedule order per computation:
  ``{"computation", "name", "kind", "bytes", "sync", "matmul_flops",
  "attention_ops", "other_ops"}`` (the last three: what ran between its
  start and its done)."""
  comps, _ = hlo_flops.computations(hlo_text)
  flops = hlo_flops.computation_flops(hlo_text)
  out = []
  for comp, lines in comps.items():
    open_: dict[str, dict] = {}
    for line in lines:
      done = _DONE.match(line)
      if done and done.group(4) in open_:
        rec = open_.pop(done.group(4))
        rec["bytes"] = array_bytes(done.group(2))
        out.append(rec)
        continue
      start = _START.match(line)
      if start:
        open_[start.group(1)] = dict(
            computation=comp, name=start.group(1), kind=start.group(2),
            bytes=0, sync=False, matmul_flops=0, attention_ops=0,
            other_ops=0)
        continue
      sync = _SYNC.match(line)
      if sync:
        out.append(dict(computation=comp, name=sync.group(1),
                        kind=sync.group(3), bytes=array_bytes(sync.group(2)),
                        sync=True, matmul_flops=0, attention_ops=0,
                        other_ops=0))
        continue
      f, a, o = _work(line, flops)
      for rec in open_.values():
        rec["matmul_flops"] += f
        rec["attention_ops"] += a
        rec["other_ops"] += o
  return out


def summarize(hlo_text: str) -> dict:
  """Per collective kind: ``count``, ``bytes``, ``sync`` (how many XLA
  made synchronous), ``beside_attention`` / ``beside_matmul`` (bytes of
  those with CP attention work / matmuls between start and done) and
  ``unhidden_bytes`` (bytes of those with neither); and the step's
  ``unhidden_bytes`` in all. Bytes of a collective in a loop body count
  once."""
  kinds: dict[str, dict] = {}
  for c in collectives(hlo_text):
    k = kinds.setdefault(c["kind"], dict(
        count=0, bytes=0, sync=0, beside_attention=0, beside_matmul=0,
        unhidden_bytes=0))
    k["count"] += 1
    k["bytes"] += c["bytes"]
    k["sync"] += int(c["sync"])
    if c["attention_ops"]:
      k["beside_attention"] += c["bytes"]
    if c["matmul_flops"]:
      k["beside_matmul"] += c["bytes"]
    if not (c["attention_ops"] or c["matmul_flops"]):
      k["unhidden_bytes"] += c["bytes"]
  return dict(kinds=kinds, unhidden_bytes=sum(k["unhidden_bytes"]
                                              for k in kinds.values()))
