"""Memory of the example's training step against the row length.

    python -m benchmarks.bench_memory --model big --remat full \\
        --seq-lens 512k 1M --layer-chunk-size 32768

For a model (``--model example``: 4 x 1024, 16/4 heads; ``big``: 16 x
2048, 32/8 heads; head dim 64), row lengths T, cp sizes, remat presets and
the layers' ``--mlp-chunk-size`` and ``--layer-chunk-size``, one row per
step (standard-library files cut at ``--max-doc-len`` bytes), the
example's model and AdamW step (``examples/packed_lm``), each run records
XLA's compiled memory analysis (temp, arguments, outputs), the device's
``peak_bytes_in_use`` (the process's running maximum), the cuDNN
backward's scratch of the step's main attention call
(:mod:`jax_cp.attention.cudnn.workspace`: one sub-call's where the
backward runs over head groups; XLA does not plan it), the matmul FLOPs
the compiled step runs (:mod:`benchmarks.hlo_flops`), ms/step and MFU.
Every run that trains has its attention call checked exact afterwards
(out, lse, dq, dk, dv against :mod:`benchmarks.exactness`'s subset
reference, the whole row's call, or a layer chunk's chunk and halo calls;
status ``inexact`` above ``EXACT_TOL``).

* ``--search``: per (preset, cp), the longest T that trains: T doubles
  until a step fails (out of memory, or inexact), then the bracket is
  bisected to ``--search-step``; every try is a record.
* ``--ab T``: the step at T with the settings ``--ab-a`` against
  ``--ab-b`` (``KEY=VALUE`` of remat, mlp_chunk_size, layer_chunk_size),
  timed in alternation; the ratio is A's time over B's.
* ``--breakdown``: where XLA's bytes go (:mod:`benchmarks.buffer_breakdown`).
* ``--schedule``: the collectives of the compiled step and what runs
  beside them (:mod:`benchmarks.schedule`).
* ``--compile-only``: the memory analysis alone, no step run (status
  ``compiled``); with ``--target h200`` compiled for ``--cp`` compile-only
  devices of that GPU on a machine without one
  (:mod:`benchmarks.deviceless`; ``--backend cudnn`` with the extension
  built, or ``standin``, :mod:`benchmarks.standin_attention`).

Writes ``memory_<date>_<device>[_<tag>].json`` (rewritten after every
record) and rebuilds ``memory.md`` beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
from collections.abc import Sequence

from benchmarks import deviceless, hlo_flops, results, timing, workload
from benchmarks.schedule import summarize as schedule_summary
from examples.packed_lm.config import REMAT

#: Largest relative error of any output of the exactness check (bfloat16
#: rounding alone gives 2e-3 to 4e-3).
EXACT_TOL = 5e-3
SETTINGS = ("remat", "mlp_chunk_size", "layer_chunk_size")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_memory",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  tokens = workload.parse_tokens
  p.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
  p.add_argument("--model", default="example", choices=sorted(
      workload.MODELS))
  for name in ("layers", "d_model", "heads", "kv_heads"):
    p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                   help=f"override the model's {name}")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="default: bfloat16 on GPU, float32 on CPU")
  p.add_argument("--backend", default="auto",
                 choices=("auto", "xla", "cudnn", "standin"))
  p.add_argument("--strategy", default="no_load_balance",
                 choices=workload.STRATEGIES)
  p.add_argument("--seq-lens", type=tokens, nargs="*", default=[])
  p.add_argument("--comm-type", default="all_gather",
                 choices=("all_gather", "ring", "all_to_all",
                          "all_to_all+ring"),
                 help="how K/V travel between CP ranks")
  p.add_argument("--cp-inner", type=int, default=None,
                 help="all_to_all+ring: ranks of the inner axis (the "
                 "all-to-all's); cp = outer x inner")
  p.add_argument("--scan-layers", action="store_true",
                 help="the model's layers as a scan (one layer's schedule)")
  p.add_argument("--cp", type=int, nargs="+", default=[1])
  p.add_argument("--remat", nargs="+", default=["none"], choices=REMAT)
  p.add_argument("--mlp-chunk-size", default="auto",
                 help="auto, none or tokens per MLP chunk of a rank")
  p.add_argument("--layer-chunk-size", default="none",
                 help="none or tokens per chunk of the whole layer (cp 1)")
  p.add_argument("--max-doc-len", type=tokens, default=16384)
  p.add_argument("--steps", type=int, default=3, help="timed steps")
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--compile-only", action="store_true")
  p.add_argument("--search", action="store_true")
  p.add_argument("--search-start", type=tokens, default=None,
                 help="first T of the search (default: the longest listed "
                 "T that trained, else --search-step)")
  p.add_argument("--search-step", type=tokens, default=16384)
  p.add_argument("--search-max", type=tokens, default=1 << 23)
  p.add_argument("--time-budget", type=float, default=None,
                 help="seconds for the searches: none tries a new T past "
                 "its even share of what is left")
  p.add_argument("--ab", type=tokens, default=None, metavar="T")
  p.add_argument("--ab-a", nargs="+", default=["remat=none"])
  p.add_argument("--ab-b", nargs="+", default=["remat=save_context"])
  p.add_argument("--ab-reps", type=int, default=3)
  p.add_argument("--breakdown", action="store_true")
  p.add_argument("--schedule", action="store_true",
                 help="record what XLA scheduled beside each collective "
                 "(benchmarks.schedule)")
  p.add_argument("--target", default=None, choices=deviceless.targets())
  p.add_argument("--memory-limit", type=float, default=None,
                 help="GB: a step planning more (temp + arguments + "
                 "outputs not aliased + cuDNN scratch) fails")
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="per device, for the MFU (default: 989 on GPU)")
  p.add_argument("--no-check-exact", dest="check_exact",
                 action="store_false")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=results.RESULTS_DIR)
  p.add_argument("--tag", default=None, help="suffix of the result file")
  return p


def cp_inner(args, cp: int) -> int | None:
  """``--cp-inner`` for all_to_all+ring (it must divide cp; 1 at cp = 1)."""
  if args.comm_type != "all_to_all+ring":
    return None
  if cp == 1:
    return 1
  if args.cp_inner is None or cp % args.cp_inner:
    raise ValueError(f"--comm-type all_to_all+ring needs a --cp-inner that "
                     f"divides cp={cp}, got {args.cp_inner}")
  return args.cp_inner


def model_sizes(args) -> dict:
  return {k: v if getattr(args, k) is None else getattr(args, k)
          for k, v in workload.MODELS[args.model].items()}


def model_name(args) -> str:
  """``--model``, with ``*`` when a size is overridden."""
  return args.model + ("*" if model_sizes(args) != workload.MODELS[
      args.model] else "")


def settings(args, **changes) -> dict:
  """The layers' settings: the first ``--remat``, the chunk flags, and
  ``changes``."""
  return {"remat": args.remat[0], "mlp_chunk_size": args.mlp_chunk_size,
          "layer_chunk_size": args.layer_chunk_size, **changes}


@dataclasses.dataclass
class Step:
  """A compiled training step with its state, batch, rows and config."""

  fn: object
  state: object
  batch: object
  rows: object
  cfg: object
  matmul_params: int
  compile_s: float
  breakdown: dict | None = None

  def run_one(self):
    self.state, loss = self.fn(self.state, self.batch)
    return loss


def build_step(args, seq_len: int, cp: int, layer: dict) -> Step:
  """The example's model and step over one packed row, compiled (for
  ``--target``: on compile-only devices, with abstract state and batch)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from examples.packed_lm import config, data, train  # pylint: disable=import-outside-toplevel
  from examples.packed_lm import main as lm_main  # pylint: disable=import-outside-toplevel
  from examples.packed_lm import model as lm  # pylint: disable=import-outside-toplevel
  cfg = config.Config(
      device=args.device, dtype=args.dtype, seq_len=seq_len, batch=1, dp=1,
      cp=cp, strategy=args.strategy, comm_type=args.comm_type,
      cp_inner=cp_inner(args, cp), scan_layers=args.scan_layers,
      backend=args.backend,
      max_doc_len=args.max_doc_len, doc_order="packed",
      seed=args.seed,
      **model_sizes(args), **layer)
  rows = data.load_rows(cfg, 1, cp)
  mesh = lm_main.make_mesh(1, cp, args.device, cfg)
  batch = data.place_batch(rows, lm.make_layout(cfg, mesh, rows.max_seqlen))
  if args.target:
    axes = lm.mesh_shape(cfg, 1, cp)   # the inner axis within a host
    devices = deviceless.compile_only_devices(args.target, cp)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(*axes.values()),
                             tuple(axes), axis_types=(
                                 jax.sharding.AxisType.Auto,) * len(axes))
    batch = deviceless.abstract(batch, mesh)
  layout = lm.make_layout(cfg, mesh, rows.max_seqlen)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = train.init_state(
        cfg, layout, train.make_optimizer(cfg), mesh,
        abstract=bool(args.target))
    n_params = lm.matmul_params(nnx.merge(graphdef, state)[0])
    lowered = train.make_train_step(graphdef, shardings, mesh,
                                    cfg.param_sharding).lower(state, batch)
    t0 = time.perf_counter()
    breakdown = None
    if args.breakdown:
      from benchmarks import buffer_breakdown  # pylint: disable=import-outside-toplevel
      compiled, breakdown = buffer_breakdown.compile_with_breakdown(lowered)
    else:
      compiled = lowered.compile()
  return Step(compiled, state, batch, rows, cfg, n_params,
              time.perf_counter() - t0, breakdown)


