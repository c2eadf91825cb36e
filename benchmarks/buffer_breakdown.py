"""Where XLA's planned bytes go: the buffer assignment of a compiled step.

With ``xla_dump_to`` set for one compile (jax's ``compiler_options``,
:func:`dump_options`: no ``XLA_FLAGS`` needed) XLA writes, beside the
optimized HLO text ``*after_optimizations.txt``, its buffer assignment
(``*-buffer-assignment.txt``: the allocations, each with the values placed
in it) and live ranges (``*-live-range.txt``, with the values live at the
schedule's peak). :func:`parse_buffer_assignment`,
:func:`parse_live_range_peak` and :func:`parse_hlo_metadata` (each
instruction's ``op_name`` and Python call stack) read them;
:func:`categorize` names a value's part of the model (attention, mlp,
logits/loss, embedding, norm, rotary, optimizer; the step's arguments are
``state``) and :func:`summarize` gives a JSON-serializable dict:

* ``allocations``: bytes and count per allocation kind (the temp sum is
  XLA's ``temp_size_in_bytes``);
* ``peak``: the values live at the peak, by category and the largest (a
  decomposition of the live bytes; the temp allocation can exceed it,
  and the cuDNN workspace allocated at run time is in neither);
* ``top_temp``: the largest values of the temp allocation, which overlap
  in time (what is big, not parts that add up).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

#: Values listed per section (largest first).
TOP = 15


def dump_options(folder: str) -> dict:
  """The per-compile debug options that make XLA write the buffer
  assignment (and its live ranges) of the optimized module to ``folder``."""
  return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True,
          "xla_dump_buffer_assignment_analysis": True}


# ---------------------------------------------------------------- parsing

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE = re.compile(r"^\s*value: <(\d+) ([^\s{>]+)(\{[\d,]*\})?[^>]*> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")


def allocation_kind(attrs: str) -> str:
  """``parameter``, ``constant``, ``temp``, ``output``, ``thread-local``
  or ``other`` from
  the attributes of an ``allocation`` line (a donated parameter that is
  also live out counts as a parameter)."""
  if re.search(r"\bparameter \d+", attrs):
    return "parameter"
  if "constant" in attrs:
    return "constant"
  if "temp" in attrs:                 # preallocated-temp (GPU, CPU)
    return "temp"
  if "maybe-live-out" in attrs or "output shape" in attrs:
    return "output"
  return "thread-local" if "thread-local" in attrs else "other"


def parse_buffer_assignment(text: str) -> dict:
  """A ``*-buffer-assignment.txt``: ``{"allocations": [{"index", "size",
  "kind", "attrs", "values": [{"id", "name", "index", "size", "offset",
  "shape"}]}]}`` (``index``: the value's tuple index, ``{}`` when none)."""
  allocations: list[dict] = []
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      attrs = m.group(3).lstrip(", ")
      allocations.append(dict(index=int(m.group(1)), size=int(m.group(2)),
                              kind=allocation_kind(attrs), attrs=attrs,
                              values=[]))
      continue
    m = _VALUE.match(line)
    if m and allocations:
      allocations[-1]["values"].append(dict(
          id=int(m.group(1)), name=m.group(2), index=m.group(3) or "{}",
          size=int(m.group(4)), offset=int(m.group(5)),
          shape=re.sub(r"\{[\d,]*\}", "", m.group(6).strip())))
    elif line.startswith("BufferAssignment stats"):
      break
  return {"allocations": allocations}


_LIVE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}): (\d+) bytes")


def parse_live_range_peak(text: str) -> dict | None:
  """A ``*-live-range.txt``: ``{"step", "buffers": [{"name", "index",
  "bytes"}]}``, the buffers live at the peak; None without that section."""
  m = re.search(r"^\s*Live ranges at (\d+) \(peak\):\s*$", text, re.M)
  if not m:
    return None
  buffers = []
  for line in text[m.end():].splitlines()[1:]:
    b = _LIVE.match(line)
    if not b:
      break
    buffers.append(dict(name=b.group(1), index=b.group(2),
                        bytes=int(b.group(3))))
  return dict(step=int(m.group(1)), buffers=buffers)


