"""Lowering programs for CUDA on a machine without a GPU, and reading the
custom calls out of the StableHLO (for the tests that count or inspect the
cuDNN backend's calls)."""

import re

import jax

_CALL_RE = re.compile(
    r"stablehlo\.custom_call @(?P<name>\w+)\((?P<args>[^)]*)\)\s*"
    r"\{(?P<attrs>.*)\}"
    r"\s*:\s*\((?P<in>[^)]*)\)\s*->\s*(?P<out>.+)$")


def lower_for_cuda(fn, *args) -> str:
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str, name: str):
  """[(attributes dict, operand types, result types)] of calls to `name`."""
  calls = []
  for line in text.splitlines():
    m = _CALL_RE.search(line)
    if not m or m.group("name") != name:
      continue
    cfg = re.search(r"mhlo\.backend_config = \{([^}]*)\}", m.group("attrs"))
    attrs = {}
    for item in cfg.group(1).split(", "):
      key, value = item.split(" = ")
      attrs[key] = value
    out = m.group("out").strip()
    out = out[1:-1] if out.startswith("(") else out
    calls.append((attrs, m.group("in").split(", "), out.split(", ")))
  return calls
