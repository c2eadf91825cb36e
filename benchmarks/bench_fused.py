"""The varlen primitive against JAX's own cuDNN attention, paired, one GPU.

    python -m benchmarks.bench_fused --head-dim 128 64 --tokens 64k 32k

For every (head dim, T) pair, Hkv, document mix and pass, the primitive
(B: :func:`jax_cp.fused_attention`, top-left causal, ``max_seqlen`` the
longest document) is timed in alternation with each reference (A,
:func:`benchmarks.timing.paired`):

* ``jax_nn``: ``jax.nn.dot_product_attention(implementation="cudnn",
  is_causal=True)`` over the row as one batch entry, on the one-document
  row only (``--jax-nn-implementation`` picks another implementation);
* ``jax_packed``: JAX's packed cuDNN call
  (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with
  ``q_offsets``/``kv_offsets`` and ``MaskType.PADDING_CAUSAL``);
* ``constant_metadata``: the primitive itself with the row's metadata as
  constants of the program (a ratio of 1: metadata as jit arguments cost
  nothing);
* ``ours``: the primitive against itself, the run's control: its ratio's
  distance from 1 is what the harness alone gives a pair;
* ``deterministic``: the primitive in the deterministic mode
  (``deterministic=True``: cuDNN's deterministic backward, split where its
  scratch must be; docs/determinism.md); its ratio is the mode's cost
  (> 1: the mode is slower). Run it without XLA's determinism flag, which
  would put the primitive itself in the mode;
* ``cp_attention``, ``cp_attention_constant``: :func:`jax_cp.cp_attention`
  at cp=1 (NO_LOAD_BALANCE, ``max_seqlen`` the longest document) with the
  metadata as jit arguments (a :class:`jax_cp.CPBatch` checked on the
  host, as a training step passes them) and as constants;
* ``cp_attention_slots``: :func:`jax_cp.cp_attention` at cp=1 with the row
  as the bound and a host-checked batch of ``--slots`` document slots
  (the row's documents, then empty ones), as a training step's batch
  passes them; the row's calls choose the dense graph on the device where
  each row holds one document (docs/internals.md, Tiled calls);
* ``fused_offsets``: the primitive with the offsets as jit arguments
  whatever the mix (one document too) and the row as the bound;
* ``cp_attention_slots_ragged``, ``fused_offsets_ragged``: the same two
  programs on a backend whose calls never choose the dense graph by their
  metadata (:func:`ragged_only_backend`: the graphs they ran before they
  could), each paired with its program (B) instead of the primitive: the
  cost of the choice where it does not apply, and its gain where it does;
  ``--versus`` pairs every other reference with another program than the
  primitive (``--refs jax_nn --versus cp_attention_slots``: jax.nn
  against a training step's batch directly);
* the peers of :mod:`benchmarks.peers` (``tokamax_mosaic``,
  ``tokamax_triton``, ``kvax``) where installed; one that does not load
  is reported with its error and the run goes on.

Before a pair is timed, the reference's output (and, for the backward,
its gradients) on the pair's first inputs is compared with the
primitive's: a reference off by more than ``--max-rel-err`` is reported
(its masking differs), not timed.

Both sides get the row's metadata (lengths, offsets) as arguments of the
jitted program, as a training step does; the primitive is called as its
docstring advises, a row of one document with ``q_offsets=None``.
``--window LEFT`` runs every program with the causal sliding window
``(LEFT, 0)``. The ratio is the reference's time over the primitive's
(> 1: the primitive is faster); TFLOP/s count the causal pairs (within
the window) with the backward's recompute
(:func:`benchmarks.workload.attention_flops`). ``--profile`` adds the
device time per kernel of one call of the primitive and of each reference
it timed, per layout and pass (:mod:`benchmarks.profiling`).

Writes ``fused_<date>_<device>.json`` and rebuilds ``fused.md`` beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fas

import jax_cp
from benchmarks import peers, profiling, results, timing, workload
from jax_cp.attention import registry

REFERENCES = ("ours", "jax_nn", "jax_packed", "constant_metadata",
              "cp_attention", "cp_attention_constant", "deterministic",
              "cp_attention_slots",
              "cp_attention_slots_ragged", "fused_offsets",
              "fused_offsets_ragged", *peers.PEERS)
#: References paired with another program than ``--versus`` (B).
VERSUS = {"cp_attention_slots_ragged": "cp_attention_slots",
          "fused_offsets_ragged": "fused_offsets"}
#: The programs ``--versus`` may name as every other reference's B.
B_PROGRAMS = ("ours", "cp_attention", "cp_attention_slots", "fused_offsets")


def ragged_only_backend(name: str) -> str:
  """Registers, and returns the name of, backend ``name`` whose calls
  never choose the tiled graph by their metadata: every call's
  :attr:`~jax_cp.attention.backend.Segments.tile_rows` cleared, as the
  segments were before calls could choose (the A side of the ``_ragged``
  references)."""
  base = registry.resolve_backend(name)
  ragged = f"{base.name}_ragged_only"

  def cleared(fn, index: int):
    if fn is None:
      return None

    def call(*args, **kwargs):
      args = list(args)
      args[index] = dataclasses.replace(args[index], tile_rows=0)
      return fn(*args, **kwargs)
    return call

  registry.register_backend(dataclasses.replace(
      base, name=ragged, forward=cleared(base.forward, 3),
      backward=cleared(base.backward, 6),
      forward_out=cleared(base.forward_out, 3)))
  return ragged


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_fused",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--head-dim", type=int, nargs="+", default=[128])
  p.add_argument("--tokens", type=workload.parse_tokens, nargs="+",
                 default=[65536], help="one T, or one per --head-dim")
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, nargs="+", default=[8])
  p.add_argument("--dists", nargs="+", choices=workload.DISTS,
                 default=list(workload.DEFAULT_DISTS))
  p.add_argument("--passes", nargs="+", choices=workload.PASSES,
                 default=list(workload.PASSES))
  p.add_argument("--refs", nargs="+", choices=REFERENCES,
                 default=list(REFERENCES))
  p.add_argument("--window", type=int, default=None,
                 help="causal sliding window (LEFT, 0) for every program")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--backend", default="cudnn",
                 help="jax_cp backend of the primitive")
  p.add_argument("--jax-nn-implementation", default="cudnn",
                 help="jax.nn.dot_product_attention's implementation")
  p.add_argument("--max-rel-err", type=float, default=2e-2,
                 help="a reference further from the primitive is not timed")
  p.add_argument("--versus", choices=B_PROGRAMS, default="ours",
                 help="the program (B) every reference is paired with, "
                 "but the _ragged ones (each with its own program)")
  p.add_argument("--slots", type=int, default=512,
                 help="document slots per row of cp_attention_slots' batch")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--profile", action="store_true",
                 help="device time per kernel of the primitive and of each "
                 "timed reference")
  p.add_argument("--out", default=results.RESULTS_DIR)
  p.add_argument("--tag", default=None, help="suffix of the result file")
  return p


def attention_fns(args, tokens: int, head_dim: int, lens_np: np.ndarray,
                  offs_np: np.ndarray) -> dict[str, Callable]:
  """``(q, k, v, lens, offs) -> out`` of the primitive and the
  references (``lens``, ``offs``: int32 ``[N]`` document lengths and
  first tokens; ``lens_np``, ``offs_np``: the same on the host)."""
  window = workload.window_size(args.window)
  longest = int(lens_np.max())

  def ours(q, k, v, lens, offs, deterministic=None):
    offs = offs if np.shape(offs)[-1] > 1 else None
    return jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type="causal_top_left",
        backend=args.backend, max_seqlen_q=longest, max_seqlen_kv=longest,
        window_size=window, deterministic=deterministic)

  def deterministic(q, k, v, lens, offs):
    return ours(q, k, v, lens, offs, deterministic=True)

  def constant_metadata(q, k, v, lens, offs):
    del lens, offs
    return ours(q, k, v, lens_np, offs_np)

  def jax_nn(q, k, v, lens, offs):
    del lens, offs
    return jax.nn.dot_product_attention(
        q[None], k[None], v[None], is_causal=True, local_window_size=window,
        implementation=args.jax_nn_implementation)[0]

  def jax_packed(q, k, v, lens, offs):
    ends = jnp.concatenate([offs, jnp.full((1,), tokens, offs.dtype)])
    return fas.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=lens[None], kv_seqlen=lens[None],
        q_offsets=ends[None], kv_offsets=ends[None],
        scale=1.0 / np.sqrt(head_dim), mask_type=fas.MaskType.PADDING_CAUSAL,
        sliding_window_length=None if window is None else window[0] + 1)[0]
  layout = jax_cp.CPLayout(mesh=jax.make_mesh((1,), ("cp",)), cp_axis="cp",
                           backend=args.backend,
                           strategy="no_load_balance", max_seqlen=longest)

  cu_np = np.append(offs_np, tokens).astype(np.int32)

  def cp_attention(q, k, v, batch):
    return jax_cp.cp_attention(q, k, v, batch, window_size=window)

  def cp_attention_constant(q, k, v, lens, offs):
    del lens, offs
    return jax_cp.cp_attention(q, k, v, (cu_np, cu_np), layout=layout,
                               window_size=window)

  cu_d = jnp.asarray(cu_np)
  batch = jax_cp.CPBatch(None, cu_d, cu_d, layout=layout).check_on_host()

  # A training step's batch: document slots, the row as the bound.
  slots = jax_cp.CPLayout(mesh=layout.mesh, cp_axis="cp",
                          backend=args.backend, strategy="no_load_balance",
                          max_seqlen=tokens)
  slots_ragged = slots.replace(backend=ragged_only_backend(args.backend))
  cu_slots = jnp.asarray(np.concatenate([cu_np, np.full(
      max(args.slots - len(offs_np), 0), tokens, np.int32)]))
  slot_batch = jax_cp.CPBatch(None, cu_slots, cu_slots,
                              layout=slots).check_on_host()

  def cp_attention_slots(q, k, v, batch):
    return jax_cp.cp_attention(q, k, v, batch, window_size=window)

  def cp_attention_slots_ragged(q, k, v, batch):
    return jax_cp.cp_attention(q, k, v, batch, layout=slots_ragged,
                               window_size=window)

  def fused_offsets(q, k, v, lens, offs, backend=args.backend):
    return jax_cp.fused_attention(
        q, k, v, lens, lens, offs, offs, attn_mask_type="causal_top_left",
        backend=backend, window_size=window)

  ragged = ragged_only_backend(args.backend)
  # The metadata arguments of a program that takes others than (lens, offs).
  metadata = {"cp_attention": (batch,), "cp_attention_slots": (slot_batch,),
              "cp_attention_slots_ragged": (slot_batch,)}
  fns = {"ours": ours, "jax_nn": jax_nn, "jax_packed": jax_packed,
         "constant_metadata": constant_metadata, "cp_attention": cp_attention,
         "cp_attention_constant": cp_attention_constant,
         "deterministic": deterministic,
         "cp_attention_slots": cp_attention_slots,
         "cp_attention_slots_ragged": cp_attention_slots_ragged,
         "fused_offsets": fused_offsets,
         "fused_offsets_ragged": lambda *a: fused_offsets(*a,
                                                          backend=ragged)}
  for name in peers.PEERS:
    if name in args.refs:
      fns[name] = peers.load(name, tokens=tokens, head_dim=head_dim,
                             window_left=args.window)
  return fns, metadata


def compare(a: Callable, a_inputs: tuple, b: Callable, b_inputs: tuple
            ) -> float:
  """The largest relative error (Frobenius norms) of ``a``'s results
  against ``b``'s (``with_pass`` programs and their arguments): the
  output, or the loss and the three gradients."""
  got = jax.tree.leaves(a(*a_inputs))
  want = jax.tree.leaves(b(*b_inputs))
  errs = []
  for x, y in zip(got, want):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    errs.append(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
  return float(max(errs))


def kernel_profile(fn: Callable, arg_sets, name: str) -> dict | None:
  """:func:`benchmarks.profiling.profile` of one call per step."""
  def run(n: int) -> None:
    jax.block_until_ready([fn(*arg_sets[0]) for _ in range(n)])
  prof = profiling.profile(run, 5)
  profiling.print_breakdown(name, prof)
  return prof


def main(argv: Sequence[str] | None = None) -> str:
  """Runs the pairs; returns the path of the JSON written."""
  args = build_parser().parse_args(argv)
  tokens = args.tokens * (len(args.head_dim) if len(args.tokens) == 1
                          else 1)
  if len(tokens) != len(args.head_dim):
    raise SystemExit("--tokens takes one value or one per --head-dim")
  run = results.Run("fused", argv, args, args.tag)
  run.extra["profiles"] = []
  dtype = jnp.dtype(args.dtype)
  for (d, t), hkv, dist in ((dt, h, x) for dt in zip(args.head_dim, tokens)
                            for h in args.hkv for x in args.dists):
    cu, cuP = workload.pack_row(dist, t, 1, args.seed)
    lens_np, offs_np = (np.asarray(x, np.int32) for x in (np.diff(cu),
                                                          cuP[:-1]))
    lens, offs = jnp.asarray(lens_np), jnp.asarray(offs_np)
    fns, metadata = attention_fns(args, t, d, lens_np, offs_np)
    shapes = [(t, args.hq, d), (t, hkv, d), (t, hkv, d), (t, args.hq, d)]
    sets = [tuple(workload.random_inputs(shapes, dtype, args.seed + i))
            + (lens, offs) for i in range(2)]
    refs = [r for r in args.refs if r != "jax_nn" or dist == "one_doc"]
    for pass_name in args.passes:
      step = {n: jax.jit(workload.with_pass(f, pass_name))
              for n, f in fns.items() if not isinstance(f, peers.Peer)}
      for n, f in fns.items():
        if isinstance(f, peers.Peer) and f.fn is not None:
          step[n] = jax.jit(workload.with_pass(f.fn, pass_name))
      flops = workload.attention_flops(cu, args.hq, d, pass_name, args.window)
      b_sets = ([x[:4] + metadata[args.versus] for x in sets]
                if args.versus in metadata else sets)
      profiled = {args.versus: b_sets} if args.profile else {}
      for ref in refs:
        rec = dict(head_dim=d, tokens=t, hq=args.hq, hkv=hkv, dist=dist,
                   docs=len(cu) - 1, window=args.window, reference=ref,
                   dtype=args.dtype, reps=args.reps, flops=flops)
        rec["pass"] = pass_name
        peer = fns[ref] if isinstance(fns[ref], peers.Peer) else None
        if peer is not None:
          rec["shims"] = list(peer.shims)
          for shim in peer.shims:
            print(f"{ref}: shim: {shim}", flush=True)
        versus = VERSUS.get(ref, args.versus)
        if versus != "ours":
          rec["versus"] = versus
        try:
          if peer is not None and peer.fn is None:
            raise RuntimeError(f"not loaded: {peer.error}")
          ref_sets, b_sets = ([x[:4] + metadata[name] for x in sets]
                              if name in metadata else sets
                              for name in (ref, versus))
          err = compare(step[ref], ref_sets[0], step[versus], b_sets[0])
          rec["rel_err"] = err
          if not err <= args.max_rel_err:
            raise RuntimeError(f"results differ from {versus}'s: relative "
                               f"error {err:.3g} > {args.max_rel_err} (its "
                               f"masking differs); not timed")
          rec.update(timing.paired(step[ref], ref_sets, step[versus], b_sets,
                                   reps=args.reps).fields())
          rec["tflops_a"] = flops / rec["ms_a"] / 1e9
          rec["tflops_b"] = flops / rec["ms_b"] / 1e9
          print(f"D={d} T={t} Hkv={hkv} {dist} {pass_name}: {ref} "
                f"{rec['ms_a']:.3f} ms, {versus} {rec['ms_b']:.3f} ms "
                f"({rec['tflops_b']:.1f} TFLOP/s), {ref} / {versus} "
                f"{rec['ratio']:.3f} (IQR {rec['ratio_q1']:.3f}-"
                f"{rec['ratio_q3']:.3f})", flush=True)
        except Exception as err:  # noqa: BLE001  (recorded; run goes on)
          rec["error"] = f"{type(err).__name__}: {err}"[:600]
          print(f"D={d} T={t} Hkv={hkv} {dist} {pass_name} {ref}: "
                f"{rec['error'][:300]}", flush=True)
        run.add(rec)
        if args.profile and "ms_a" in rec:
          profiled[ref] = ref_sets
      for name, arg_sets in profiled.items():
        label = f"{name}, {pass_name}, D={d}, T={t}, Hkv={hkv}, {dist}"
        run.extra["profiles"].append(dict(
            program=label, profile=kernel_profile(step[name], arg_sets,
                                                  label)))
  return run.finish()


if __name__ == "__main__":
  main()
