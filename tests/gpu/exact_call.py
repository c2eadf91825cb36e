"""Runs exactness checks of large cuDNN calls in a process of their own.

``python -m tests.gpu.exact_call CASES_JSON`` reads a JSON list of cases
and prints one JSON line per case: ``{"id": ..., "errors": {out, lse, dq,
dk, dv}}`` or ``{"id": ..., "error": "..."}``. The GPU tests run it as a
subprocess (tests/gpu/test_long_rows_exact.py): the calls hold tens of GB,
which a separate process returns to the device when it exits, whatever
else the test workers sharing the GPU hold.

A case is a dict:

* ``kind``: ``"call"`` (one ``cudnn`` backend forward and backward,
  :func:`benchmarks.exactness.check_call`) or ``"cp"``
  (``jax_cp.cp_attention`` at cp=1 on a one-device mesh, its ``jax.vjp``
  against :func:`benchmarks.exactness.subset_reference`);
* ``layout``, ``tokens``, ``hq``, ``hkv``, ``d``, ``dtype``, ``cp`` as in
  :class:`benchmarks.exactness.Case` (layouts ``one_doc``, ``mixed``,
  ``short``, ``cp``);
* ``offset_bits`` (optional, ``"call"`` only): force 32- or 64-bit ragged
  offsets instead of the backend's choice (the mutation check);
* ``strategy``, ``window`` (``"cp"`` only).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np


def _segments(case):
  from benchmarks.exactness import Case, segments_for
  c = Case(case["layout"], case["tokens"], case["hq"], case["hkv"],
           case["d"], case.get("dtype", "bfloat16"), case.get("cp", 8))
  return c, segments_for(c, case.get("seed", 0))


def run_call(case) -> dict[str, float]:
  """One cudnn call's check (benchmarks.exactness.run_case)."""
  from benchmarks.exactness import run_case
  c, _ = _segments(case)
  r = run_case(c, case.get("offset_bits"), case.get("rows", 128),
               case.get("seed", 0))
  if r["error"]:
    raise RuntimeError(r["error"])
  return r["errors"]


def run_cp(case) -> dict[str, float]:
  """cp_attention at cp=1 on one row of documents, forward and backward."""
  import jax
  import jax.numpy as jnp

  import jax_cp
  from benchmarks import exactness
  from jax_cp.attention.backend import Segments

  c, (lens, _, starts, _, max_len, _, t, _, _) = _segments(case)
  strategy = case["strategy"]
  # Documents padded for the strategy (2*cp = 2 at cp=1: even lengths).
  padded = lens + (lens % 2 if strategy == "dual_chunk_swap" else 0)
  cuP = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  tp = int(cuP[-1])
  window = case.get("window", -1)
  mesh = jax.make_mesh((1,), ("cp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  keys = jax.random.split(jax.random.PRNGKey(case.get("seed", 0)), 3)
  dt = jnp.dtype(c.dtype)
  q = jax.random.normal(keys[0], (1, tp, c.hq, c.d), dt)
  k = jax.random.normal(keys[1], (1, tp, c.hkv, c.d), dt)
  v = jax.random.normal(keys[2], (1, tp, c.hkv, c.d), dt)
  seg = Segments(jnp.asarray(lens, jnp.int32), jnp.asarray(lens, jnp.int32),
                 jnp.asarray(cuP[:-1]), jnp.asarray(cuP[:-1]),
                 int(max_len), int(max_len))
  rows = exactness.pick_rows(cuP[:-1], lens, tp, case.get("rows", 128))
  rng = np.random.default_rng(1)
  do_rows = jnp.asarray(rng.standard_normal((rows.size, c.hq, c.d)), dt)
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", strategy=strategy,
                           max_seqlen=int(np.max(padded)), backend="cudnn")
  kw = {} if window < 0 else dict(window_size=(window, 0))

  @jax.jit
  def run(q, k, v, do_rows):
    def f(q, k, v):
      return jax_cp.cp_attention(
          q, k, v, (jnp.asarray(cu[None]), jnp.asarray(cuP[None])),
          layout=layout, **kw)
    out, vjp = jax.vjp(f, q, k, v)
    dout = jnp.zeros_like(out).at[0, rows].set(do_rows)
    dq, dk, dv = vjp(dout)
    return out[0, rows], dq[0], dk[0], dv[0]

  @jax.jit
  def errors(q, k, v, do_rows, got):
    ref = exactness.subset_reference(
        q[0], k[0], v[0], seg, jnp.asarray(rows),
        do_rows.astype(jnp.float32), mask="causal_top_left",
        scale=1.0 / math.sqrt(c.d), window_left=window)
    out, dq, dk, dv = got
    return (exactness.relative_error(out, ref.out),
            exactness.dq_error(dq, ref),
            exactness.relative_error(dk, ref.dk),
            exactness.relative_error(dv, ref.dv))

  got = run(q, k, v, do_rows)
  errs = errors(q, k, v, do_rows, got)
  return {n: float(e) for n, e in zip(("out", "dq", "dk", "dv"), errs)}


def main(argv) -> int:
  cases = json.loads(argv[1])
  for case in cases:
    try:
      fn = run_call if case.get("kind", "call") == "call" else run_cp
      line = {"id": case["id"], "errors": fn(case)}
    except Exception as e:  # noqa: BLE001 - reported to the test
      line = {"id": case["id"], "error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(line), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv))
