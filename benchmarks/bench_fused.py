"""Speed of the cuDNN varlen primitive (no CP) on one GPU, side by side with
JAX's own cuDNN attention, in one run.

    python -m benchmarks.bench_fused [--tokens 32768] [--out DIR]

Per (document mix, Hkv), forward and forward+backward, bf16, Hq=32, D=128:

* ``ours``: ``jax_cp.fused_attention(backend="cudnn")`` over the packed row,
  top-left causal (Q and KV lengths agree), ``max_seqlen`` = longest doc;
* ``ours_br``: the same with the bottom-right mask (what CP steps need; the
  backward penalty the CP layer avoids by splitting);
* ``ours_rowbound``: ``max_seqlen`` = T (what a kernel sized by the row does);
* ``jax_dense``: ``jax.nn.dot_product_attention(implementation="cudnn",
  is_causal=True)`` on the one-document row (B=1);
* ``jax_packed``: JAX's cuDNN packed path
  (``fused_attention_stablehlo.dot_product_attention`` with ``q_offsets``,
  ``MaskType.PADDING_CAUSAL``).

``--window LEFT`` runs every variant with the causal sliding window
``(LEFT, 0)`` (``jax_dense`` as ``local_window_size=(LEFT, 0)``,
``jax_packed`` as ``sliding_window_length=LEFT+1``), counts only the pairs
inside the window, and on the one-document row also times ``ours`` against
``jax_dense`` forward+backward in alternation (:func:`benchmarks.timing.paired`;
``paired_vs_jax_dense`` records, ratio > 1: ours faster).

FLOPs (hardware FLOPs, :func:`jax_cp.attention_flops` with
``recompute=True``): ``4 * Hq * D * pairs`` forward with ``pairs =
L(L+1)/2`` per document (``sum min(j+1, LEFT+1)`` with a window), 3.5x that
for forward+backward (the fused backward recomputes ``Q K^T``).
Median of ``--reps`` synced host-clock timings after warm-up, two
alternating input sets
(:func:`benchmarks.timing.synced`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fas

import jax_cp
from benchmarks import fused_parity, timing
from benchmarks.names import DISTS, HEAD_DIM, HQ
from benchmarks.results import environment, result_path, write_result
from benchmarks.workload import pack_row


def fwd_and_bwd(attn):
  fwd = jax.jit(attn)

  def loss(q, k, v, w):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)
  bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  return fwd, bwd


def window_pairs(lens: np.ndarray, window: int | None) -> int:
  """Causal (query, key) pairs of the documents, inside the window."""
  cu = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
  return jax_cp.causal_pairs(cu, None if window is None else (window, 0))


def variants(dist: str, tokens: int, head_dim: int, backend: str,
             lens: np.ndarray, offs: np.ndarray,
             window: int | None = None) -> dict[str, Callable]:
  """The attention functions ``(q, k, v) -> out`` compared on one row."""
  longest = int(lens.max())
  window_size = None if window is None else (window, 0)

  def ours(mask: str, bound: int) -> Callable:
    return lambda q, k, v: jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type=mask,
        backend=backend, max_seqlen_q=bound, max_seqlen_kv=bound,
        window_size=window_size)

  out = {"ours": ours("causal_top_left", longest),
         "ours_br": ours("causal_bottom_right", longest)}
  if dist != "one_doc":
    out["ours_rowbound"] = ours("causal_top_left", tokens)
  if dist == "one_doc":
    out["jax_dense"] = lambda q, k, v: jax.nn.dot_product_attention(
        q[None], k[None], v[None], is_causal=True, implementation="cudnn",
        local_window_size=window_size)[0]
  q_seq = jnp.asarray(lens[None])
  q_off = jnp.asarray(np.append(offs, tokens)[None].astype(np.int32))
  scale = 1.0 / np.sqrt(head_dim)
  out["jax_packed"] = lambda q, k, v: fas.dot_product_attention(
      q[None], k[None], v[None], q_seqlen=q_seq, kv_seqlen=q_seq,
      q_offsets=q_off, kv_offsets=q_off, scale=scale,
      mask_type=fas.MaskType.PADDING_CAUSAL,
      sliding_window_length=None if window is None else window + 1)[0]
  return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Runs every variant; returns the records (also printed, and written
  to ``--out``)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, nargs="+", default=[32768])
  p.add_argument("--hq", type=int, default=HQ)
  p.add_argument("--hkv", type=int, nargs="+", default=[8, 32])
  p.add_argument("--head-dim", type=int, nargs="+", default=[HEAD_DIM])
  p.add_argument("--dists", nargs="+", choices=DISTS,
                 default=["one_doc", "uniform_1k_8k", "short_128_1k"])
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--backend", default="cudnn",
                 help="jax_cp backend of the ours* variants")
  p.add_argument("--window", type=int, default=None,
                 help="causal sliding window (LEFT, 0) for every variant")
  p.add_argument("--out", default=None)
  p.add_argument("--parity", action="store_true",
                 help="paired A/B of ours against jax.nn and JAX packed per "
                      "(--head-dim, --tokens) pair (benchmarks/fused_parity)")
  p.add_argument("--refs", nargs="+", default=["jax_dense", "jax_packed"],
                 choices=["jax_dense", "jax_packed"],
                 help="with --parity: the references ours is paired against")
  p.add_argument("--profile", action="store_true",
                 help="with --parity: per-kernel device time on one document")
  args = p.parse_args(argv)
  if args.window is not None and args.window < 0:
    p.error("--window must be >= 0")
  if args.parity:
    records = fused_parity.run(args, variants, fwd_and_bwd, pack_row)
    _write(args, {"parity": True, "records": records})
    return records
  if len(args.tokens) != 1 or len(args.head_dim) != 1:
    p.error("--tokens and --head-dim take several values only with --parity")
  t, hq, d = args.tokens[0], args.hq, args.head_dim[0]
  results = []
  rng = np.random.default_rng(0)

  def inputs(hkv: int) -> tuple:
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((t, hkv, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    return q, k, v, w

  for dist in args.dists:
    cu, cuP = pack_row(dist, t, 1, seed=0)
    lens = np.diff(cu).astype(np.int32)
    offs = cuP[:-1].astype(np.int32)
    longest = int(lens.max())
    pairs = window_pairs(lens, args.window)
    flops = {p: float(jax_cp.attention_flops(
        pairs, num_heads=hq, head_dim=d, backward=p == "fwd+bwd",
        recompute=True)) for p in ("fwd", "fwd+bwd")}
    for hkv in args.hkv:
      sets = [inputs(hkv), inputs(hkv)]
      fns = variants(dist, t, d, args.backend, lens, offs, args.window)
      if args.window is not None and "jax_dense" in fns:
        results.append(paired_record(fns, sets, args.reps, dist, hkv,
                                     args.window))
        print(json.dumps(results[-1]), flush=True)
      for name, attn in fns.items():
        fwd, bwd = fwd_and_bwd(attn)
        for pass_name, fn, arg_sets, fl in (
            ("fwd", fwd, [s[:3] for s in sets], flops["fwd"]),
            ("fwd+bwd", bwd, sets, flops["fwd+bwd"])):
          rec = {"dist": dist, "hkv": hkv, "variant": name,
                 "pass_": pass_name, "docs": len(lens), "longest": longest}
          try:
            ms = 1e3 * statistics.median(timing.synced(
                fn, arg_sets, reps=args.reps, warmup=3))
            rec.update(ms=ms, tflops=fl / ms / 1e9)
          except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
            rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
          results.append(rec)
          print(json.dumps(rec), flush=True)
  results, paired = ([r for r in results if "speedup_median" not in r],
                     [r for r in results if "speedup_median" in r])
  for r in paired:
    print(f"paired fwd+bwd ours / jax_dense ({r['dist']}, Hkv={r['hkv']}, "
          f"window {r['window']}): {r['speedup_median']:.3f}x "
          f"(IQR {r['speedup_q1']:.3f}-{r['speedup_q3']:.3f})")
  # Ratios against the references, per (dist, hkv, pass).
  print("\n| mix | Hkv | pass | variant | ms | TFLOP/s | vs jax_dense | "
        "vs jax_packed |\n|---|---|---|---|---|---|---|---|")
  for r in results:
    if "ms" not in r:
      print(f"| {r['dist']} | {r['hkv']} | {r['pass_']} | {r['variant']} | "
            f"error: {r['error'][:60]} | | | |")
      continue
    ref = {x["variant"]: x for x in results
           if (x["dist"], x["hkv"], x["pass_"]) ==
           (r["dist"], r["hkv"], r["pass_"]) and "ms" in x}
    one = [x for x in results if x["dist"] == "one_doc" and
           x["hkv"] == r["hkv"] and x["pass_"] == r["pass_"] and
           x["variant"] == "jax_dense" and "ms" in x]
    vd = f"{r['tflops'] / one[0]['tflops']:.2f}x" if one else ""
    vp = (f"{r['tflops'] / ref['jax_packed']['tflops']:.2f}x"
          if "jax_packed" in ref else "")
    print(f"| {r['dist']} | {r['hkv']} | {r['pass_']} | {r['variant']} | "
          f"{r['ms']:.2f} | {r['tflops']:.0f} | {vd} | {vp} |")
  _write(args, {"tokens": t, "hq": hq, "head_dim": d, "window": args.window,
                "records": results + paired})
  return results + paired


def _write(args, record: dict[str, Any]) -> None:
  """Writes a run's records through :mod:`benchmarks.results` (``--out``)."""
  if not args.out:
    return
  env = environment()
  tag = "parity" if record.get("parity") else None
  path = write_result(result_path(args.out, "fused", env, tag=tag),
                      {"env": env, "args": vars(args), **record})
  print("wrote", path)


def paired_record(fns: dict[str, Callable], sets: list, reps: int, dist: str,
                  hkv: int, window: int) -> dict[str, Any]:
  """``ours`` against ``jax_dense`` forward+backward, timed in
  alternation; ``speedup_median`` > 1 when ours is faster."""
  rec = {"dist": dist, "hkv": hkv, "variant": "paired_vs_jax_dense",
         "pass_": "fwd+bwd", "window": window}
  try:
    r = timing.paired(fwd_and_bwd(fns["jax_dense"])[1], sets,
                      fwd_and_bwd(fns["ours"])[1], sets, reps=reps)
    rec.update(ms_jax_dense=r.ms_a, ms_ours=r.ms_b,
               speedup_median=r.ratio_median, speedup_q1=r.ratio_q1,
               speedup_q3=r.ratio_q3)
  except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
    rec.update(error=f"{type(e).__name__}: {str(e)[:300]}",
               speedup_median=float("nan"), speedup_q1=float("nan"),
               speedup_q3=float("nan"))
  return rec


if __name__ == "__main__":
  main()