_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%([^\s(]+) ")


def parse_hlo_metadata(text: str) -> dict:
  """The optimized HLO text: instruction name -> ``{"op_name",
  "functions", "files", "target"}`` (``functions``, ``files``: the Python
  call stack, innermost first; ``target``: a custom call's target). A
  fusion without metadata takes its fused computation's root's."""
  section = {}
  for name in ("FileNames", "FunctionNames", "FileLocations",
               "StackFrames"):
    m = re.search(rf"^{name}\n((?:\d+ .*\n?)*)", text, re.M)
    section[name] = dict(re.findall(r"^(\d+) (.*)$", m.group(1), re.M)
                         if m else [])
  unq = lambda s: s.strip().strip('"')
  files, funcs = section["FileNames"], section["FunctionNames"]

  def stack(frame: str | None) -> tuple[list[str], list[str]]:
    fns, fls, seen = [], [], set()
    while frame and frame not in seen and frame in section["StackFrames"]:
      seen.add(frame)
      f = dict(re.findall(r"(\w+)=(\d+)", section["StackFrames"][frame]))
      loc = dict(re.findall(r"(\w+)=(\d+)",
                            section["FileLocations"].get(
                                f.get("file_location_id", ""), "")))
      fns.append(unq(funcs.get(loc.get("function_name_id", ""), "")))
      fls.append(unq(files.get(loc.get("file_name_id", ""), "")))
      # The text gives a frame's parent as the parent's key + 1 (1: none).
      parent = int(f.get("parent_frame_id", 0)) - 1
      frame = str(parent) if parent > 0 else None
    return fns, fls

  out: dict[str, dict] = {}
  roots: dict[str, str] = {}
  calls: dict[str, str] = {}
  comp = None
  for line in text.splitlines():
    c = _COMP.match(line)
    if c and line.rstrip().endswith("{"):
      comp = c.group(1)
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.groups()
    if line.lstrip().startswith("ROOT ") and comp:
      roots[comp] = name
    op = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    target = re.search(r'custom_call_target="([^"]*)"', rest)
    called = re.search(r"calls=%([^\s,}]+)", rest)
    if called:
      calls[name] = called.group(1)
    fns, fls = stack(frame.group(1) if frame else None)
    out[name] = dict(op_name=op.group(1) if op else "", functions=fns,
                     files=fls, target=target.group(1) if target else "")
  for name, comp_name in calls.items():
    info = out[name]
    root = out.get(roots.get(comp_name, ""))
    if root and not info["op_name"] and not info["functions"]:
      out[name] = dict(root, target=info["target"] or root["target"])
  return out


# ----------------------------------------------------------- categories

#: (category, words in a frame's function or file name), in order of
#: precedence within a frame. The innermost frame that matches a rule
#: decides (the layers run inside the loss function, the attention inside
#: the layer).
RULES = (
    ("optimizer", ("optax", "Optimizer.update", "apply_updates")),
    ("attention", ("attention", "attend", "cudnn", "dot_product", "flash",
                   "straddle")),
    ("mlp", ("Mlp", "mlp")),
    ("logits/loss", ("cross_entropy", "token_losses", "lm_loss", "logits",
                     "_one_hot")),
    ("embedding", ("Embed", "embed")),
    ("norm", ("RMSNorm", "normalization", "LayerNorm")),
    ("rotary", ("rotary",)),
)


def _match(text: str) -> str | None:
  for category, words in RULES:
    if any(w in text for w in words):
      return category
  return None


def categorize(info: dict | None, name: str = "") -> str:
  """A category from an instruction's metadata (:func:`parse_hlo_metadata`):
  its call stack, innermost frame first (function, then file name), else
  its op_name, custom call target and name; ``other`` when none says."""
  info = info or {}
  for fn, path in zip(info.get("functions", []), info.get("files", [])):
    found = _match(fn) or _match(os.path.basename(path))
    if found:
      return found
  text = " ".join((info.get("op_name", ""), info.get("target", ""), name))
  return _match(text) or "other"


def phase(info: dict | None) -> str:
  """``bwd`` (jax's ``transpose(...)``: the backward), ``remat`` (a
  recomputation for the backward), ``fwd``, or ``""`` (no op_name)."""
  op = (info or {}).get("op_name", "")
  if "rematted_computation" in op:
    return "remat"
  if "transpose(" in op:
    return "bwd"
  return "fwd" if op.startswith("jit(") else ""


# ------------------------------------------------------------ summaries

def summarize(assignment: dict, peak: dict | None = None,
              metadata: dict | None = None, top: int = TOP) -> dict:
  """JSON-serializable: ``allocations`` (bytes and count per kind),
  ``temp_allocations`` (sizes, largest first), ``top_temp`` (the largest
  values of the temp allocations) and, with a live-range ``peak``, the
  ``peak`` (its live bytes, per category and the largest values). Each
  value: name (``name{index}`` for tuple elements), shape, bytes,
  category, phase, op_name."""
  metadata = metadata or {}
  totals: dict[str, dict] = {}
  shapes: dict[str, str] = {}
  param_names: set[str] = set()
  temp_values: dict[str, dict] = {}
  temps = []
  for a in assignment["allocations"]:
    t = totals.setdefault(a["kind"], dict(bytes=0, count=0))
    t["bytes"] += a["size"]
    t["count"] += 1
    if a["kind"] == "temp":
      temps.append(a["size"])
    for v in a["values"]:
      key = v["name"] + ("" if v["index"] == "{}" else v["index"])
      shapes.setdefault(v["name"] + v["index"], v["shape"])
      if a["kind"] == "parameter":
        param_names.add(v["name"] + v["index"])
      elif a["kind"] == "temp" and v["size"] > temp_values.get(
          key, {}).get("bytes", -1):
        temp_values[key] = _entry(v["name"], key, v["shape"], v["size"],
                                  metadata)

  out = dict(allocations=totals, temp_allocations=sorted(temps,
                                                         reverse=True),
             top_temp=sorted(temp_values.values(),
                             key=lambda e: -e["bytes"])[:top])
  if peak is not None:
    entries, by_cat = [], {}
    for b in peak["buffers"]:
      key = b["name"] + b["index"]
      e = _entry(b["name"], b["name"] + ("" if b["index"] == "{}"
                                         else b["index"]),
                 shapes.get(key, ""), b["bytes"], metadata)
      if key in param_names:
        e["category"] = "state"
      by_cat[e["category"]] = by_cat.get(e["category"], 0) + e["bytes"]
      entries.append(e)
    out["peak"] = dict(
        step=peak["step"], bytes=sum(e["bytes"] for e in entries),
        by_category=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        top=sorted((e for e in entries if e["category"] != "state"),
                   key=lambda e: -e["bytes"])[:top])
  return out


def _entry(hlo_name: str, label: str, shape: str, size: int,
           metadata: dict) -> dict:
  info = metadata.get(hlo_name)
  return dict(name=label, shape=shape, bytes=int(size),
              category=categorize(info, hlo_name), phase=phase(info),
              op_name=(info or {}).get("op_name", "")[-160:])


# ------------------------------------------------------------- the files

def _after_optimizations(folder: str, suffix: str) -> str | None:
  """The largest ``*after_optimizations<suffix>`` file in ``folder`` (the
  step's module, not a small helper), or None."""
  paths = glob.glob(os.path.join(folder, f"*after_optimizations{suffix}"))
  return max(paths, key=os.path.getsize) if paths else None


def from_dump(folder: str, top: int = TOP) -> dict | None:
  """:func:`summarize` of the module dumped in ``folder``; None without a
  buffer assignment there."""
  path = _after_optimizations(folder, "-buffer-assignment.txt")
  if path is None:
    return None
  read = lambda p: open(p, errors="replace").read() if p else ""  # pylint: disable=consider-using-with
  stem = path[:-len("-buffer-assignment.txt")]
  live = stem + "-live-range.txt"
  hlo = stem + ".txt"
  peak = parse_live_range_peak(read(live)) if os.path.exists(live) else None
  metadata = parse_hlo_metadata(read(hlo)) if os.path.exists(hlo) else {}
  out = summarize(parse_buffer_assignment(read(path)), peak, metadata, top)
  out["source"] = os.path.basename(path)
  return out


def compile_with_breakdown(lowered, top: int = TOP):
  """``lowered.compile()`` with the buffer assignment dumped to a
  temporary folder (removed after): ``(compiled, breakdown)``, the
  breakdown None (or ``{"error": ...}``) where it could not be read."""
  folder = tempfile.mkdtemp(prefix="xla_buffers_")
  try:
    compiled = lowered.compile(compiler_options=dump_options(folder))
    try:
      breakdown = from_dump(folder, top)
    except Exception as err:  # pylint: disable=broad-except
      breakdown = {"error": f"{type(err).__name__}: {err}"[:600]}
    return compiled, breakdown
  finally:
    shutil.rmtree(folder, ignore_errors=True)
