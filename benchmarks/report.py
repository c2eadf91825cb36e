"""Turns bench_cp result JSONs into ``RESULTS.md`` and ``speedup.png``.

Usage, from the repository root::

    python -m benchmarks.report benchmarks/results/results_*.json \\
        --paired 'benchmarks/results/speedup_ab_*.json' \\
        --out benchmarks/results

With several files, a measurement present in more than one is taken from
the newest file. ``--paired`` adds the paired cp=N / cp=1 speed-ups of
``speedup_ab`` (a table, and the bounded-exchange target rows). Needs only
the standard library (plus matplotlib for the plot, skipped with a note when
it is missing).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from benchmarks import reporting

_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: Sequence[str] | None = None) -> tuple[str, str | None]:
  """Writes ``RESULTS.md`` (and ``speedup.png``); returns their paths."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("results", nargs="*",
                 default=[os.path.join(_RESULTS, "results_*.json")],
                 help="result JSONs (globs allowed)")
  p.add_argument("--paired", nargs="*",
                 default=[os.path.join(_RESULTS, "speedup_ab_*.json")],
                 help="speedup_ab JSONs (globs allowed)")
  p.add_argument("--out", default=_RESULTS)
  args = p.parse_args(argv)
  records, envs = reporting.load(args.results)
  paired = reporting.load_paired(args.paired)
  if not records:
    raise SystemExit(f"no records in {args.results}")
  os.makedirs(args.out, exist_ok=True)
  md = os.path.join(args.out, "RESULTS.md")
  png = reporting.plot(records, os.path.join(args.out, "speedup.png"))
  text = reporting.render_markdown(records, envs, paired)
  if png:
    text += "\n![speed-up](speedup.png)\n"
  else:
    text += "\n(speedup.png not drawn: matplotlib missing or no data)\n"
  with open(md, "w") as f:
    f.write(text)
  print(f"wrote {md}" + (f" and {png}" if png else ""), file=sys.stderr)
  return md, png


if __name__ == "__main__":
  main()