def compiled_facts(compiled) -> dict:
  """XLA's memory analysis (bytes) and the matmul FLOPs of the compiled
  step (``dot_flops``; ``dot_flops_error`` where they cannot be read)."""
  out = {}
  try:
    ma = compiled.memory_analysis()
    for k in ("temp", "argument", "output", "alias", "host_temp"):
      out[f"{k}_bytes"] = int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
  except Exception:  # noqa: BLE001, S110  (no analysis on this backend)
    pass
  try:
    count = hlo_flops.dot_flops(compiled.as_text())
    out.update(dot_flops=count.flops,
               dot_flops_unknown_loops=count.loops_without_trip_count)
  except Exception as err:  # noqa: BLE001
    out["dot_flops_error"] = f"{type(err).__name__}: {err}"[:300]
  return out


def device_memory() -> dict:
  """``peak_bytes_in_use``, ``bytes_limit``, ``bytes_in_use`` of device 0
  where the platform reports them."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001
    stats = {}
  return {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_limit",
                                     "bytes_in_use") if k in stats}


def is_out_of_memory(err: BaseException) -> bool:
  text = f"{type(err).__name__}: {err}"
  return isinstance(err, MemoryError) or any(s in text for s in (
      "RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM",
      "workspace allocation", "Resource exhausted"))


def layer_plan(cfg, max_seqlen: int):
  """The layer-chunk plan of the model (None: whole rows)."""
  import jax_cp  # pylint: disable=import-outside-toplevel
  from jax_cp.modules import layer_chunks  # pylint: disable=import-outside-toplevel
  return layer_chunks.plan(cfg.layer_chunk_size, jax_cp.CPLayout(
      cp_axis=None, max_seqlen=max_seqlen), cfg.seq_len, -1)


def resolved_backend(cfg) -> str:
  """The name of the attention backend the step runs."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from jax_cp.attention.registry import resolve_backend  # pylint: disable=import-outside-toplevel
  try:
    return resolve_backend(cfg.backend, dtype=jnp.dtype(cfg.dtype)).name
  except Exception:  # noqa: BLE001
    return cfg.backend


