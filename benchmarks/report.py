"""Turns bench_cp result JSONs into ``RESULTS.md`` and ``speedup.png``.

Usage, from the repository root::

    python -m benchmarks.report benchmarks/results/results_*.json \\
        --paired 'benchmarks/results/speedup_ab_*.json' \\
        --out benchmarks/results

With several files, a measurement present in more than one is taken from
the newest file (:func:`benchmarks.results.load`). ``--paired`` adds the
paired cp=N / cp=1 speed-ups of ``speedup_ab`` (a table, and the
bounded-exchange target rows). The targets are read from
``benchmarks/targets.json``. Needs only the standard library (plus
matplotlib for the plot, skipped with a note when it is missing).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from benchmarks import plots, results, tables, targets


def main(argv: Sequence[str] | None = None) -> tuple[str, str | None]:
  """Writes ``RESULTS.md`` (and ``speedup.png``); returns their paths."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("results", nargs="*",
                 default=[os.path.join(results.RESULTS_DIR, "results_*.json")],
                 help="result JSONs (globs allowed)")
  p.add_argument("--paired", nargs="*",
                 default=[os.path.join(results.RESULTS_DIR,
                                       "speedup_ab_*.json")],
                 help="speedup_ab JSONs (globs allowed)")
  p.add_argument("--out", default=results.RESULTS_DIR)
  args = p.parse_args(argv)
  loaded = results.load(args.results)
  records = loaded.records
  paired = results.load(args.paired, key=results.paired_key).records
  if not records:
    raise SystemExit(f"no records in {args.results}")
  os.makedirs(args.out, exist_ok=True)
  md = os.path.join(args.out, "RESULTS.md")
  png = plots.plot(records, os.path.join(args.out, "speedup.png"))
  text = tables.render_markdown(records, loaded.files, paired,
                                targets.target_rows(records, paired))
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
