"""Matmul FLOPs of a compiled XLA program, read from its optimized HLO text.

XLA's own ``cost_analysis()`` counts a while loop's body once, whatever its
trip count, and has no answer for a program compiled for a GPU that is not
here; a step whose layers, MLP chunks or loss chunks run in loops is
therefore counted here instead: every ``dot`` (2 × output elements × the
contracted size), in every computation the entry reaches, times the number
of times it runs (a while body ``known_trip_count`` times, a fusion or call
once per call site, the larger branch of a conditional). A GEMM that the
GPU backend handed to cuBLAS (a ``__cublas$gemm`` or ``__cublas$lt$matmul``
custom call, which is what the autotuner picks for many large matmuls on a
real GPU, while a deviceless compile keeps them as Triton fusions of
``dot``) counts the same as the ``dot`` it replaced, from its output shape,
its first operand and the contracting dimensions in its backend config.
Other custom calls (the cuDNN attention) count nothing.

The count says what a program recomputes: the same model run with
``remat="full"`` counts its forward matmuls twice, and a chunked MLP whose
loop re-runs a chunk's forward in the backward counts what that adds.

API: ``dot_flops(hlo_text) -> DotFlops(flops, loops_without_trip_count)``;
a loop whose trip count XLA did not record is counted once and reported.
``computation_flops(hlo_text)`` gives the same count for every computation
(what one call of it runs), and ``computations(hlo_text)`` the lines of
each (its header first, then its instructions in the printed order: for a
scheduled module, the schedule's).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+): \w+\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\((?:\w+\[([\d,]*)\]\S* )?"
                  r"%([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# A cuBLAS GEMM: its (first) output shape, its lhs operand (shape printed
# inline or looked up by name) and the lhs contracting dimensions of its
# gemm_backend_config (numbers, quoted or not).
_GEMM = re.compile(r"= \(?\w+\[([\d,]*)\][^%]*? custom-call\("
                   r"(?:\w+\[([\d,]*)\]\S* )?%([\w.\-]+)")
_GEMM_TARGET = 'custom_call_target="__cublas$'
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"body=%?([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
    r"false_computation=%?([\w.\-]+))")


class DotFlops(NamedTuple):
  """``flops``: matmul FLOPs of one run of the program;
  ``loops_without_trip_count``: while loops with matmuls counted once for
  want of a known trip count (0 when ``flops`` is exact)."""

  flops: int
  loops_without_trip_count: int


def _dims(text: str) -> list[int]:
  return [int(x.strip().strip('"')) for x in text.split(",") if x.strip()]


def _product(dims: list[int]) -> int:
  out = 1
  for d in dims:
    out *= d
  return out


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """``({computation: its instruction lines}, entry name)`` of an HLO
  module's text."""
  comps: dict[str, list[str]] = {}
  entry = cur = None
  for line in hlo_text.splitlines():
    m = _HEADER.match(line)
    if m:
      cur, entry = m.group(2), m.group(2) if m.group(1) else entry
      comps[cur] = [line]
    elif cur is not None:
      comps[cur].append(line)
  if entry is None:
    raise ValueError("hlo_text has no ENTRY computation")
  return comps, entry


def computation_flops(hlo_text: str) -> dict[str, DotFlops]:
  """Matmul FLOPs of one call of each computation of ``hlo_text``, its
  callees included (see the module docstring)."""
  comps, _ = computations(hlo_text)
  shapes = {name: dict(_PARAM.findall(_HEADER.match(lines[0]).group(3)))
            | {d.group(1): d.group(2) for d in map(_DEF.match, lines) if d}
            for name, lines in comps.items()}
  own: dict[str, int] = {}
  # Per computation: (callee, times) and groups of branches (the larger).
  calls: dict[str, list[tuple[str, int | None]]] = {}
  branches: dict[str, list[list[str]]] = {}
  for name, lines in comps.items():
    flops, out_calls, out_branches = 0, [], []
    for line in lines:
      m, contracting = _DOT.search(line), _CONTRACTING
      if m is None and _GEMM_TARGET in line:
        m, contracting = _GEMM.search(line), _GEMM_CONTRACTING
      if m:
        lhs = m.group(2) if m.group(2) is not None else \
            shapes[name][m.group(3)]
        lhs_dims = _dims(lhs)
        k = _product([lhs_dims[i] for i in
                      _dims(contracting.search(line).group(1))])
        flops += 2 * _product(_dims(m.group(1))) * k
      if " while(" in line:
        trip = _TRIP.search(line)
        out_calls.append((_BODY.search(line).group(1),
                          int(trip.group(1)) if trip else None))
        continue
      out_calls += [(c, 1) for c in _CALLS.findall(line)]
      for b in _BRANCHES.finditer(line):
        group = (b.group(1).split(",") if b.group(1) is not None
                 else [b.group(2), b.group(3)])
        out_branches.append([g.strip().lstrip("%") for g in group])
    own[name], calls[name], branches[name] = flops, out_calls, out_branches

  @functools.cache
  def total(name: str) -> tuple[int, int]:
    flops, unknown = own.get(name, 0), 0
    for callee, times in calls.get(name, []):
      f, u = total(callee)
      if times is None and f:
        unknown += 1
      flops += f * (1 if times is None else times)
      unknown += u
    for group in branches.get(name, []):
      f, u = max(total(b) for b in group)
      flops, unknown = flops + f, unknown + u
    return flops, unknown

  return {name: DotFlops(*total(name)) for name in comps}


def dot_flops(hlo_text: str) -> DotFlops:
  """Matmul FLOPs of the optimized HLO module ``hlo_text``
  (``compiled.as_text()``); see the module docstring."""
  _, entry = computations(hlo_text)
  return computation_flops(hlo_text)[entry]
