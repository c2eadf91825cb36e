"""Memory of a training step of the example's model against the row length.

For a model (``--model example``: 4 layers, d_model 1024, 16/4 heads;
``--model big``: 16 layers, d_model 2048, 32/8 heads; head dim 64 both), a
list of row lengths T (``--seq-lens 64k 128k``), cp sizes and remat presets
(``--remat none save_context``), one row per step (the Python standard
library's files as documents of at most ``--max-doc-len`` bytes), the
example's model (``examples/packed_lm``) with an AdamW step, each run
records:

* XLA's compiled memory analysis: temp, arguments, outputs (bytes);
* the device's ``peak_bytes_in_use`` after the run, where the platform
  reports it (the process's running maximum: runs go by increasing T);
* the cuDNN backward's scratch for the step's main attention call (local
  tokens ``T / cp``), which XLA does not plan: one sub-call's
  :func:`jax_cp.attention.cudnn_workspace.backward_workspace_bytes`, where
  the backward runs as sub-calls over head groups
  (``attention_scratch_groups``);
* ms/step, tok/s and MFU (``jax_cp.flops.model_flops``).

``--search`` adds, per (preset, cp), the longest T that trains: T doubles
from ``--search-start`` until a step fails (out of memory, caught), then
bisects between the last T that trained and the first that failed, to
``--search-step`` (16k) granularity. ``--ab T`` times the ``none`` and
``save_context`` steps at T in alternation (paired A/B); with
``--ab-mlp-chunk`` it times instead the first ``--remat`` preset with
``mlp_chunk_size`` = ``--mlp-chunk-size`` (chunked) against
``mlp_chunk_size=None`` (unchunked); ``--ab-layer-chunk`` likewise with
``layer_chunk_size``. ``--ab-profile`` then traces one step of each side
(``benchmarks/profiling.py``) and records its device milliseconds per
kernel group (attention, matmul, copy, elementwise) and heaviest kernels.

``--breakdown`` adds to each run where XLA's planned bytes go
(``benchmarks/buffer_breakdown.py``): the step is compiled with XLA
dumping its buffer assignment (per compile, through jax's
``compiler_options``: no ``XLA_FLAGS`` needed; the dump makes the
compile a little slower, ``compile_s`` included), and the record's
``breakdown`` holds the bytes per allocation kind, the values live at the
schedule's peak (by category: attention, mlp, logits/loss, optimizer,
state, ...; the largest ones) and the largest values of the temp
allocation (which overlap in time: the largest, not a decomposition).
It needs only the compile, so it works with ``--compile-only``.

``--target h200`` (with ``--compile-only`` and ``--backend cudnn``, the
extension built, or ``standin``) compiles the step for that GPU on a
machine without one (``benchmarks/deviceless.py``,
``benchmarks/gpu_targets``; JAX's CUDA plugin installed, no GPU or
driver): XLA's GPU plan, the cuDNN scratch added from the formula as on
the GPU. Its records are named for the GPU with ``(plan)`` added; they
are plans, not measurements, and train nothing.

Each invocation writes ``memory_<date>_<device>_<model>[_<N>layers]
[_<tag>].json`` into ``--out``, rewritten after every record (a run cut
short by a time limit keeps what it measured), and at its end
rebuilds ``--markdown`` (``benchmarks/results/MEMORY.md``) from every such
file there: a table of the runs, the longest T per preset, the A/B, and a
plot (matplotlib, when installed) of XLA temp bytes per local token per
layer against T, one line per preset. Several invocations (e.g. one per
model) thus share one report.

CPU (xla backend, small shapes)::

  python -m benchmarks.bench_memory --device cpu --layers 1 --d-model 64 \\
      --heads 2 --kv-heads 1 --seq-lens 512 1024 --cp 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import os
import time
from collections.abc import Callable, Sequence

from benchmarks import deviceless, hlo_flops  # no jax import
from benchmarks.names import MODELS, fmt_tokens, parse_tokens
from examples.packed_lm.config import REMAT as PRESETS  # no jax import

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MARKDOWN = os.path.join(_HERE, "results", "MEMORY.md")
DEFAULT_MAX_DOC_LEN = 16384


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_memory",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", default="gpu", choices=("cpu", "gpu"))
  p.add_argument("--model", default="example", choices=sorted(MODELS))
  for name in ("layers", "d_model", "heads", "kv_heads"):
    p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                   help=f"override the model's {name}")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="default: bfloat16 on GPU, float32 on CPU")
  p.add_argument("--backend", default="auto",
                 choices=("auto", "xla", "cudnn", "standin"),
                 help="standin: an O(T) stand-in for attention that plans "
                      "the rest of the step's memory on a CPU "
                      "(benchmarks/standin_attention; --compile-only only; "
                      "best with XLA_FLAGS=--xla_cpu_experimental_ynn_"
                      "fusion_type=)")
  p.add_argument("--strategy", default="no_load_balance",
                 choices=("no_load_balance", "dual_chunk_swap"))
  p.add_argument("--seq-lens", type=parse_tokens, nargs="*", default=[],
                 help="row lengths T (64k, 1M, ...)")
  p.add_argument("--cp", type=int, nargs="+", default=[1])
  p.add_argument("--remat", nargs="+", default=["none"], choices=PRESETS)
  p.add_argument("--max-doc-len", type=parse_tokens,
                 default=DEFAULT_MAX_DOC_LEN,
                 help="documents cut to this many bytes")
  p.add_argument("--steps", type=int, default=3, help="timed steps")
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--compile-only", action="store_true",
                 help="record XLA's memory analysis without running a step "
                      "(status 'compiled'): the per-layer slope from runs "
                      "at two --layers costs two compiles")
  p.add_argument("--search", action="store_true",
                 help="find the longest T that trains, per preset and cp")
  p.add_argument("--search-start", nargs="+", default=[],
                 help="first T of the search: one T for every preset, or "
                      "PRESET=T entries (default: the longest listed T "
                      "that trained, else --search-step)")
  p.add_argument("--time-budget", type=float, default=None,
                 help="seconds for the whole run: each search gets an even "
                      "share of what is left when it starts and tries no new"
                      " T past it (it reports the bracket found)")
  p.add_argument("--search-step", type=parse_tokens, default=16384,
                 help="granularity of the search (and of every T)")
  p.add_argument("--search-max", type=parse_tokens, default=1 << 23)
  p.add_argument("--ab", type=parse_tokens, default=None,
                 help="time the none and save_context steps at this T in "
                      "alternation (paired A/B)")
  p.add_argument("--ab-reps", type=int, default=5)
  p.add_argument("--ab-mlp-chunk", action="store_true",
                 help="make --ab compare the first --remat preset with "
                      "mlp_chunk_size=--mlp-chunk-size (chunked) against "
                      "mlp_chunk_size=None (unchunked) instead of none "
                      "against save_context")
  p.add_argument("--ab-profile", action="store_true",
                 help="after the A/B's timing, trace one step of each "
                      "side with jax.profiler and record (and print) its "
                      "device milliseconds per kernel group and its "
                      "heaviest kernels (benchmarks/profiling.py)")
  p.add_argument("--ab-layer-chunk", action="store_true",
                 help="make --ab compare the first --remat preset with "
                      "layer_chunk_size=--layer-chunk-size (A) against "
                      "layer_chunk_size=None (B; the layer with "
                      "--mlp-chunk-size) instead of none against "
                      "save_context")
  p.add_argument("--breakdown", action="store_true",
                 help="record, per run, where XLA's planned bytes go: the "
                      "compiled buffer assignment's allocations, the "
                      "values live at its peak and the largest temp "
                      "values, by category (benchmarks/buffer_breakdown)")
  p.add_argument("--target", default=None, choices=deviceless.targets(),
                 help="compile for this GPU (benchmarks/gpu_targets) on a "
                      "machine without one, with --compile-only and "
                      "--backend cudnn or standin: XLA's GPU plan, nothing "
                      "run (needs JAX's CUDA plugin, not a GPU)")
  p.add_argument("--memory-limit", type=float, default=None,
                 help="GB: treat a step whose planned bytes (compiled "
                      "temp + arguments + outputs not aliased to them + the "
                      "cuDNN scratch) exceed this as failing (the search on "
                      "a machine that does not run out)")
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="per device, for the MFU (default: 989 on GPU)")
  p.add_argument("--mlp-chunk-size", default="auto",
                 help="TransformerLayer.mlp_chunk_size: auto (default, as "
                      "the layer's), none or an int (tokens per MLP chunk "
                      "of a rank)")
  p.add_argument("--layer-chunk-size", default="none",
                 help="TransformerLayer.layer_chunk_size: none (default, as "
                      "the layer's) or an int (tokens per chunk of the "
                      "whole layer; cp 1 only)")
  p.add_argument("--no-check-exact", dest="check_exact",
                 action="store_false",
                 help="skip the exactness check of the step's attention "
                      "call (a T then counts as training without it)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(_HERE, "results"),
                 help="folder of the JSON files")
  p.add_argument("--markdown", default=DEFAULT_MARKDOWN,
                 help="the report rebuilt from every memory_*.json in --out "
                      "('' : none)")
  p.add_argument("--tag", default="", help="appended to the JSON name")
  return p


def _model_config(args, seq_len: int, cp: int, remat: str):
  from examples.packed_lm.config import Config  # pylint: disable=import-outside-toplevel
  sizes = dict(MODELS[args.model])
  for k in sizes:
    if getattr(args, k) is not None:
      sizes[k] = getattr(args, k)
  return Config(device=args.device, dtype=args.dtype, seq_len=seq_len,
                batch=1, dp=1, cp=cp, remat=remat, strategy=args.strategy,
                backend=args.backend, max_doc_len=args.max_doc_len,
                doc_order="packed", seed=args.seed,
                mlp_chunk_size=args.mlp_chunk_size,
                layer_chunk_size=getattr(args, "layer_chunk_size", None),
                **sizes)


@dataclasses.dataclass
class Step:
  """A compiled training step, its state and batch."""

  fn: object
  state: object
  batch: object
  compiled: object
  rows: object
  matmul_params: int
  cfg: object
  compile_s: float
  breakdown: dict | None = None

  def __call__(self, state, batch):
    return self.fn(state, batch)


def build_step(args, seq_len: int, cp: int, remat: str) -> Step:
  """The example's model and training step over one packed row, compiled
  (the state is donated: call it as ``state, loss = step(state, batch)``).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from examples.packed_lm import data, main, train  # pylint: disable=import-outside-toplevel
  from examples.packed_lm import model as lm  # pylint: disable=import-outside-toplevel
  cfg = _model_config(args, seq_len, cp, remat)
  # The example's row (one, packed), mesh (data=1 x cp) and batch.
  rows = data.load_rows(cfg, 1, cp)
  mesh = main.make_mesh(1, cp, args.device)
  layout = lm.make_layout(cfg, mesh, max_seqlen=rows.max_seqlen)
  batch = data.place_batch(rows, layout)
  target = getattr(args, "target", None)
  if target:
    # The same step for a GPU that is not here: the batch, built on the
    # host's mesh, and the state as abstract values on compile-only
    # devices of the target.
    devices = deviceless.compile_only_devices(target, cp)
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(1, cp), (lm.DATA, lm.CP),
        axis_types=(jax.sharding.AxisType.Auto,) * 2)
    batch = deviceless.abstract(batch, mesh)
    layout = lm.make_layout(cfg, mesh, max_seqlen=rows.max_seqlen)
  with jax.set_mesh(mesh):
    tx = train.make_optimizer(cfg)
    graphdef, state, shardings = train.init_state(
        cfg, layout, tx, mesh, abstract=bool(target))
    model = nnx.merge(graphdef, state)[0]
    fn = train.make_train_step(graphdef, shardings, mesh, cfg.param_sharding)
    n_params = lm.matmul_params(model)
    del model
    t0 = time.perf_counter()
    breakdown = None
    if getattr(args, "breakdown", False):
      from benchmarks import buffer_breakdown  # pylint: disable=import-outside-toplevel
      compiled, breakdown = buffer_breakdown.compile_with_breakdown(
          fn.lower(state, batch))
    else:
      compiled = fn.lower(state, batch).compile()
  return Step(compiled, state, batch, compiled, rows, n_params, cfg,
              time.perf_counter() - t0, breakdown)