def main_call_tokens(cfg, cp: int, max_seqlen: int
                     ) -> tuple[int, int, int, int]:
  """``(queries, keys, query heads, K/V heads)`` of the step's main
  attention call: a layer chunk's; at cp = 1, or with the ring exchange,
  a rank's chunk against itself; with an all-gather, a rank's chunk
  against the whole row (a NO_LOAD_BALANCE halo: its local call, a chunk
  against itself); after an all-to-all over ``ci`` ranks, ``H/ci`` heads
  (K/V heads repeated up to one a rank) of the whole row, or with
  all_to_all+ring of the outer ring's chunk against itself."""
  from jax_cp.cp.exchange import choose_exchange  # pylint: disable=import-outside-toplevel
  plan = layer_plan(cfg, max_seqlen)
  h, kv = cfg.heads, cfg.kv_heads
  if plan is not None:
    return plan.chunk, plan.chunk, h, kv
  if cfg.comm_type.startswith("all_to_all") and cp > 1:
    ci = cfg.cp_inner or cp
    tl = cfg.seq_len // (cp // ci)
    return tl, tl, h // ci, max(kv // ci, 1)
  tl = cfg.seq_len // cp
  kind = choose_exchange(cfg.strategy == "no_load_balance", "cp", cp,
                         cfg.seq_len, max_seqlen,
                         comm_type=cfg.comm_type).kind
  return tl, cfg.seq_len if kind == "all_gather" else tl, h, kv


