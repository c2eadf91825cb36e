"""What XLA scheduled beside each collective of a compiled step.

A scheduled module's text lists each computation's instructions in the
order they run; an asynchronous collective is a ``*-start`` and a
``*-done``, and the work between them runs while its bytes move.
:func:`collectives` gives, per collective of ``compiled.as_text()`` (a
deviceless plan, :mod:`benchmarks.deviceless`), its kind, the bytes of its
result, whether XLA made it synchronous, and what ran beside it: matmul
FLOPs (:mod:`benchmarks.hlo_flops`), ops of the CP attention's
``shard_map`` (its calls and merges), other fusions. :func:`summarize`
totals them per kind; ``unhidden_bytes`` are those of collectives with
neither matmuls nor attention beside them. ``bench_memory --schedule``
records it.
"""

from __future__ import annotations

import re

from benchmarks import hlo_flops

_OP = "all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all"
_LINE = re.compile(rf"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ({_OP})(-start|-done)?"
                   r"\((%[\w.\-]+)?")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_CALLED = re.compile(r"(?:calls|body)=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def array_bytes(type_text: str) -> int:
  """Bytes of every array in an HLO type (a tuple's summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_text):
    n = {"pred": 1, "bf16": 2}.get(dtype) or max(int(dtype[1:]) // 8, 1)
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n
  return total


def _work(line: str, flops: dict) -> tuple[int, int, int]:
  """``(matmul FLOPs, attention ops, other ops)`` of one instruction."""
  if not any(f" {op}(" in line for op in ("fusion", "custom-call", "dot",
                                          "convolution", "while")):
    return 0, 0, 0
  m, trip = _CALLED.search(line), _TRIP.search(line)
  f = flops[m.group(1)].flops if m and m.group(1) in flops else 0
  f *= int(trip.group(1)) if trip else 1
  op = _OP_NAME.search(line)
  name = op.group(1) if op else ""
  attention = ("shard_map/" in name and "ppermute" not in name
               and "optimization_barrier" not in name)
  return f, int(attention), int(not attention and not f)


def collectives(hlo_text: str) -> list[dict]:
  """Every collective, in schedule order per computation: ``{"computation",
  "name", "kind", "bytes", "sync", "matmul_flops", "attention_ops",
  "other_ops"}`` (the last three: what ran between start and done)."""
  comps, _ = hlo_flops.computations(hlo_text)
  flops = hlo_flops.computation_flops(hlo_text)
  out = []
  for comp, lines in comps.items():
    open_: dict[str, dict] = {}
    for line in lines[1:]:
      m = _LINE.match(line)
      if m is None:
        work = _work(line, flops)
        for rec in open_.values():
          for key, x in zip(("matmul_flops", "attention_ops", "other_ops"),
                            work):
            rec[key] += x
        continue
      name, typ, kind, phase, operand = m.groups()
      if phase == "-done" and operand and operand[1:] in open_:
        rec = open_.pop(operand[1:])
        out.append(dict(rec, bytes=array_bytes(typ)))
        continue
      rec = dict(computation=comp, name=name, kind=kind, bytes=0,
                 sync=phase is None, matmul_flops=0, attention_ops=0,
                 other_ops=0)
      if phase is None:
        out.append(dict(rec, bytes=array_bytes(typ)))
      else:
        open_[name] = rec
  return out


def summarize(hlo_text: str) -> dict:
  """Per kind: ``count``, ``bytes``, ``sync`` (how many XLA made
  synchronous), ``beside_attention`` / ``beside_matmul`` (bytes of those
  with attention ops / matmuls beside them), ``unhidden_bytes`` (with
  neither); and the step's ``unhidden_bytes``. A loop body's collectives
  count once."""
  kinds: dict[str, dict] = {}
  for c in collectives(hlo_text):
    k = kinds.setdefault(c["kind"], dict.fromkeys(
        ("count", "bytes", "sync", "beside_attention", "beside_matmul",
         "unhidden_bytes"), 0))
    k["count"] += 1
    k["bytes"] += c["bytes"]
    k["sync"] += int(c["sync"])
    k["beside_attention"] += c["bytes"] if c["attention_ops"] else 0
    k["beside_matmul"] += c["bytes"] if c["matmul_flops"] else 0
    hidden = c["attention_ops"] or c["matmul_flops"]
    k["unhidden_bytes"] += 0 if hidden else c["bytes"]
  return dict(kinds=kinds, unhidden_bytes=sum(k["unhidden_bytes"]
                                              for k in kinds.values()))