def memory_analysis(compiled) -> dict:
  """XLA's compiled sizes (bytes); empty where the backend has none."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if ma is None:
    return {}
  keys = ("temp_size_in_bytes", "argument_size_in_bytes",
          "output_size_in_bytes", "alias_size_in_bytes",
          "generated_code_size_in_bytes", "host_temp_size_in_bytes")
  return {k.replace("_size_in_bytes", "_bytes"): int(getattr(ma, k, 0) or 0)
          for k in keys}


def device_memory() -> dict:
  """``peak_bytes_in_use`` and ``bytes_limit`` of device 0, if reported."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  return {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_limit",
                                     "bytes_in_use") if k in stats}


def matmul_flops(compiled) -> dict:
  """``dot_flops``: the matmul FLOPs the compiled step runs, recompute
  included (:mod:`benchmarks.hlo_flops`; the cuDNN attention calls count
  nothing), with ``dot_flops_unknown_loops``; ``dot_flops_error`` instead
  where the compiled text cannot be read or counted (a measurement on the
  device goes on without the count)."""
  try:
    count = hlo_flops.dot_flops(compiled.as_text())
  except Exception as err:  # pylint: disable=broad-except
    return {"dot_flops_error": f"{type(err).__name__}: {err}"[:300]}
  return {"dot_flops": count.flops,
          "dot_flops_unknown_loops": count.loops_without_trip_count}


def is_out_of_memory(err: BaseException) -> bool:
  """An allocation failure (XLA's, or the cuDNN workspace's)."""
  text = f"{type(err).__name__}: {err}"
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory",
                                 "out of memory", "OOM", "workspace "
                                 "allocation", "Resource exhausted"))


def layer_chunks(cfg, max_seqlen: int):
  """The :class:`jax_cp.modules.row_chunks.Plan` of the model's layers
  (``cfg.layer_chunk_size``; None: whole rows)."""
  from jax_cp import CPLayout  # pylint: disable=import-outside-toplevel
  from jax_cp.modules import row_chunks  # pylint: disable=import-outside-toplevel
  return row_chunks.plan(cfg.layer_chunk_size,
                         CPLayout(cp_axis=None, max_seqlen=max_seqlen),
                         cfg.seq_len, -1)


def attention_calls(cfg, cp: int, max_seqlen: int) -> tuple[int, int]:
  """The (query, key) tokens of the step's main attention call: a rank's
  tokens, or with layer chunks a full chunk's (its chunk call: the halo
  call that follows it is smaller, :mod:`jax_cp.modules.window_attention`).
  """
  chunks = layer_chunks(cfg, max_seqlen)
  if chunks is None:
    return cfg.seq_len // cp, cfg.seq_len // cp
  return chunks.chunk, chunks.chunk


