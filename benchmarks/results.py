"""Result files: the one place they are written and read.

A result file is a JSON object ``{"env": {...}, "records": [...], ...}``
named ``<prefix>_<date>_<device>[_<tag>].json``:

* :func:`environment` gives the ``env`` block (its ``date`` is ISO 8601 in
  UTC, e.g. ``2026-12-01T07:15:00+00:00``; ``git_commit`` and ``git_dirty``
  say which code ran, :func:`source_tree`), :func:`result_path` the name
  (the same date in ISO 8601's basic format, ``20261201T071500Z``) and
  :func:`write_result` writes it atomically, so a run cut short, or
  rewriting its file after every measurement, leaves a valid file.
* :func:`load` reads files (globs allowed) and merges their records by a
  key, the newest file winning per key: :func:`record_key` for
  ``bench_cp``, :func:`paired_key` for ``speedup_ab``. :func:`read_result`
  reads one file.

Older files are read too: names and ``env.date`` fields of the form
``%Y%m%d-%H%M%S`` (local time, read as UTC), and ``bench_fused`` files
that hold ``results`` with ``device`` and ``jax`` at the top level.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "results")
# Records without a ``timing`` field hold synced timings.
DEFAULT_TIMING = "synced"

NAME_DATE = "%Y%m%dT%H%M%SZ"         # ISO 8601 basic format, UTC
OLD_NAME_DATE = "%Y%m%d-%H%M%S"
_NAME_DATE_RE = re.compile(r"_(\d{8}T\d{6}Z|\d{8}-\d{6})_")


# ----------------------------------------------------------------- dates


def now() -> datetime.datetime:
  """This moment in UTC, to the second."""
  return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def parse_date(text: str | None) -> datetime.datetime | None:
  """An ``env.date`` or file-name date (ISO 8601, either format, or
  ``%Y%m%d-%H%M%S``) as a UTC datetime; ``None`` if it is none of these.
  A date without a time zone is read as UTC."""
  if not text:
    return None
  for parse in (datetime.datetime.fromisoformat,
                lambda s: datetime.datetime.strptime(s, OLD_NAME_DATE)):
    try:
      date = parse(text)
    except ValueError:
      continue
    if date.tzinfo is None:
      return date.replace(tzinfo=datetime.UTC)
    return date.astimezone(datetime.UTC)
  return None


def file_date(data: dict[str, Any], path: str) -> datetime.datetime:
  """When a result file was written: its ``env.date``, else the date in
  its name, else the earliest date (such files lose every tie)."""
  date = parse_date(str(data.get("env", {}).get("date") or ""))
  if date is None:
    m = _NAME_DATE_RE.search(os.path.basename(path))
    date = parse_date(m.group(1)) if m else None
  return date or datetime.datetime.min.replace(tzinfo=datetime.UTC)


# ----------------------------------------------------------------- writing


def environment(**extra: Any) -> dict[str, Any]:
  """The ``env`` block of a result file: date, versions and devices of this
  process, plus ``extra`` fields."""
  # Imported here: reading results needs only the standard library.
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel

  import jax_cp  # pylint: disable=import-outside-toplevel
  env = {"date": now().isoformat(),
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
  env.update(source_tree(os.path.dirname(os.path.dirname(
      os.path.abspath(jax_cp.__file__)))))
  env.update(extra)
  return env


def source_tree(folder: str) -> dict[str, Any]:
  """``git_commit`` (the HEAD commit of the git checkout at ``folder``)
  and ``git_dirty`` (whether tracked files differ from it): which code a
  result was measured on. ``$JAX_CP_SOURCE_COMMIT``, when set, names the
  commit instead and ``git_dirty`` is None: a copy of the tree sent to
  another machine, where git metadata, if any came along, may describe an
  older commit. Without either (no checkout, no git), both are None."""
  def git(*args: str) -> str | None:
    try:
      out = subprocess.run(("git", "-C", folder, *args), check=True,
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
      return None
    return out.stdout.strip()

  named = os.environ.get("JAX_CP_SOURCE_COMMIT")
  if named:
    return {"git_commit": named, "git_dirty": None}
  commit = git("rev-parse", "HEAD")
  status = git("status", "--porcelain", "--untracked-files=no") \
      if commit else None
  return {"git_commit": commit,
          "git_dirty": None if status is None else bool(status)}


def result_path(out_dir: str, prefix: str, env: dict[str, Any],
                tag: str | None = None) -> str:
  """``<out_dir>/<prefix>_<date>_<device>[_<tag>].json`` for a file whose
  ``env`` is ``env`` (the name's date is ``env["date"]``)."""
  date = parse_date(env["date"])
  if date is None:
    raise ValueError(f"env['date'] must be an ISO 8601 date, got "
                     f"{env['date']!r}")
  parts = [prefix, date.strftime(NAME_DATE),
           re.sub(r"[^A-Za-z0-9]+", "_", env["device_kind"]).strip("_")]
  if tag:
    parts.append(re.sub(r"[^A-Za-z0-9.-]+", "_", tag))
  return os.path.join(out_dir, "_".join(parts) + ".json")


def write_result(path: str, payload: dict[str, Any]) -> str:
  """Writes ``payload`` as JSON to ``path`` atomically (a temporary file
  renamed over it; removed if the write fails) and returns ``path``."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


# ----------------------------------------------------------------- reading


def read_result(path: str) -> dict[str, Any]:
  """One result file, in today's shape: ``env`` and ``records`` present
  (older ``bench_fused`` files' ``results``, ``device`` and ``jax`` moved
  there)."""
  with open(path) as f:
    data = json.load(f)
  if "records" not in data and "results" in data:
    data["records"] = data.pop("results")
    data.setdefault("env", {"device_kind": data.get("device"),
                            "jax": data.get("jax")})
  data.setdefault("env", {})
  data.setdefault("records", [])
  return data


def record_key(r: dict[str, Any]) -> tuple:
  """A ``bench_cp`` record's configuration."""
  return (r["kind"], r["row_id"], r["cp"], r["strategy"], r["pass_name"],
          r["hkv"], r["hq"], r["head_dim"], r["dtype"], r.get("bound"),
          r.get("window"))


def paired_key(r: dict[str, Any]) -> tuple:
  """A ``speedup_ab`` record's configuration: the row, the pass, cp and
  strategy, the shapes, the sliding window and DUAL_CHUNK_SWAP's windowed
  plan, the document order (packed or reordered) and what it is paired
  against (cp=1, or the fallback guard)."""
  return (r["dist"], r["pass_name"], r["cp"], r["strategy"], r["tokens"],
          r["hkv"], r["hq"], r["head_dim"], r["dtype"], r.get("window"),
          r.get("dcs_window_plan", "split"), r.get("doc_order", "packed"),
          r.get("against", "cp1"))


@dataclasses.dataclass
class Loaded:
  """What :func:`load` read.

  Attributes:
    records: the merged records, each with ``_file`` (the base name of the
      file it came from) and ``_date`` (that file's date, ISO 8601).
    files: every file read, oldest first: its ``env`` with ``path``,
      ``args`` and ``summary`` added.
  """

  records: list[dict[str, Any]]
  files: list[dict[str, Any]]


def _paths(patterns: Sequence[str]) -> list[str]:
  """The files of ``patterns``: a glob's matches (none is fine), or a path
  (which must then exist)."""
  out = []
  for pattern in patterns:
    if any(c in pattern for c in "*?["):
      out += sorted(glob.glob(pattern))
    else:
      out.append(pattern)
  return list(dict.fromkeys(out))


def load(patterns: Sequence[str],
         key: Callable[[dict[str, Any]], Hashable] = record_key) -> Loaded:
  """Reads result files (paths or globs) and merges their records: per
  ``key``, the record of the newest file (by :func:`file_date`) wins."""
  files = []
  for path in _paths(patterns):
    data = read_result(path)
    files.append((file_date(data, path), path, data))
  files.sort(key=lambda f: (f[0], f[1]))
  merged: dict[Hashable, dict[str, Any]] = {}
  for date, path, data in files:
    for r in data["records"]:
      merged[key(r)] = dict(r, _file=os.path.basename(path),
                            _date=date.isoformat())
  return Loaded(list(merged.values()),
                [dict(d["env"], path=path, args=d.get("args", {}),
                      summary=d.get("summary", {}))
                 for _, path, d in files])