def attention_scratch(cfg, cp: int, rows) -> tuple[int, int, int]:
  """The cuDNN backward workspace of one sub-call of the step's main call
  (:func:`main_call_tokens`), and the head groups and K/V slices of each
  group that the call runs as (:func:`jax_cp.attention.cudnn.workspace.
  backward_split`)."""
  from jax_cp.attention.cudnn import workspace as ws  # pylint: disable=import-outside-toplevel
  tq, tkv, h, kv = main_call_tokens(cfg, cp, rows.max_seqlen)
  hd = cfg.d_model // cfg.heads
  kw = dict(segments=rows.cu_seqlens.shape[-1] - 1,
            max_seqlen_q=min(rows.max_seqlen, tq))
  groups, slices = ws.backward_split(tq, tkv, h, kv, hd, **kw)
  return ws.backward_workspace_bytes(
      tq, -(-tkv // slices), h // groups, kv // groups, hd,
      **kw), groups, slices


def planned_bytes(rec: dict) -> int | None:
  """XLA's temp, arguments and outputs not aliased to them, plus the cuDNN
  scratch; None without a memory analysis."""
  if not rec.get("temp_bytes"):
    return None
  return (rec["temp_bytes"] + rec.get("argument_bytes", 0)
          + rec.get("output_bytes", 0) - rec.get("alias_bytes", 0)
          + rec.get("attention_scratch_bytes", 0))


def step_mfu(args, step: Step, ms: float) -> tuple[float, float | None]:
  """Model FLOPs of the step's row and the MFU at ``ms`` per step."""
  import jax_cp  # pylint: disable=import-outside-toplevel
  c = step.cfg
  flops = jax_cp.planning.model_flops(
      step.rows.cu_seqlens, tokens=c.seq_len, matmul_params=step.matmul_params,
      num_layers=c.layers, num_heads=c.heads, head_dim=c.d_model // c.heads)
  peak = args.peak_tflops or (989.0 if args.device == "gpu" else None)
  return flops, (flops / (ms / 1e3) / (peak * 1e12 * c.cp) if peak else None)


def measure(args, seq_len: int, cp: int, remat: str, *, timed: bool = True
            ) -> dict:
  """One run: compile, memory analysis, ``warmup + steps`` steps (one
  untimed step with ``timed=False``), then the exactness check. A failure
  is recorded (status ``oom`` or ``error``), not raised."""
  import jax  # pylint: disable=import-outside-toplevel
  layer = settings(args, remat=remat)
  rec = dict(kind="run", model=model_name(args), seq_len=seq_len, cp=cp,
             strategy=args.strategy, comm_type=args.comm_type,
             scan_layers=args.scan_layers, backend=args.backend, **layer)
  if args.cp_inner is not None and cp > 1:
    rec["cp_inner"] = args.cp_inner
  step = None
  try:
    step = build_step(args, seq_len, cp, layer)
    scratch, groups, slices = attention_scratch(step.cfg, cp, step.rows)
    rec["backend"] = resolved_backend(step.cfg)
    rec.update({k: getattr(step.cfg, k) for k in (
        "layers", "d_model", "heads", "kv_heads", "dtype")},
        max_seqlen=step.rows.max_seqlen, compile_s=step.compile_s,
        attention_scratch_bytes=scratch, attention_scratch_groups=groups,
        attention_scratch_kv_slices=slices,
        **compiled_facts(step.fn))
    if args.schedule:
      rec["schedule"] = schedule_summary(step.fn.as_text())
    if step.breakdown is not None:
      rec["breakdown"] = step.breakdown
    planned = planned_bytes(rec) or 0
    if args.memory_limit is not None and planned > args.memory_limit * 1e9:
      raise MemoryError(f"RESOURCE_EXHAUSTED (--memory-limit): {planned} "
                        f"bytes planned > {args.memory_limit} GB")
    if args.compile_only:
      rec["status"] = "compiled"
      return rec
    losses = [step.run_one() for _ in range(args.warmup if timed else 1)]
    jax.block_until_ready(losses)
    if timed and args.steps:
      t0 = time.perf_counter()
      losses = [step.run_one() for _ in range(args.steps)]
      jax.block_until_ready(losses)
      ms = (time.perf_counter() - t0) / args.steps * 1e3
      flops, mfu = step_mfu(args, step, ms)
      rec.update(ms_per_step=ms, tok_per_s=seq_len / (ms / 1e3),
                 model_flops=flops, mfu=mfu)
    loss = float(losses[-1])
    rec.update(status="ok" if loss == loss else "nan", loss=loss,
               **device_memory())
  except Exception as err:  # noqa: BLE001  (recorded; the run goes on)
    rec.update(status="oom" if is_out_of_memory(err) else "error",
               error=f"{type(err).__name__}: {err}"[:1200], **device_memory())
  rows, cfg = (step.rows, step.cfg) if step is not None else (None, None)
  del step
  gc.collect()
  if rec["status"] == "ok" and args.check_exact:
    check_exact(rec, rows, cfg)
  return rec


def exact_calls(rows, cfg) -> dict:
  """The step's attention calls to check, ``name -> (segments, query
  tokens, key tokens, mask)``: the whole row's call, or with layer chunks
  the last full chunk's chunk call and (where a document straddles its
  start) its halo call."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jax_cp.attention.backend import Segments  # pylint: disable=import-outside-toplevel
  from jax_cp.attention.decompose import chunk_attention  # pylint: disable=import-outside-toplevel
  from jax_cp.modules import layer_chunks  # pylint: disable=import-outside-toplevel

  def live(seg):
    keep = np.asarray(seg.q_lens) > 0
    return None if not keep.any() else Segments(
        *(jnp.asarray(np.asarray(x)[keep], jnp.int32) for x in (
            seg.q_lens, seg.kv_lens, seg.q_offsets, seg.kv_offsets)),
        seg.max_seqlen_q, seg.max_seqlen_kv, rows_see_keys=True)
  cu, cuP = rows.cu_seqlens[0], rows.cu_seqlens_padded[0]
  t, bound = int(cuP[-1]), rows.max_seqlen
  plan = layer_plan(cfg, bound)
  if plan is None:
    seg = Segments(np.diff(cu), np.diff(cu), cuP[:-1], cuP[:-1], bound,
                   bound)
    return {"row": (live(seg), t, t, "causal_top_left")}
  c = plan.chunk
  start = (t // c - 1) * c
  halo = start - max(start - plan.halo, 0)
  parts = layer_chunks.chunk_segments(cu, cuP, start, start - halo, c)
  calls = chunk_attention.plan_calls([jnp.asarray(a)[None] for a in parts],
                                     c, halo, min(bound, c), True)
  out = {"chunk": (live(calls.chunk), c, c, "causal_top_left")}
  if calls.halo is not None and live(calls.halo.segments) is not None:
    out["halo"] = (live(calls.halo.segments), calls.halo.rows, halo,
                   calls.halo.mask)
  return out


def check_exact(rec: dict, rows, cfg) -> None:
  """Checks the step's attention calls (:func:`exact_calls`) with the
  model's heads in its dtype against the subset reference
  (:func:`benchmarks.exactness.check_call`); records ``exact`` (each
  output's largest error) and makes a failing check status ``inexact``.
  At cp > 1 it checks the cp=1 call of the whole row."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from benchmarks import exactness  # pylint: disable=import-outside-toplevel
  from jax_cp.attention.registry import resolve_backend  # pylint: disable=import-outside-toplevel
  dtype, d = jnp.dtype(cfg.dtype), cfg.d_model // cfg.heads
  backend = resolve_backend(rec["backend"], dtype=dtype)
  errs = {}
  for name, (seg, tq, tkv, mask) in exact_calls(rows, cfg).items():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (tq, cfg.heads, d), dtype)
    k = jax.random.normal(keys[1], (tkv, cfg.kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (tkv, cfg.kv_heads, d), dtype)
    try:
      errs[name] = exactness.check_call(backend, q, k, v, seg, mask=mask)
    except Exception as err:  # noqa: BLE001
      rec.update(status="inexact", exact=None,
                 exact_error=f"{name} call: {type(err).__name__}: {err}"[:600])
      return
    finally:
      del q, k, v
      gc.collect()
  rec["exact"] = {o: max(e[o] for e in errs.values()) for o in
                  exactness.OUTPUTS}
  rec["exact_calls"] = errs
  if not max(rec["exact"].values()) <= EXACT_TOL:
    rec["status"] = "inexact"


def longest_trainable(args, cp: int, remat: str, listed: list[dict],
                      budget_s: float | None) -> tuple[dict, list[dict]]:
  """The longest T that trains (to ``--search-step``) and the records of
  the tries: T doubles from the start until a step fails, then the
  bracket is bisected; no new T is tried past ``budget_s``."""
  step, started, tries = args.search_step, time.monotonic(), []
  known = {r["seq_len"]: r["status"] in ("ok", "compiled") for r in listed
           if r.get("kind") == "run" and (r["cp"], r["remat"]) == (cp, remat)}
  stopped = False

  def trains(n: int) -> bool | None:
    nonlocal stopped
    if n in known:
      return known[n]
    last = tries[-1]["try_s"] if tries else 0.0
    if budget_s is not None and time.monotonic() - started + last > budget_s:
      stopped = True
      return None
    t0 = time.monotonic()
    rec = measure(args, n, cp, remat, timed=False)
    rec["try_s"] = time.monotonic() - t0
    tries.append(rec)
    print_record(rec)
    if rec["status"] == "error":   # not memory: no T will do
      stopped = True
      return None
    known[n] = rec["status"] in ("ok", "compiled")
    return known[n]

  lo, hi = 0, None
  t = args.search_start or max([n for n, ok in known.items() if ok],
                               default=step)
  t = max(step, t // step * step)
  while hi is None and t <= args.search_max:
    ok = trains(t)
    if ok is None:
      break
    lo, hi, t = (t, None, 2 * t) if ok else (lo, t, t)
  while hi is not None and hi - lo > step and not stopped:
    mid = (lo + hi) // 2 // step * step
    ok = trains(mid) if mid > lo else None
    if ok is None:
      break
    lo, hi = (mid, hi) if ok else (lo, mid)
  layer = settings(args, remat=remat)
  inner = {} if args.cp_inner is None or cp == 1 else dict(
      cp_inner=args.cp_inner)
  return dict(kind="search", model=model_name(args), cp=cp, **layer,
              strategy=args.strategy, comm_type=args.comm_type, **inner,
              scan_layers=args.scan_layers, longest_seq_len=lo or None,
              first_failing_seq_len=hi,
              search_step=step, search_max=args.search_max,
              stopped_early=stopped,
              tries=[dict(seq_len=r["seq_len"], status=r["status"],
                          seconds=round(r["try_s"], 1)) for r in tries]), tries


def parse_setting(entries: Sequence[str]) -> dict:
  out = {}
  for entry in entries:
    key, eq, value = entry.partition("=")
    if not eq or key not in SETTINGS:
      raise SystemExit(f"--ab-a/--ab-b: {entry!r} is not KEY=VALUE with "
                       f"KEY one of {list(SETTINGS)}")
    out[key] = value
  return out


def paired_ab(args, seq_len: int, cp: int) -> dict:
  """The step at ``seq_len`` with ``--ab-a`` (A) against ``--ab-b`` (B),
  timed in alternation; ``ratio`` = time(A) / time(B)."""
  a, b = parse_setting(args.ab_a), parse_setting(args.ab_b)
  steps = [build_step(args, seq_len, cp, settings(args, **s)) for s in (a, b)]
  name = lambda s: ",".join(f"{k}={v}" for k, v in s.items())

  def on_rep(i, sa, sb, ratio):
    print(f"A/B rep {i + 1}: {name(a)} {sa * 1e3:.1f} ms, {name(b)} "
          f"{sb * 1e3:.1f} ms ({ratio:.3f})", flush=True)
  r = timing.paired(steps[0].run_one, [()], steps[1].run_one, [()],
                    reps=args.ab_reps, warmup=1, on_rep=on_rep)
  rec = dict(kind="ab", model=model_name(args), seq_len=seq_len, cp=cp,
             **settings(args), a=name(a), b=name(b), settings_a=a,
             settings_b=b, reps=args.ab_reps, **r.fields())
  rec["mfu_a"], rec["mfu_b"] = (step_mfu(args, s, ms)[1] for s, ms in
                                zip(steps, (r.ms_a, r.ms_b)))
  del steps
  gc.collect()
  return rec


def print_record(rec: dict) -> None:
  gb = lambda k: "-" if rec.get(k) is None else f"{rec[k] / 1e9:.2f}"
  line = (f"{rec['model']} T={workload.fmt_tokens(rec['seq_len'])} "
          f"cp={rec['cp']} {rec['remat']} {rec['status']}: temp "
          f"{gb('temp_bytes')} GB, args {gb('argument_bytes')} GB, peak "
          f"{gb('peak_bytes_in_use')} GB, scratch "
          f"{gb('attention_scratch_bytes')} GB")
  if rec.get("ms_per_step") is not None:
    line += f", {rec['ms_per_step']:.1f} ms/step"
  if rec.get("exact"):
    line += f", exact to {max(rec['exact'].values()):.1e}"
  print(line, flush=True)
  for key in ("error", "exact_error"):
    if rec.get(key):
      print(f"  {key}: {rec[key][:600]}", flush=True)


def main(argv: Sequence[str] | None = None) -> str:
  """Runs; returns the path of the JSON written."""
  args = build_parser().parse_args(argv)
  if not args.seq_lens and not args.search and args.ab is None:
    raise SystemExit("nothing to do: give --seq-lens, --search or --ab")
  if args.target is not None and (not args.compile_only or args.backend
                                  not in ("standin", "cudnn")):
    raise SystemExit(f"--target {args.target} compiles for a GPU that is "
                     "not here: it needs --compile-only and --backend "
                     "standin or cudnn")
  for cp in args.cp:
    if cp > 1:
      try:
        cp_inner(args, cp)
      except ValueError as e:
        raise SystemExit(str(e)) from None
  if args.backend == "standin" and not args.compile_only:
    raise SystemExit("--backend standin is not attention: it plans memory "
                     "with --compile-only and runs no step")
  env = {"mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
         "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}
  if args.target is not None:
    args.device, args.dtype = "cpu", args.dtype or "bfloat16"
    deviceless.configure()
    env.update(target=args.target, platform="cuda (compile-only)",
               device_kind=deviceless.device_kind(args.target) + " (plan)",
               device_count=max(args.cp))
  args.dtype = args.dtype or ("bfloat16" if args.device == "gpu"
                              else "float32")
  if args.device == "cpu":
    workload.use_cpu(max(args.cp))
  if args.backend == "standin":
    from benchmarks import standin_attention  # pylint: disable=import-outside-toplevel
    standin_attention.register()
  started = time.monotonic()
  run = results.Run("memory", argv, args, args.tag, **env)
  if args.ab is not None:
    try:
      rec = paired_ab(args, args.ab, min(args.cp))
      run.add(rec)
      print(f"A/B at T={workload.fmt_tokens(args.ab)}: {rec['a']} "
            f"{rec['ms_a']:.1f} ms, {rec['b']} {rec['ms_b']:.1f} ms, "
            f"A/B {rec['ratio']:.3f}", flush=True)
    except Exception as err:  # noqa: BLE001
      print(f"A/B at T={workload.fmt_tokens(args.ab)} failed: {err}"[:1200])
  groups = [(remat, cp) for remat in dict.fromkeys(args.remat)
            for cp in args.cp]
  for remat, cp in groups:
    for t in sorted(set(args.seq_lens)):
      run.add(measure(args, t, cp, remat))
      print_record(run.records[-1])
  for i, (remat, cp) in enumerate(groups if args.search else []):
    budget = None if args.time_budget is None else max(0.0, (
        args.time_budget - (time.monotonic() - started))) / (
            len(groups) - i)
    search, tries = longest_trainable(args, cp, remat, run.records, budget)
    run.add(*tries, search)
    print(f"longest T that trains ({model_name(args)}, cp={cp}, {remat}): "
          f"{workload.fmt_tokens(search['longest_seq_len'] or 0)}",
          flush=True)
  return run.finish()


if __name__ == "__main__":
  main()
