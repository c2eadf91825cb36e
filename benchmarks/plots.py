"""Pictures of the results, drawn from the JSON files behind the tables.

:func:`draw` writes ``fused.png`` (each peer's time over the primitive's
per layout, a panel per device and pass), ``memory.png`` (the peak per
row length on one GPU against the pool, the longest row that trains
starred; the longest row planned per cp and exchange) and
``scaling.png`` (the modeled per-GPU efficiency per cp and exchange),
with matplotlib (``pip install -e ".[plots]"``).
"""

from __future__ import annotations

import os

from benchmarks.workload import DIST_LABEL, fmt_tokens

#: bench_fused's references that are other implementations, and its
#: control (the primitive paired with itself).
PEERS = ("ours", "jax_nn", "jax_packed", "tokamax_mosaic", "tokamax_triton",
         "kvax")
EXCHANGES = ("all_gather", "ring", "halo", "all_to_all", "all_to_all+ring")


def pyplot():
  """matplotlib's pyplot on the Agg backend, or None where not installed."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return plt


def exchange(r: dict) -> str:
  """A row's exchange; NO_LOAD_BALANCE's outside the ring is the halo."""
  ex = r.get("comm_type", "all_gather")
  return "halo" if r.get("strategy") == "no_load_balance" and \
      ex == "all_gather" else ex


def _log2(ax, axis: str, values, fmt=str) -> None:
  ticks = sorted(set(values))
  getattr(ax, f"set_{axis}scale")("log", base=2)
  getattr(ax, f"set_{axis}ticks")(ticks, [fmt(t) for t in ticks])
  ax.minorticks_off()


def _fused(plt, files):
  pts = {}  # (device, pass, layout, reference) -> the newest record
  for d in files:
    for r in d["records"]:
      if (r.get("reference") in PEERS and r.get("ratio_q1") is not None
          and not r.get("versus")):   # paired with the primitive itself
        pts[d["env"]["device_kind"], r["pass"], (list(DIST_LABEL).index(
            r["dist"]), -r["head_dim"], r["tokens"], r.get("window") or 0),
            r["reference"]] = r
  devices = sorted({k[0] for k in pts})
  if not devices:
    return None
  fig, axes = plt.subplots(len(devices), 2, figsize=(12, 3.6 * len(devices)),
                           sharey=True, squeeze=False)
  for row, device in zip(axes, devices):
    for ax, (p, name) in zip(row, (("fwd", "forward"),
                                   ("fwd_bwd", "forward + backward"))):
      layouts = sorted({k[2] for k in pts if k[:2] == (device, p)})
      for i, ref in enumerate(PEERS):
        xr = [(x + (i - 2.5) * 0.12, pts[device, p, lay, ref])
              for x, lay in enumerate(layouts) if (device, p, lay, ref) in pts]
        if xr:
          ax.errorbar([x for x, _ in xr], [r["ratio"] for _, r in xr], yerr=[
              [r["ratio"] - r["ratio_q1"] for _, r in xr],
              [r["ratio_q3"] - r["ratio"] for _, r in xr]], fmt="o", ms=5,
              color=f"C{i}", label=ref)
      ax.axhline(1, color="gray", lw=0.8)
      ax.set_xticks(range(len(layouts)), [
          f"{list(DIST_LABEL.values())[k]}\nD={-d}, T={fmt_tokens(t)}"
          + (f"\nwindow {w}" if w else "") for k, d, t, w in layouts],
          fontsize=7)
      ax.set_title(f"{device}: {name}", fontsize=10)
    row[0].set_ylabel("reference time / ours\n(> 1: ours faster)")
  ratios = [r["ratio"] for r in pts.values()]
  _log2(axes[0][0], "y", [2.0 ** e for e in range(-3, 8) if min(ratios) / 2
                          < 2.0 ** e < 2 * max(ratios)], lambda t: f"{t:g}")
  axes[0][1].legend(fontsize=8, title="reference (IQR bars)",
                    title_fontsize=8, loc="upper left")
  fig.text(0.5, 0.005, "Each reference's time over the primitive's, median "
           "of paired reps, newest run per layout; a reference missing "
           "failed or differed from ours (fused.md says which)",
           ha="center", fontsize=8)
  return fig


def _measured(files) -> tuple[dict, dict, int]:
  """Runs on a GPU (not planned) by setting and T, the longest row that
  trains by setting, the device's pool."""
  runs, longest, pool = {}, {}, 0
  for d in files:
    if d["env"]["device_kind"].endswith("(plan)"):
      continue
    for r in d["records"]:
      key = (d["env"]["device_kind"], *(r.get(k) for k in (
          "model", "remat", "cp", "mlp_chunk_size", "layer_chunk_size")))
      if r.get("kind") == "search":
        longest[key] = r["longest_seq_len"]
      elif r.get("kind") == "run" and (r.get("peak_bytes_in_use") and r.get(
          "status") == "ok" or r.get("status") == "oom"):
        runs.setdefault(key, {})[r["seq_len"]] = r
        pool = max(pool, r.get("bytes_limit") or 0)
  return {k: v for k, v in runs.items() if any(
      r["status"] == "ok" for r in v.values())}, longest, pool