def attention_scratch(cfg, cp: int, max_seqlen: int) -> tuple[int, int]:
  """The cuDNN backward workspace of the main call (:func:`attention_calls`)
  at a time, and the sub-calls over head groups it runs as
  (:func:`jax_cp.attention.cudnn_workspace.backward_head_groups`)."""
  from jax_cp.attention import cudnn_workspace as ws  # pylint: disable=import-outside-toplevel
  tq, tkv = attention_calls(cfg, cp, max_seqlen)
  hd = cfg.d_model // cfg.heads
  groups = ws.backward_head_groups(tq, tkv, cfg.heads, cfg.kv_heads, hd)
  return ws.backward_workspace_bytes(tq, tkv, cfg.heads // groups,
                                     cfg.kv_heads // groups, hd), groups


def _resolved_backend(args) -> str:
  from jax_cp.attention.registry import resolve_backend  # pylint: disable=import-outside-toplevel
  try:
    return resolve_backend(args.backend, args.device).name
  except Exception:  # pylint: disable=broad-except
    return args.backend


def _peak_tflops(args) -> float | None:
  """``--peak-tflops``, else the example's table for this GPU (989 on GPU
  without it), else None (no MFU)."""
  import jax  # pylint: disable=import-outside-toplevel
  if args.peak_tflops is not None:
    return args.peak_tflops
  if args.device != "gpu":
    return None
  from examples.packed_lm import train  # pylint: disable=import-outside-toplevel
  return train.peak_tflops(jax.devices()[0]) or 989.0


def step_mfu(args, step: Step, ms: float) -> tuple[int, float | None]:
  """The step's model FLOPs (``jax_cp.flops.model_flops`` of its row) and
  its MFU at ``ms`` per step (None without a peak, :func:`_peak_tflops`)."""
  import jax_cp.flops  # pylint: disable=import-outside-toplevel
  cfg = step.cfg
  flops = jax_cp.flops.model_flops(
      step.rows.cu_seqlens, tokens=cfg.seq_len,
      matmul_params=step.matmul_params, num_layers=cfg.layers,
      num_heads=cfg.heads, head_dim=cfg.d_model // cfg.heads)
  peak = _peak_tflops(args)
  return flops, (flops / (ms / 1e3) / (peak * 1e12 * cfg.cp)
                 if peak else None)


def measure(args, seq_len: int, cp: int, remat: str, *, timed: bool = True
            ) -> dict:
  """One run: compile, memory analysis, ``warmup + steps`` steps. A failure
  (out of memory, or over ``--memory-limit``) gives ``status`` "oom" (or
  "error") and its message instead of timings."""
  import jax  # pylint: disable=import-outside-toplevel

  rec = dict(model=model_name(args), seq_len=seq_len, cp=cp, remat=remat,
             strategy=args.strategy, backend=_resolved_backend(args))
  step = rows = None
  try:
    step = build_step(args, seq_len, cp, remat)
    cfg, rows = step.cfg, step.rows
    scratch, groups = attention_scratch(cfg, cp, int(rows.max_seqlen))
    rec.update(layers=cfg.layers, d_model=cfg.d_model, heads=cfg.heads,
               kv_heads=cfg.kv_heads, dtype=cfg.dtype,
               max_seqlen=int(step.rows.max_seqlen),
               attention_scratch_bytes=scratch,
               attention_scratch_groups=groups,
               compile_s=step.compile_s,
               **memory_analysis(step.compiled),
               **matmul_flops(step.compiled))
    if step.breakdown is not None:
      rec["breakdown"] = step.breakdown
    planned = planned_bytes(rec) or 0
    if args.memory_limit is not None and planned > args.memory_limit * 1e9:
      raise MemoryError(f"RESOURCE_EXHAUSTED (--memory-limit): {planned} "
                        f"bytes planned > {args.memory_limit} GB")
    if args.compile_only:
      rec.update(status="compiled")
      return rec
    state, losses = step.state, []
    n = (args.warmup + args.steps) if timed else 1
    t0 = None
    for i in range(n):
      if timed and i == args.warmup:
        jax.block_until_ready(state)
        t0 = time.perf_counter()
      state, loss = step(state, step.batch)
      losses.append(loss)
    jax.block_until_ready(losses)
    elapsed = time.perf_counter() - t0 if t0 is not None else None
    last = float(losses[-1])
    rec.update(status="ok" if last == last else "nan", loss=last,
               **device_memory())
    if elapsed is not None and args.steps:
      ms = elapsed / args.steps * 1e3
      flops, mfu = step_mfu(args, step, ms)
      rec.update(ms_per_step=ms, tok_per_s=seq_len / (ms / 1e3),
                 model_flops=flops, mfu=mfu)
  except Exception as err:  # pylint: disable=broad-except
    # Recorded, not raised: one preset that does not run (e.g. host
    # offload where XLA lacks it) leaves the others measured.
    oom = is_out_of_memory(err) or isinstance(err, MemoryError)
    rec.update(status="oom" if oom else "error",
               error=f"{type(err).__name__}: {err}"[:1200],
               **device_memory())
  finally:
    del step
    gc.collect()
    if rec.get("status") == "ok" and args.check_exact:
      check_exact(rec, rows, cfg, cp)
    if rec.get("temp_bytes") and rec.get("layers"):
      rec["temp_bytes_per_token_per_layer"] = (
          rec["temp_bytes"] / (seq_len // cp) / rec["layers"])
  return rec


#: The relative error bound of every output of the exactness check
#: (bfloat16 rounding alone gives 2e-3 to 4e-3).
EXACT_TOL = 5e-3


def _layer_chunk_calls(cu, cuP, chunks, bound: int) -> list:
  """The attention calls of the last full layer chunk of a row
  (:func:`jax_cp.modules.window_attention.plan_calls`), as ``(segments,
  query tokens, key tokens, mask)``, each without its empty segments; the
  halo call only when a document straddles the chunk's start."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jax_cp.attention.backend import Segments  # pylint: disable=import-outside-toplevel
  from jax_cp.modules import row_chunks, window_attention  # pylint: disable=import-outside-toplevel
  c = chunks.chunk
  q_start = (int(cuP[-1]) // c - 1) * c
  halo = q_start - max(q_start - chunks.halo, 0)
  parts = row_chunks.chunk_segments(cu, cuP, q_start, q_start - halo, c)
  calls = window_attention.plan_calls([jnp.asarray(a)[None] for a in parts],
                                      c, halo, min(bound, c), True)
  out = []
  for seg, tq, tkv, mask in ((calls.chunk, c, c, "causal_top_left"),
                             (calls.halo, calls.rows, halo, "no_mask")):
    if seg is None:
      continue
    keep = np.asarray(seg.q_lens) > 0
    if keep.any():
      arrays = (jnp.asarray(np.asarray(a)[keep]) for a in
                (seg.q_lens, seg.kv_lens, seg.q_offsets, seg.kv_offsets))
      out.append((Segments(*arrays, seg.max_seqlen_q, seg.max_seqlen_kv,
                           rows_see_keys=True), tq, tkv, mask))
  return out


def check_exact(rec: dict, rows, cfg, cp: int) -> None:
  """Checks the step's attention calls at this T, after the step has
  freed its memory: out, lse, dq, dk, dv of each call over the row's
  documents with the model's heads, in the step's dtype, against the
  exact subset reference (:func:`jax_cp.attention.exactness.check_call`).
  Records ``exact`` (each output's largest error over the calls, and
  ``exact_calls``, each call's) and turns a failing check into status
  ``"inexact"``: a T trains only with exact gradients. At cp > 1 the
  check runs the cp=1 call of the whole row, whose K/V are a rank's too
  (every rank's call is smaller in Q). With layer chunks
  (``--layer-chunk-size``) it runs the last full chunk's calls, as the
  layer cuts the row's documents (:func:`_layer_chunk_calls`): the
  top-left chunk call and the halo call."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jax_cp.attention import exactness  # pylint: disable=import-outside-toplevel
  from jax_cp.attention.backend import Segments  # pylint: disable=import-outside-toplevel
  from jax_cp.attention.registry import resolve_backend  # pylint: disable=import-outside-toplevel
  del cp
  cu = np.asarray(rows.cu_seqlens)[0]
  cuP = np.asarray(rows.cu_seqlens_padded)[0]
  lens = np.diff(cu).astype(np.int32)
  t, d = int(cuP[-1]), cfg.d_model // cfg.heads
  dtype = jnp.dtype(cfg.dtype)
  backend = resolve_backend(rec["backend"], dtype=dtype)
  chunks = layer_chunks(cfg, int(rows.max_seqlen))
  if chunks is None:
    keep = lens > 0
    seg = Segments(jnp.asarray(lens[keep]), jnp.asarray(lens[keep]),
                   jnp.asarray(cuP[:-1][keep]), jnp.asarray(cuP[:-1][keep]),
                   int(lens.max()), int(lens.max()), rows_see_keys=True)
    calls = {"row": (seg, t, t, "causal_top_left")}
  else:
    calls = dict(zip(("chunk", "halo"), _layer_chunk_calls(
        cu, cuP, chunks, int(rows.max_seqlen))))
  errs = {}
  for name, (seg, tq, tkv, mask) in calls.items():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (tq, cfg.heads, d), dtype)
    k = jax.random.normal(keys[1], (tkv, cfg.kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (tkv, cfg.kv_heads, d), dtype)
    try:
      errs[name] = exactness.check_call(backend, q, k, v, seg, mask=mask,
                                        rows=128)
    except Exception as err:  # pylint: disable=broad-except
      rec.update(status="inexact", exact=None,
                 exact_error=f"{name} call: {type(err).__name__}: {err}"[:600])
      return
    finally:
      del q, k, v
      gc.collect()
  rec["exact"] = {out: max(e[out] for e in errs.values())
                  for out in next(iter(errs.values()))}
  if len(errs) > 1:
    rec["exact_calls"] = errs
  if not max(rec["exact"].values()) <= EXACT_TOL:
    rec["status"] = "inexact"


def _print(rec: dict) -> None:
  gb = lambda k: (f"{rec[k] / 1e9:7.2f}" if rec.get(k) is not None
                  else "      -")
  line = (f"{rec['model']:>7} T={fmt_tokens(rec['seq_len']):>6} "
          f"cp={rec['cp']} {rec['remat']:>20} {rec.get('status', '?'):>4} "
          f"temp {gb('temp_bytes')} GB args {gb('argument_bytes')} GB "
          f"peak {gb('peak_bytes_in_use')} GB scratch "
          f"{gb('attention_scratch_bytes')} GB")
  if rec.get("dot_flops") is not None:
    line += f" matmul {rec['dot_flops'] / 1e12:.1f} TFLOP"
  if rec.get("ms_per_step") is not None:
    mfu = rec.get("mfu")
    line += (f"  {rec['ms_per_step']:9.1f} ms {rec['tok_per_s']:10.0f} tok/s"
             + (f" MFU {mfu:.1%}" if mfu is not None else ""))
  if rec.get("exact"):
    line += "  exact: max rel. err. " + f"{max(rec['exact'].values()):.1e}"
  print(line, flush=True)
  if rec.get("status") == "error":
    print(f"  error: {rec['error']}", flush=True)
  if rec.get("status") == "inexact":
    print(f"  inexact: {rec.get('exact') or rec.get('exact_error')}",
          flush=True)


def planned_bytes(rec: dict) -> int | None:
  """What a run needs on the device: XLA's temp, arguments and outputs
  (less the donated ones, which reuse the arguments) plus the cuDNN
  backward scratch; None without a memory analysis."""
  if not rec.get("temp_bytes"):
    return None
  return (rec["temp_bytes"] + rec.get("argument_bytes", 0)
          + rec.get("output_bytes", 0) - rec.get("alias_bytes", 0)
          + rec.get("attention_scratch_bytes", 0))


def predict_longest(points: list[tuple[int, int]], fixed: int,
                    limit: float) -> int | None:
  """The T at which ``fixed + slope * T (+ intercept)`` reaches
  ``limit``: a line through the ``(T, planned bytes)`` points (through
  ``(0, fixed)`` with one point); None without points or growth."""
  pts = sorted(set(points))
  if not pts:
    return None
  if len(pts) == 1:
    (t0, b0), = pts
    slope, base = (b0 - fixed) / t0, fixed
  else:
    (t0, b0), (t1, b1) = pts[0], pts[-1]
    slope = (b1 - b0) / (t1 - t0)
    base = b0 - slope * t0
  if slope <= 0:
    return None
  return int((limit - base) / slope)


def longest_trainable(args, cp: int, remat: str, listed: list[dict],
                      budget_s: float | None = None
                      ) -> tuple[dict, list[dict]]:
  """The longest T that trains, to ``--search-step``, and the records of
  the steps it tried (each as :func:`measure` returns it: memory, the
  breakdown with ``--breakdown``, the exactness check). T doubles from the
  start until a step fails, then the bracket is bisected. Where the device
  reports its memory limit, the runs so far predict where the limit is
  (:func:`predict_longest`) and the search tries 3 % below and above that
  first, so that the bracket is narrow from the start. ``budget_s``:
  seconds after which no new T is tried (the bracket so far is returned).
  """
  step = args.search_step
  started = time.monotonic()
  mine = [r for r in listed if r.get("kind") == "run" and r["cp"] == cp
          and r["remat"] == remat]
  known = {r["seq_len"]: r["status"] == "ok" for r in mine}
  points = [(r["seq_len"], planned_bytes(r)) for r in mine
            if r["status"] == "ok" and planned_bytes(r)]
  tries: list[dict] = []
  stopped = False

  def trains(n: int) -> bool | None:
    """Whether a step at ``n`` runs; None when out of time."""
    nonlocal stopped
    if n in known:
      return known[n]
    # No try that would end past the budget (a try takes about as long as
    # the one before).
    last = tries[-1]["try_s"] if tries else 0.0
    if budget_s is not None and (time.monotonic() - started + last
                                 > budget_s):
      stopped = True
      return None
    t0 = time.monotonic()
    rec = measure(args, n, cp, remat, timed=False)
    rec["try_s"] = time.monotonic() - t0
    tries.append(rec)
    if rec["status"] == "error":    # not memory: no T will do
      stopped = True
      return None
    known[n] = rec["status"] == "ok"
    if known[n] and planned_bytes(rec):
      points.append((n, planned_bytes(rec)))
    _print(rec)
    return known[n]

  def guesses(lo: int) -> list[int]:
    """3 % below and above the predicted limit, past ``lo``."""
    limit = (args.memory_limit * 1e9 if args.memory_limit is not None
             else device_memory().get("bytes_limit"))
    fixed = min((r.get("argument_bytes", 0) for r in mine + tries
                 if r.get("argument_bytes")), default=0)
    t = predict_longest(points, fixed, limit) if limit else None
    if t is None:
      return []
    out = [int(0.97 * t) // step * step, -(-int(1.03 * t) // step) * step]
    return [g for g in out if g > lo and g <= args.search_max]

  lo, hi = 0, None
  first = search_start(args, remat) or max(
      [t for t, ok in known.items() if ok], default=step)
  queue = [max(step, first // step * step)]
  while queue and hi is None:
    t = queue.pop(0)
    ok = trains(t)
    if ok is None:
      break
    if not ok:
      hi = t
    else:
      lo = max(lo, t)
      queue = guesses(lo) if not queue else queue
      if not queue and 2 * lo <= args.search_max:
        queue = [2 * lo]
  while hi is not None and hi - lo > step and not stopped:
    mid = (lo + hi) // 2 // step * step
    ok = trains(mid) if mid > lo else None
    if ok is None:
      break
    lo, hi = (mid, hi) if ok else (lo, mid)
  search = dict(kind="search", model=model_name(args), cp=cp, remat=remat,
              longest_seq_len=lo or None, first_failing_seq_len=hi,
              search_step=step, search_max=args.search_max,
              stopped_early=stopped,
              error=next((r["error"] for r in tries
                          if r["status"] == "error"), None),
              tries=[dict(seq_len=r["seq_len"], status=r["status"],
                          seconds=round(r["try_s"], 1),
                          temp_bytes=r.get("temp_bytes"),
                          layers=r.get("layers")) for r in tries])
  return search, tries


def search_start(args, remat: str) -> int | None:
  """The ``--search-start`` of ``remat``: its ``PRESET=T`` entry, else a
  plain T, else None."""
  plain = None
  for entry in args.search_start:
    name, eq, value = entry.partition("=")
    if eq and name == remat:
      return parse_tokens(value)
    if not eq:
      plain = parse_tokens(entry)
  return plain


def model_name(args) -> str:
  """``--model``, marked ``*`` when a size is overridden."""
  custom = any(getattr(args, k) is not None for k in MODELS[args.model])
  return args.model + ("*" if custom else "")


def _runner(step: Step):
  """One step per call, the donated state carried along."""
  def run_one():
    step.state, loss = step(step.state, step.batch)
    return loss
  return run_one


def _rep_printer(name_a: str, name_b: str):
  """An ``on_rep`` for :func:`benchmarks.timing.paired`: one line per rep,
  so that a run cut short still shows what it measured."""
  def on_rep(i: int, sec_a: float, sec_b: float, ratio: float) -> None:
    print(f"A/B rep {i + 1}: {name_a} {sec_a * 1e3:.1f} ms, {name_b} "
          f"{sec_b * 1e3:.1f} ms (A/B {ratio:.3f}x)", flush=True)
  return on_rep


def ab_profiles(steps: Sequence[Step], names: Sequence[str],
                top: int = 12) -> dict:
  """``--ab-profile``: one traced step of each side of an A/B
  (:func:`benchmarks.profiling.profile`), as ``profile_a`` and
  ``profile_b``: device ms per kernel group, busy ms and the ``top``
  heaviest kernels; printed side by side. Empty without a GPU trace."""
  from benchmarks import profiling  # pylint: disable=import-outside-toplevel
  got = {}
  for side, step in zip("ab", steps):
    one = _runner(step)

    def run_n(n: int, one=one):
      loss = None
      for _ in range(n):
        loss = one()
      return float(loss)

    prof = profiling.profile(run_n, 1)
    if prof is None:
      return {}
    got[f"profile_{side}"] = dict(
        groups_ms=prof["groups_ms"], busy_ms=prof["busy_ms"],
        idle_ms=prof["idle"]["idle_ms"], kernels=prof["kernels"][:top])
  a, b = got["profile_a"], got["profile_b"]
  print(f"A/B profile, device ms per step: {names[0]} | {names[1]}",
        flush=True)
  for g in sorted(set(a["groups_ms"]) | set(b["groups_ms"])):
    print(f"  {g:24s} {a['groups_ms'].get(g, 0.0):10.1f} "
          f"{b['groups_ms'].get(g, 0.0):10.1f}", flush=True)
  print(f"  {'busy':24s} {a['busy_ms']:10.1f} {b['busy_ms']:10.1f}",
        flush=True)
  for side, name in zip((a, b), names):
    print(f"  heaviest kernels of {name}:", flush=True)
    for k in side["kernels"]:
      print(f"    {k['ms']:9.1f} ms {k['launches']:7.0f}x  "
            f"{k['name'][:110]}", flush=True)
  return got


def paired_ab(args, seq_len: int, cp: int) -> dict:
  """``none`` (A) against ``save_context`` (B) at ``seq_len``, timed in
  alternation (``benchmarks.timing.paired``): ratio = time(A) / time(B).
  With ``--ab-mlp-chunk`` or ``--ab-layer-chunk``: :func:`paired_ab_chunks`."""
  if getattr(args, "ab_mlp_chunk", False):
    return paired_ab_chunks(args, seq_len, cp, "mlp_chunk_size")
  if getattr(args, "ab_layer_chunk", False):
    return paired_ab_chunks(args, seq_len, cp, "layer_chunk_size")
  from benchmarks import timing  # pylint: disable=import-outside-toplevel
  steps = [build_step(args, seq_len, cp, p) for p in ("none",
                                                       "save_context")]
  a, b = (_runner(s) for s in steps)
  r = timing.paired(a, [()], b, [()], reps=args.ab_reps, warmup=1,
                    on_rep=_rep_printer("none", "save_context"))
  profiles = (ab_profiles(steps, ("none", "save_context"))
              if getattr(args, "ab_profile", False) else {})
  del steps, a, b
  gc.collect()
  return dict(kind="ab", **profiles, model=model_name(args), seq_len=seq_len,
              cp=cp,
              a="none", b="save_context", ms_a=r.ms_a, ms_b=r.ms_b,
              save_context_over_none=1.0 / r.ratio_median,
              ratio_q1=1.0 / r.ratio_q3, ratio_q3=1.0 / r.ratio_q1)


def paired_ab_chunks(args, seq_len: int, cp: int, field: str) -> dict:
  """The first ``--remat`` preset with ``field`` (``mlp_chunk_size`` or
  ``layer_chunk_size``) as the arguments set it (A, chunked) against
  ``field=None`` (B, unchunked) at ``seq_len``, timed in alternation
  (``benchmarks.timing.paired``): ``chunked_over_unchunked`` = time(A) /
  time(B), median and quartiles over the reps; the MFU of each from its
  median ms (:func:`step_mfu`: the same model FLOPs for both)."""
  from benchmarks import timing  # pylint: disable=import-outside-toplevel
  remat = args.remat[0]
  chunk = str(getattr(args, field))
  steps = [build_step(argparse.Namespace(**{**vars(args), field: c}),
                      seq_len, cp, remat) for c in (chunk, None)]
  r = timing.paired(_runner(steps[0]), [()], _runner(steps[1]), [()],
                    reps=args.ab_reps, warmup=1,
                    on_rep=_rep_printer(f"{field}={chunk}", f"{field}=None"))
  mfu_a, mfu_b = (step_mfu(args, s, ms)[1] if s.rows is not None else None
                  for s, ms in zip(steps, (r.ms_a, r.ms_b)))
  profiles = (ab_profiles(steps, (f"{field}={chunk}", f"{field}=None"))
              if getattr(args, "ab_profile", False) else {})
  del steps
  gc.collect()
  return dict(kind="ab", comparison=field.removesuffix("_size"),
              **profiles,
              model=model_name(args), seq_len=seq_len, cp=cp, remat=remat,
              a=f"{field}={chunk}", b=f"{field}=None",
              mlp_chunk_size=str(args.mlp_chunk_size),
              layer_chunk_size=str(getattr(args, "layer_chunk_size", None)),
              ms_a=r.ms_a, ms_b=r.ms_b, mfu_a=mfu_a, mfu_b=mfu_b,
              chunked_over_unchunked=r.ratio_median,
              ratio_q1=r.ratio_q1, ratio_q3=r.ratio_q3)


def preallocates() -> bool:
  """Whether JAX's GPU allocator takes its whole pool up front (its
  default; ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` turns it off)."""
  return os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() \
      not in ("false", "0")


def run(args, save: Callable[[dict], object] | None = None) -> dict:
  """Every run of the arguments; the result dict (also printed).

  ``save``, when given, is called with the result dict after every record,
  so that a run stopped part-way (a time limit, a crash at a larger T)
  leaves what it measured before."""
  presets = list(dict.fromkeys(args.remat))
  records: list[dict] = []
  result = {"env": _environment(args), "records": records}

  def keep(*recs: dict) -> None:
    records.extend(recs)
    if save is not None:
      save(result)

  # The A/B first: the searches then share the time that is left.
  if args.ab is not None:
    try:
      ab = paired_ab(args, args.ab, min(args.cp))
    except Exception as err:  # pylint: disable=broad-except
      print(f"A/B at T={fmt_tokens(args.ab)} failed: {err}"[:1200],
            flush=True)
    else:
      keep(ab)
      if ab.get("comparison"):
        print(f"A/B at T={fmt_tokens(args.ab)} ({ab['remat']}): "
              f"{ab['a']} {ab['ms_a']:.1f} ms, {ab['b']} {ab['ms_b']:.1f} "
              f"ms (chunked / unchunked {ab['chunked_over_unchunked']:.3f}"
              f"x)", flush=True)
      else:
        print(f"A/B at T={fmt_tokens(args.ab)}: none {ab['ms_a']:.1f} ms, "
              f"save_context {ab['ms_b']:.1f} ms "
              f"({ab['save_context_over_none']:.3f}x)", flush=True)
  groups = [(remat, cp) for remat in presets for cp in args.cp]
  if args.search and not preallocates():
    print("warning: XLA_PYTHON_CLIENT_PREALLOCATE=false: the allocator "
          "grows by regions it never returns, so after a large try a later "
          "T can fail for want of one contiguous region that one "
          "preallocated pool would have had: the longest T found is a "
          "lower bound", flush=True)
  for remat, cp in groups:
    for t in sorted(set(args.seq_lens)):
      rec = measure(args, t, cp, remat)
      keep(dict(kind="run", **rec))
      _print(rec)
  for i, (remat, cp) in enumerate(groups if args.search else []):
    budget = None
    if args.time_budget is not None:
      budget = max(0.0, args.time_budget - (
          time.monotonic() - args.started)) / (len(groups) - i)
    s, tried = longest_trainable(args, cp, remat, records, budget)
    keep(*(dict(kind="run", **rec) for rec in tried), s)
    print(f"longest T that trains ({model_name(args)}, cp={cp}, {remat}): "
          f"{fmt_tokens(s['longest_seq_len'] or 0)} (first failing: "
          f"{s['first_failing_seq_len']})", flush=True)
  return result


def _environment(args) -> dict:
  """The result's ``env`` block: this process, the arguments, and for
  ``--target`` the GPU the plan is for."""
  from benchmarks import results  # pylint: disable=import-outside-toplevel
  target = {}
  if args.target is not None:
    # Named for the GPU the plan is for, marked as compiled without it.
    target = dict(target=args.target, platform="cuda (compile-only)",
                  device_kind=deviceless.device_kind(args.target)
                  + " (plan)", device_count=min(args.cp))
  return results.environment(
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
      preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
      args=vars(args), **target)


# ------------------------------------------------------------- the report

def _load_results(folder: str) -> list[dict]:
  from benchmarks import results  # pylint: disable=import-outside-toplevel
  return [results.read_result(path) for path in
          sorted(glob.glob(os.path.join(folder, "memory_*.json")))]


def plot(results: list[dict], path: str) -> str | None:
  """Temp bytes per local token per layer against T, a line per (model,
  layers, preset, cp), from the steps that ran or failed (not the
  ``--compile-only`` ones); None without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  lines: dict[tuple, dict[int, float]] = {}
  for x in _compiled_points(results):
    if x.get("status") == "compiled":     # the per-layer slope's points
      continue
    key = (x["model"], x["layers"], x["remat"], x["cp"])
    lines.setdefault(key, {})[x["seq_len"]] = (
        x["temp_bytes"] / (x["seq_len"] // x["cp"]) / x["layers"])
  if not lines:
    return None
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (model, layers, remat, cp), pts in sorted(lines.items()):
    pts = sorted(pts.items())
    ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o",
            label=f"{model} ({layers} layers) {remat} cp={cp}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("tokens per row T")
  ax.set_ylabel("XLA temp KB per local token per layer")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _table(title: str | None, header: Sequence[str],
           rows: Sequence[Sequence[object]]) -> list[str]:
  """A markdown table (under a ``##`` title when given)."""
  out = [f"## {title}", ""] if title else []
  out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return out + [""]


def markdown(results: list[dict], plot_name: str | None) -> str:
  """MEMORY.md: the runs, the longest T per preset, the A/B."""
  gb = lambda v: "-" if v is None else f"{v / 1e9:.2f}"
  lines = ["# Memory of a training step against the row length", "",
           "Written by `benchmarks/bench_memory.py` from the "
           "`memory_*.json` files beside this report. One packed row per "
           "step (the standard library's files as documents), AdamW. "
           "*temp*, *args*: XLA's compiled memory analysis; *peak*: the "
           "device's `peak_bytes_in_use` (the process's running maximum); "
           "*scratch*: the cuDNN backward workspace of the main attention "
           "call (`jax_cp.attention.cudnn_workspace`; one sub-call's where "
           "the backward is split over head groups), allocated at run "
           "time on top of XLA's buffers; *host temp*: XLA's temporaries "
           "in pinned host memory (host offload); *B/tok/layer*: temp per "
           "local token per layer. Status *compiled*: memory analysis "
           "only (`--compile-only`), no step run; a device named *(plan)*: "
           "compiled for that GPU on a machine without one (`--target`; "
           "the backend in the footer). "
           "*exact*: the largest "
           "relative error of out, lse, dq, dk, dv of the step's attention "
           "call at that T against the exact subset reference "
           "(`jax_cp.attention.exactness`); status *inexact* when above "
           f"{EXACT_TOL:g}: such a T does not train. Runs before the check "
           "existed say *not checked*. *MLP chunk*: `--mlp-chunk-size` "
           "(`TransformerLayer.mlp_chunk_size`); *(scan)*: runs before "
           "the chunks worked in place, whose chunking cost memory; "
           "*layer N*: `--layer-chunk-size N` "
           "(`TransformerLayer.layer_chunk_size`: the whole layer in "
           "chunks of N tokens, which replace the MLP's).", ""]
  # Each record with its file's MLP chunking (``--mlp-chunk-size``; none
  # in files from before the option).
  of = lambda kind: [(d["env"].get("device_kind"),
                      dict(r, mlp_chunk=_mlp_chunk(d["env"])))
                     for d in results for r in d["records"]
                     if r.get("kind") == kind]
  runs = sorted(of("run"), key=lambda x: (
      x[1]["model"], x[1]["remat"], x[1]["cp"], x[1]["seq_len"],
      x[1].get("layers", 0)))
  if runs:
    per = lambda r: r.get("temp_bytes_per_token_per_layer")
    lines += _table(None, (
        "device", "model", "layers", "T", "cp", "remat", "MLP chunk",
        "status", "temp GB",
        "args GB", "host temp GB", "peak GB", "scratch GB", "B/tok/layer",
        "ms/step",
        "tok/s", "MFU", "exact (max rel. err.)"), [
            (dev, r["model"], r.get("layers", "-"), fmt_tokens(r["seq_len"]),
             r["cp"],
             r["remat"], r["mlp_chunk"], r.get("status"),
             gb(r.get("temp_bytes")),
             gb(r.get("argument_bytes")), gb(r.get("host_temp_bytes")),
             gb(r.get("peak_bytes_in_use")),
             gb(r.get("attention_scratch_bytes")),
             f"{per(r):.0f}" if per(r) else "-",
             f"{r['ms_per_step']:.1f}" if r.get("ms_per_step") else "-",
             f"{r['tok_per_s']:.0f}" if r.get("tok_per_s") else "-",
             f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
             f"{max(r['exact'].values()):.1e}" if r.get("exact")
             else "not checked")
            for dev, r in runs])

  def tries(r):
    text = ", ".join(f"{fmt_tokens(t['seq_len'])} {t['status']}"
                     for t in r["tries"])
    if r.get("error"):
      return text + f"; error: {r['error'][:160]}"
    return text + ("; stopped by the time budget"
                   if r.get("stopped_early") else "")

  searches = [(d["env"].get("device_kind"), r,
               d["env"].get("args", {}).get("check_exact", False),
               _mlp_chunk(d["env"]))
              for d in results for r in d["records"]
              if r.get("kind") == "search"]
  if searches:
    lines += _table("Longest T that trains", (
        "device", "model", "cp", "remat", "MLP chunk", "gradients",
        "longest T", "first failing T", "tries"), [
            (dev, r["model"], r["cp"], r["remat"], chunk,
             "checked exact" if checked else "not checked",
             fmt_tokens(r["longest_seq_len"]) if r.get("longest_seq_len")
             else "below the first try",
             fmt_tokens(r["first_failing_seq_len"])
             if r.get("first_failing_seq_len")
             else ("not reached" if r.get("stopped_early")
                   else f"none up to {fmt_tokens(r['search_max'])}"),
             tries(r))
            for dev, r, checked, chunk in searches])
  remat_ab = [(d, r) for d, r in of("ab") if not r.get("comparison")]
  chunk_ab = [(d, r) for d, r in of("ab")
              if r.get("comparison") == "mlp_chunk"]
  layer_ab = [(d, r) for d, r in of("ab")
              if r.get("comparison") == "layer_chunk"]
  if remat_ab:
    lines += _table("save_context against none (paired A/B)", (
        "device", "model", "T", "cp", "none ms", "save_context ms",
        "save_context / none (IQR)"), [
            (dev, r["model"], fmt_tokens(r["seq_len"]), r["cp"],
             f"{r['ms_a']:.1f}", f"{r['ms_b']:.1f}",
             f"{r['save_context_over_none']:.3f} ({r['ratio_q1']:.3f}-"
             f"{r['ratio_q3']:.3f})") for dev, r in remat_ab])
  if chunk_ab:
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    lines += _table("chunked MLP against unchunked (paired A/B)", (
        "device", "model", "T", "cp", "remat", "mlp_chunk_size",
        "chunked ms", "unchunked ms", "chunked MFU", "unchunked MFU",
        "chunked / unchunked (IQR)"), [
            (dev, r["model"], fmt_tokens(r["seq_len"]), r["cp"],
             r["remat"], r["mlp_chunk_size"], f"{r['ms_a']:.1f}",
             f"{r['ms_b']:.1f}", pct(r.get("mfu_a")), pct(r.get("mfu_b")),
             f"{r['chunked_over_unchunked']:.3f} ({r['ratio_q1']:.3f}-"
             f"{r['ratio_q3']:.3f})") for dev, r in chunk_ab])
  if layer_ab:
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    lines += _table("layer chunks against whole-row layers (paired A/B)", (
        "device", "model", "T", "cp", "remat", "layer_chunk_size",
        "whole-row layer's mlp_chunk_size", "chunked ms", "whole ms",
        "chunked MFU", "whole MFU", "chunked / whole (IQR)"), [
            (dev, r["model"], fmt_tokens(r["seq_len"]), r["cp"],
             r["remat"], r["layer_chunk_size"], r["mlp_chunk_size"],
             f"{r['ms_a']:.1f}", f"{r['ms_b']:.1f}", pct(r.get("mfu_a")),
             pct(r.get("mfu_b")),
             f"{r['chunked_over_unchunked']:.3f} ({r['ratio_q1']:.3f}-"
             f"{r['ratio_q3']:.3f})") for dev, r in layer_ab])
  lines += _breakdown_section(runs)
  lines += _growth_table(results)
  lines += _layer_growth_table(results)
  for d in results:
    env = d["env"]
    limits = {r["bytes_limit"] for r in d["records"] if r.get("bytes_limit")}
    lines.append(
        f"- {env.get('date')}, {env.get('device_kind')}"
        + (f" (tree {env['git_commit'][:7]}"
           + (", modified" if env.get("git_dirty") else "") + ")"
           if env.get("git_commit") else "")
        + ": "
        f"`XLA_PYTHON_CLIENT_MEM_FRACTION`="
        f"{env.get('mem_fraction') or 'unset (0.75)'}"
        + (f", `XLA_PYTHON_CLIENT_PREALLOCATE`={env['preallocate']}"
           if env.get("preallocate") else "")
        + (f", allocator limit {max(limits) / 1e9:.1f} GB" if limits else "")
        + f"; `{' '.join(_argv(env.get('args', {})))}`"
        + ("; rebuilt from the run's printed output (the file did not come "
           "back from the device): values as printed"
           if env.get("reconstructed") else ""))
  lines.append("")
  if plot_name:
    lines += [f"![bytes per token per layer]({plot_name})", ""]
  return "\n".join(lines)


#: Values per record in "Where the bytes go".
BREAKDOWN_ROWS = 10


#: Below this fraction of the temp and arguments, XLA's live-range peak is
#: reported as partial.
PARTIAL_PEAK = 0.5


def _breakdown_section(runs: list[tuple[str, dict]]) -> list[str]:
  """"Where the bytes go": per run with a ``breakdown`` (``--breakdown``),
  a table of XLA's temp allocation, the largest values live at the
  schedule's peak (else the largest temp values), the cuDNN backward
  scratch (outside XLA) and the state (XLA's arguments: parameters and
  optimizer state), then the peak's bytes per category."""
  gb = lambda v: f"{v / 1e9:.3f}"
  out = []
  for dev, r in runs:
    bd = r.get("breakdown")
    if not bd or bd.get("error"):
      continue
    if not out:
      out += ["## Where the bytes go", "",
              "Per run with `--breakdown` (`benchmarks/buffer_breakdown.py`"
              "): XLA's compiled buffer assignment. *live at peak*: the "
              "largest values live at the step of XLA's schedule where the "
              "live bytes peak (category from the value's Python call "
              "stack; *fwd*: made in the forward, so, at a peak in the "
              "backward, kept for it;"
              " *remat*: recomputed, *bwd*: the backward's); without that "
              "dump, *temp value*: the largest values placed in the temp "
              "allocation, which overlap in time (the largest, not parts "
              "that add up). The cuDNN scratch is allocated at run time "
              "outside XLA's buffers.", ""]
    peak = bd.get("peak")
    values = peak["top"] if peak else bd.get("top_temp", [])
    kind = "live at peak" if peak else "temp value"
    temp = bd.get("allocations", {}).get("temp", {}).get("bytes")
    rows = [("XLA temp (allocation)", "-", "-",
             gb(r.get("temp_bytes") or temp or 0))]
    rows += [(f"{kind}: `{v['name']}`",
              v["category"] + (f" ({v['phase']})" if v.get("phase") else ""),
              f"`{v['shape']}`", gb(v["bytes"]))
             for v in values[:BREAKDOWN_ROWS]]
    rows += [("cuDNN backward scratch (outside XLA)", "attention", "-",
              gb(r.get("attention_scratch_bytes") or 0)),
             ("state: arguments (parameters + optimizer state)", "state",
              "-", gb(r.get("argument_bytes") or 0))]
    title = (f"{dev}, {r['model']}, {r.get('layers', '-')} layers, T="
             f"{fmt_tokens(r['seq_len'])}, cp={r['cp']}, {r['remat']}")
    out += [f"### {title}", ""]
    out += _table(None, ("buffer", "category", "shape", "GB"), rows)
    if peak:
      out += ["Live at the peak (GB): " + ", ".join(
          f"{k} {gb(v)}" for k, v in peak["by_category"].items())
              + f"; total {gb(peak['bytes'])}.", ""]
      allocated = (r.get("temp_bytes") or temp or 0) + (
          r.get("argument_bytes") or 0)
      if peak["bytes"] < PARTIAL_PEAK * allocated:
        out += [f"XLA's live-range peak here ({gb(peak['bytes'])} GB with "
                f"the arguments) is below {PARTIAL_PEAK:.0%} of the temp "
                f"and arguments it allocates ({gb(allocated)} GB), so "
                "this list shows only part of what is live where the temp "
                "peaks (XLA's live ranges leave buffers out here; the "
                "while loops' carried buffers are the likely ones).", ""]
  return out


def _compiled_points(results: list[dict]) -> list[dict]:
  """Every compiled step with a memory analysis, from the listed runs and
  the search tries, with its device kind (``device``)."""
  out = []
  for d in results:
    dev, date = d["env"].get("device_kind"), d["env"].get("date", "")
    for r in d["records"]:
      found = ([r] if r.get("kind") == "run" else
               [dict(t, model=r["model"], remat=r["remat"], cp=r["cp"])
                for t in r.get("tries", [])] if r.get("kind") == "search"
               else [])
      out += [dict(x, device=dev, date=date) for x in found
              if x.get("temp_bytes") and x.get("layers")]
  return out


def _growth_table(results: list[dict]) -> list[str]:
  """Per (device, model, preset, cp): XLA temp bytes per additional local
  token per layer, the slope between the shortest and the longest T
  compiled (listed runs and search tries) by one invocation (one result
  file: one version of the code). It holds what the layers keep
  per token and, divided among them, the per-token costs outside them
  (the layer recomputed during the backward, embedding, logits); the
  fixed part (gradients, optimizer temporaries) drops out. The per-layer
  slope (:func:`_layer_growth_table`) separates the two."""
  points: dict[tuple, dict[int, tuple[int, int]]] = {}
  for x in _compiled_points(results):
    key = (x["device"], x["model"], x["remat"], x["cp"], x["date"])
    points.setdefault(key, {})[x["seq_len"] // x["cp"]] = (
        x["temp_bytes"], x["layers"])
  rows = []
  for (dev, model, remat, cp, date), pts in sorted(points.items()):
    if len(pts) < 2:
      continue
    (t0, (b0, layers)), (t1, (b1, _)) = min(pts.items()), max(pts.items())
    rows.append((dev, date[:16], model, remat, cp,
                 f"{fmt_tokens(t0 * cp)}-{fmt_tokens(t1 * cp)}",
                 f"{(b1 - b0) / (t1 - t0) / layers:.0f}"))
  if not rows:
    return []
  return _table("Growth per token", (
      "device", "run", "model", "remat", "cp", "T range",
      "temp B per local token per layer (slope)"), rows)


def _layer_growth_table(results: list[dict]) -> list[str]:
  """Per (device, sizes but the layer count, preset, cp, T): XLA temp bytes
  per local token that one more layer adds, the slope between the fewest
  and the most layers compiled at the same T (``--layers``, with
  ``--compile-only`` where running is not needed). This is what a layer
  keeps for the backward, free of the per-token costs outside the layers
  (embedding, logits, the backward's transient buffers) that the per-T
  slope divides among the layers."""
  points: dict[tuple, dict[int, int]] = {}
  for d in results:
    dev = d["env"].get("device_kind")
    for r in d["records"]:
      if r.get("kind") == "run" and r.get("temp_bytes") and r.get("layers"):
        key = (dev, r["d_model"], r["heads"], r["kv_heads"], r["remat"],
               r["cp"], r["seq_len"], r.get("dtype"))
        points.setdefault(key, {})[r["layers"]] = r["temp_bytes"]
  rows = []
  for (dev, d_model, heads, kv, remat, cp, t, dtype), pts in sorted(
      points.items(), key=lambda kv_: tuple(map(str, kv_[0]))):
    if len(pts) < 2:
      continue
    (l0, b0), (l1, b1) = min(pts.items()), max(pts.items())
    per = (b1 - b0) / (l1 - l0) / (t // cp)
    rows.append((dev, f"d_model {d_model}, {heads}/{kv} heads, {dtype}",
                 remat, cp, fmt_tokens(t), f"{l0}-{l1}", f"{per:.0f}",
                 f"{per / d_model:.2f}"))
  if not rows:
    return []
  return _table("Growth per layer", (
      "device", "sizes", "remat", "cp", "T", "layers",
      "temp B per local token per layer (slope)", "per d_model"), rows)


#: Result files dated before this chunked the MLP with a ``lax.scan`` whose
#: backward kept zero-filled buffers per layer (more temp than no chunking);
#: later ones with ``map_token_chunks``' in-place loop.
IN_PLACE_CHUNKS_SINCE = "2026-12-01T20:22"
#: Result files dated before this sized ``"auto"`` chunks as ``mlp_dim / d``
#: chunks per row; later ones as ``4 * mlp_dim / d``
#: (:func:`jax_cp.modules.common.mlp_chunk_tokens`).
AUTO_FOUR_BUFFERS_SINCE = "2026-12-02T01:55"


def _mlp_chunk(env: dict) -> str:
  """A result file's ``--mlp-chunk-size`` (``none`` where it predates the
  option; ``(scan)`` added where the chunks ran as a ``lax.scan``,
  ``(mlp_dim/d)`` where ``"auto"`` made four times fewer chunks)."""
  chunk = str(env.get("args", {}).get("mlp_chunk_size") or "none")
  date = env.get("date", "")
  if chunk != "none" and date < IN_PLACE_CHUNKS_SINCE:
    chunk += " (scan)"
  elif chunk == "auto" and date < AUTO_FOUR_BUFFERS_SINCE:
    chunk += " (mlp_dim/d)"
  layer = env.get("args", {}).get("layer_chunk_size")
  if layer not in (None, "none", "None"):
    chunk = f"layer {layer}"
  return chunk


def _argv(args: dict) -> list[str]:
  """The options of a recorded run that shape what it measured."""
  keys = ("model", "layers", "d_model", "heads", "kv_heads", "max_doc_len",
          "remat", "seq_lens", "cp", "search",
          "search_start", "ab", "ab_mlp_chunk", "ab_layer_chunk",
          "mlp_chunk_size", "layer_chunk_size",
          "time_budget", "compile_only", "breakdown", "backend", "target")
  out = []
  for k in keys:
    v = args.get(k)
    if v in (None, False, [], "") or (
        k in ("mlp_chunk_size", "layer_chunk_size") and v == "none") or (
            k == "backend" and v == "auto") or (
                k == "max_doc_len" and v == DEFAULT_MAX_DOC_LEN):
      continue
    flag = "--" + k.replace("_", "-")
    if v is True:
      out.append(flag)
    elif isinstance(v, list):
      out += [flag, *(fmt_tokens(x) if isinstance(x, int) and k != "cp"
                      else str(x) for x in v)]
    else:
      out += [flag, fmt_tokens(v) if k == "ab" else str(v)]
  return out


def write_report(out: str, path: str) -> str:
  """Rebuilds the report at ``path`` from ``out``'s JSON files."""
  results = _load_results(out)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  png = os.path.splitext(path)[0] + "_per_token.png"
  made = plot(results, png)
  with open(path, "w") as f:
    f.write(markdown(results, os.path.basename(made) if made else None))
  return path


def main(argv: Sequence[str] | None = None) -> str:
  """Runs, writes the JSON (and the report); returns the JSON's path."""
  args = build_parser().parse_args(argv)
  if not args.seq_lens and not args.search and args.ab is None:
    raise SystemExit("nothing to do: give --seq-lens, --search or --ab")
  for entry in args.search_start:
    name, eq, value = entry.partition("=")
    if eq and name not in PRESETS:
      raise SystemExit(f"--search-start {entry}: {name!r} is not a preset")
    parse_tokens(value if eq else entry)
  if args.target is not None:
    if not args.compile_only or args.backend not in ("standin", "cudnn"):
      raise SystemExit(f"--target {args.target} compiles for a GPU that is "
                       "not here: it needs --compile-only and --backend "
                       "standin or cudnn (the extension built, with its "
                       "CUDA libraries installed)")
    # The host builds the batch on its CPU devices; the GPU's dtype.
    args.device = "cpu"
    args.dtype = args.dtype or "bfloat16"
    deviceless.configure()
  if args.backend == "standin" and not (args.compile_only and
                                       args.ab is None):
    raise SystemExit("--backend standin is not attention: it plans memory "
                     "with --compile-only and runs no step (no --ab)")
  if args.dtype is None:
    args.dtype = "bfloat16" if args.device == "gpu" else "float32"
  # bench_step's platform set-up (CPU devices for the largest cp), before
  # jax is imported.
  from benchmarks import bench_step  # pylint: disable=import-outside-toplevel
  bench_step._configure(args)  # pylint: disable=protected-access
  if args.backend == "standin":
    from benchmarks import standin_attention  # pylint: disable=import-outside-toplevel
    standin_attention.register()
  args.started = time.monotonic()
  from benchmarks import results  # pylint: disable=import-outside-toplevel
  layers = f"{args.layers}layers" if args.layers is not None else ""
  tag = "_".join(x for x in (args.model, layers, args.tag) if x)
  path = None

  def save(result: dict) -> None:
    # One file per invocation, rewritten after every record.
    nonlocal path
    path = path or results.result_path(args.out, "memory", result["env"], tag)
    results.write_result(path, result)

  save(run(args, save))
  print(f"wrote {path}", flush=True)
  if args.markdown:
    print(f"wrote {write_report(args.out, args.markdown)}", flush=True)
  return path


if __name__ == "__main__":
  main()
