"""``speedup.png``: the measured speed-ups as grouped bars (matplotlib;
nothing is drawn without it)."""

from __future__ import annotations

from benchmarks.derived import one, select
from benchmarks.names import DIST_LABEL, DISTS, PASS_LABEL, PASSES, SHORT
from benchmarks.targets import load_targets


def plotted(records, targets=None):
  """What :func:`plot` draws: ``(records, tokens, hkv, passes)``, the cp > 1
  speed-ups without a sliding window at the speed targets' T and Hkv
  (``targets.json``) where measured, else the largest T and the smallest
  Hkv; forward+backward first. None without any such record."""
  cpa = [r for r in select(records, kind="cp_attention", window=None)
         if r.get("speedup") is not None and r["cp"] > 1]
  if not cpa:
    return None
  targets = load_targets() if targets is None else targets
  measured = {r["tokens"] for r in cpa}
  tokens = targets["tokens"] if targets["tokens"] in measured else max(
      measured)
  hkvs = sorted({r["hkv"] for r in cpa})
  hkv = targets.get("hkv") if targets.get("hkv") in hkvs else hkvs[0]
  cpa = select(cpa, tokens=tokens, hkv=hkv)
  passes = [p for p in PASSES[::-1] if any(r["pass_name"] == p for r in cpa)]
  return cpa, tokens, hkv, passes


def plot(records, path: str) -> str | None:
  """Grouped bars: speed-up per distribution, per strategy and cp, one
  panel per pass (:func:`plotted` says which records). Returns ``path``,
  or None when nothing was drawn (no matplotlib, or no record)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  chosen = plotted(records)
  if chosen is None:
    return None
  cpa, tokens, hkv, passes = chosen
  fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.2),
                           squeeze=False)
  for ax, pass_name in zip(axes[0], passes):
    sel = select(cpa, pass_name=pass_name)
    dists = [d for d in DISTS if any(r["dist"] == d for r in sel)]
    series = sorted({(r["strategy"], r["cp"]) for r in sel},
                    key=lambda s: (s[1], s[0]))
    width = 0.8 / max(len(series), 1)
    for i, (strategy, cp) in enumerate(series):
      ys = []
      for d in dists:
        r = one(sel, dist=d, strategy=strategy, cp=cp)
        ys.append(r["speedup"] if r else 0.0)
      xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(dists))]
      ax.bar(xs, ys, width, label=f"{SHORT[strategy]} cp={cp}",
             hatch="//" if strategy == "no_load_balance" else None,
             color=f"C{sorted({c for _, c in series}).index(cp)}",
             alpha=0.6 if strategy == "no_load_balance" else 1.0)
    for cp in sorted({c for _, c in series}):
      ax.axhline(cp, color="gray", lw=0.8, ls=":")
    ax.set_xticks(range(len(dists)))
    ax.set_xticklabels([DIST_LABEL.get(d, d) for d in dists])
    ax.set_ylabel("speed-up over cp=1")
    ax.set_title(f"{PASS_LABEL[pass_name]}, T={tokens}, Hkv={hkv}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