def _draw_measured(ax, runs: dict, longest: dict, pool: int) -> None:
  """The peak per row length on one GPU, the pool, the longest rows."""
  for i, (key, by_t) in enumerate(sorted(runs.items(), key=str)):
    ok = sorted((t, r["peak_bytes_in_use"] / 1e9) for t, r in by_t.items()
                if r["status"] == "ok")
    t = longest.get(key)
    ax.plot(*zip(*ok), "o-", color=f"C{i}", ms=4, label=", ".join(
        [f"{key[1]} model", str(key[2])]
        + [f"cp = {key[3]}"] * ((key[3] or 1) > 1)
        + [f"{n} chunk {fmt_tokens(int(c))}" for n, c in zip(
            ("MLP", "layer"), key[4:]) if str(c).isdigit()]
        + ([f"★ longest that trains: {fmt_tokens(t)}"] if t in by_t
           else [])))
    if t in by_t:
      ax.plot(t, by_t[t]["peak_bytes_in_use"] / 1e9, "*", color=f"C{i}",
              ms=14)
    oom = [t for t, r in by_t.items() if r["status"] == "oom"]
    if pool:
      ax.plot(oom, [pool / 1e9] * len(oom), "x", color=f"C{i}", ms=8)
  if pool:
    ax.axhline(pool / 1e9, color="k", ls="--", lw=1,
               label=f"device pool ({pool / 1e9:.1f} GB); x: out of memory")
  lengths = [t for by_t in runs.values() for t in by_t]
  step = 1 << (20 if max(lengths) > 2 << 20 else 18 if max(
      lengths) > 1 << 18 else max(lengths).bit_length() - 3)
  ticks = range(min(lengths) // step * step, max(lengths) + step, step)
  ax.set_xticks(ticks, [fmt_tokens(t) if t else "0" for t in ticks])
  ax.set(xlabel="row length T (tokens)", ylabel="device peak (GB)",
         title=f"{', '.join(sorted({k[0] for k in runs}))}, measured")
  ax.legend(fontsize=7, loc="lower right")


def _planned(ax, files, model: str) -> None:
  """The longest row planned per cp for a model, per exchange."""
  longest, limit = {}, 0
  for d in files:
    for r in d["records"]:
      if r.get("kind") == "search" and r.get("model") == model and any(
          t.get("status") == "compiled" for t in r.get("tries", [])):
        longest[r["remat"], bool(r.get("scan_layers")), exchange(r) if
                r["cp"] > 1 else "-", r["cp"]] = r["longest_seq_len"]
        limit = max(limit, d["args"].get("memory_limit") or 0)
  for remat, scan, ex in sorted({k[:3] for k in longest if k[2] != "-"}):
    ax.plot(*zip(*sorted((cp, t) for (m, s, e, cp), t in longest.items()
                         if (m, s) == (remat, scan) and e in (ex, "-"))),
            "os"[scan] + ["-", "--"][remat != "full"], ms=4,
            color=f"C{EXCHANGES.index(ex)}",
            label=f"{remat}{', scan' if scan else ''}: {ex}")
  _log2(ax, "x", [k[3] for k in longest])
  _log2(ax, "y", [1 << e for e in range(36) if min(longest.values()) / 2
                  < 1 << e < 2 * max(longest.values())], fmt_tokens)
  ax.set(xlabel="cp (GPUs)", ylabel="longest row T (tokens)",
         title=f"{model} model, planned"
         + (f" (≤ {limit:g} GB per GPU)" if limit else ""))
  ax.legend(fontsize=7, title="remat: exchange", title_fontsize=7)


def _memory(plt, files):
  runs, longest, pool = _measured(files)
  models = sorted({r["model"] for d in files for r in d["records"]
                   if r.get("kind") == "search" and r.get("cp", 1) > 1})
  panels = bool(runs) + len(models)
  if not panels:
    return None
  fig, axes = plt.subplots(1, panels, squeeze=False,
                           figsize=(5.5 * panels, 4.5))
  if runs:
    _draw_measured(axes[0][0], runs, longest, pool)
  for ax, model in zip(axes[0][bool(runs):], models):
    _planned(ax, files, model)
  return fig


def _scaling(plt, files):
  pts = {}  # (row grows, strategy, exchange, bandwidth, cp) -> record
  for d in files:
    for r in d["records"]:
      for grows in ([r["seq_len"] > r["profiled_seq_len"]] if r["cp"] > 1
                    else [False, True]):
        pts[grows, r["strategy"], r["comm_type"], r["bandwidth"],
            r["cp"]] = r
  if not pts:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  bandwidths = sorted({k[3] for k in pts}, reverse=True)
  for grows, strategy, ex, bw in sorted({k[:4] for k in pts}):
    line = sorted((k[4], r) for k, r in pts.items()
                  if k[:4] == (grows, strategy, ex, bw))
    axes[int(grows)].plot(*zip(*((cp, r["efficiency"]) for cp, r in line)),
                     "o" + ["-", "--", ":"][bandwidths.index(bw) % 3], ms=4,
                     color=f"C{EXCHANGES.index(ex)}",
                     label=f"{strategy} / {ex}, {bw / 1e9:.0f} GB/s")
  measured = sorted({(k[4], r["measured"] / k[4]) for k, r in pts.items()
                     if not k[0] and r.get("measured")})
  if measured:
    axes[0].plot(*zip(*measured), "kD", ms=6,
                 label="measured speed-up / cp (step.md)")
  t1 = fmt_tokens(next(iter(pts.values()))["profiled_seq_len"])
  for grows, ax in enumerate(axes):
    ax.set_title(f"row grows: T = cp × {t1}" if grows else
                 f"row fixed: T = {t1}", fontsize=10)
    ax.set_xlabel("cp (GPUs)")
    _log2(ax, "x", [k[4] for k in pts if k[0] == grows])
  axes[0].set(ylabel="per-GPU efficiency\n(throughput per GPU / one GPU's)",
              ylim=(min(0.5, min(r["efficiency"] for r in pts.values())
                        - 0.05), 1.02))
  axes[0].legend(fontsize=7, loc="lower left", handlelength=4)
  fig.suptitle("The example's step at cp = N, modeled", fontsize=11)
  return fig


PLOTS = {"fused": _fused, "memory": _memory, "scaling": _scaling}


def draw(benchmark: str, files: list[dict], folder: str) -> str | None:
  """Writes ``<folder>/<benchmark>.png`` from the benchmark's files
  (:func:`benchmarks.results.load_files`); returns its path, or None
  without matplotlib, a picture for the benchmark, or records."""
  plt = pyplot()
  fig = PLOTS[benchmark](plt, files) if plt and benchmark in PLOTS else None
  if fig is None:
    return None
  fig.tight_layout(rect=(0, 0.02, 1, 1))
  path = os.path.join(folder, f"{benchmark}.png")
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)
  return path
