"""Counts the outcomes of pytest JUnit XML reports, with the tests skipped
for too few devices (``tests/_devices.py``) apart from the other skips.

  python tests/gpu/skip_summary.py NAME=REPORT.xml [NAME=REPORT.xml ...]

prints one line per report, e.g. ``gpu: 40 passed, 0 failed, 0 errors, 27
skipped (24 for devices: 12 x 2 gpu, 8 x 4 gpu, 4 x 8 gpu; 3 other)``. It
counts and never judges: it exits 0 whatever the reports hold (a report
that is missing or unreadable is named as such); the exit status of the
suite is pytest's.
"""

from __future__ import annotations

import collections
import re
import sys
import xml.etree.ElementTree as ET

# tests/_devices.py's reason: "requires_devices: needs N PLATFORM devices,
# M present" (JUnit XML may prefix it with the skip's location).
_DEVICES = re.compile(r"requires_devices: needs (\d+) (\S+) devices")


def summarize(name: str, path: str) -> str:
  """One line counting the outcomes in the JUnit XML report at ``path``."""
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError) as e:
    return f"{name}: no report ({type(e).__name__}: {e})"
  counts = collections.Counter()
  for_devices = collections.Counter()
  for case in root.iter("testcase"):
    skipped = case.find("skipped")
    if case.find("failure") is not None:
      counts["failed"] += 1
    elif case.find("error") is not None:
      counts["errors"] += 1
    elif skipped is not None:
      counts["skipped"] += 1
      m = _DEVICES.search(skipped.get("message", "") + (skipped.text or ""))
      if m:
        for_devices[(int(m.group(1)), m.group(2))] += 1
    else:
      counts["passed"] += 1
  n_dev = sum(for_devices.values())
  by_count = ", ".join(f"{k} x {n} {platform}" for (n, platform), k in
                       sorted(for_devices.items()))
  return (f"{name}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['errors']} errors, {counts['skipped']} skipped "
          f"({n_dev} for devices{': ' + by_count if by_count else ''}; "
          f"{counts['skipped'] - n_dev} other)")


def main(argv: list[str]) -> int:
  for arg in argv:
    name, _, path = arg.rpartition("=")
    print(summarize(name or path, path))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
