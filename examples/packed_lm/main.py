"""The run: mesh, data, model, training, the CP-vs-no-CP check (the final
loss on the last batch, with CP and on one device), report. Several hosts:
the same command on each with ``--coordinator``, ``--num-processes``,
``--process-id``; each process streams only the rows of its batch shards
(``data.Batches``)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
from flax import nnx
from jax.experimental import multihost_utils

import jax_cp
from examples.packed_lm import checkpoint, config, data, model, train


def make_mesh(dp: int, cp: int, device: str,
              cfg: config.Config | None = None) -> jax.sharding.Mesh:
  """``(data, cp)`` (``(data, cp_outer, cp_inner)`` with ``cfg.cp_inner``;
  Auto axes) over the first ``dp*cp/N`` devices of each of N processes in
  (process, id) order: each cp group on fewest hosts."""
  platform, n_proc = jax.devices()[0].platform, jax.process_count()
  if platform != device:
    raise SystemExit(f"--device {device}, but jax runs on {platform}")
  per = dp * cp // n_proc
  chosen = [d for p in range(n_proc) for d in sorted(
      jax.local_devices(process_index=p), key=lambda d: d.id)[:per]]
  if len(chosen) != dp * cp:
    raise SystemExit(f"dp*cp = {dp * cp} devices, {per} from each of the "
                     f"{n_proc} processes, are not present (CPU: XLA_FLAGS="
                     "--xla_force_host_platform_device_count=N)")
  axes = (model.mesh_shape(cfg, dp, cp) if cfg is not None
          else {model.DATA: dp, model.CP: cp})
  return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=chosen,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def _start(cfg: config.Config) -> config.Config:
  """Starts ``jax.distributed`` if asked; the config with ``dp``, ``cp``."""
  n_proc, cpu_devices = config.num_processes(cfg), None
  if n_proc > 1 and cfg.device == "cpu":
    dp, cp = config.choose_mesh_shape(cfg.dp, cfg.cp, "cpu", None)
    cpu_devices = dp * cp // n_proc   # make_mesh checks it is exact
  if not jax.distributed.is_initialized():
    try:
      jax_cp.data.init_distributed(cfg.coordinator, cfg.num_processes,
                                 cfg.process_id, cpu_devices=cpu_devices)
    except ValueError as e:
      raise SystemExit(f"several processes: {e}") from None
  dp, cp = config.choose_mesh_shape(cfg.dp, cfg.cp, cfg.device,
                                    jax.device_count(), cfg.batch)
  if cfg.batch % dp:
    raise SystemExit(f"--batch {cfg.batch} must be divisible by --dp {dp}")
  return dataclasses.replace(cfg, dp=dp, cp=cp)


def main(argv: list[str] | None = None) -> dict:
  """Trains; returns the config, ``losses``, ``eval_loss_cp``, ``mfu``..."""
  cfg = _start(config.parse_args(argv))
  is_main, b = jax.process_index() == 0, cfg.batch
  log = print if is_main and not cfg.quiet else (lambda *a: None)
  mesh = make_mesh(cfg.dp, cfg.cp, cfg.device, cfg)
  layout = model.make_layout(cfg, mesh)
  multiple = jax_cp.data.pad_multiple_for(layout)
  # A padded document is at most max_doc_len rounded up; so is the padding
  # after a row's last document (first-fit packing closes a row only when
  # a document does not fit in what is left).
  max_seqlen = cfg.max_seqlen or -(-cfg.max_doc_len // multiple) * multiple
  layout = layout.replace(max_seqlen=max_seqlen)
  local = jax_cp.data.process_batch_rows(layout, b)
  batches = data.Batches(cfg, cfg.cp, data.held_shards(local, b, cfg.dp),
                         cfg.dp)
  log(f"data: grain pipeline, {b} rows x {cfg.seq_len} tokens per step "
      f"({cfg.doc_order}), max_seqlen={max_seqlen}; mesh dp={cfg.dp} x "
      f"cp={cfg.cp} ({cfg.strategy}) over {jax.process_count()} process(es)")
  ckpt = (checkpoint.Checkpointer(cfg, batches.get_state)
          if cfg.checkpoint_dir else None)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = train.init_state(
        cfg, layout, train.make_optimizer(cfg), mesh)
    state, start, data_state = (ckpt.restore(state) if ckpt
                                else (state, 0, None))
    if start:
      log(f"resuming at step {start} from {ckpt.path}")
      batches.set_state(data_state)
    n_matmul = model.matmul_params(nnx.merge(graphdef, state)[0])
    cu_of_step, last = {}, {}

    def placed(steps):
      """The global batch of each step, from this process's rows."""
      for step, rows in zip(steps, batches):
        cu_of_step[step] = rows.cu_seqlens
        last["batch"] = data.place_batch(rows, layout, global_batch=b)
        yield last["batch"]

    # This process's rows stand for the step's (MFU).
    step_flops = lambda s: jax_cp.planning.model_flops(
        cu_of_step.pop(s), tokens=b * cfg.seq_len, matmul_params=n_matmul,
        num_layers=cfg.layers, num_heads=cfg.heads,
        head_dim=cfg.d_model // cfg.heads) * cfg.dp / len(batches.shards)
    peak = cfg.peak_tflops or train.peak_tflops(jax.devices()[0])
    log(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads}/"
        f"{cfg.kv_heads} heads, {n_matmul:,} matmul params "
        f"({cfg.param_sharding}), {cfg.dtype}, remat {cfg.remat}, backend "
        f"{cfg.backend}; AdamW lr {cfg.lr:.2e}, {cfg.warmup} warmup steps")
    t0 = time.perf_counter()
    state, losses, tok_s, mfu = train.train_loop(
        cfg, train.make_train_step(graphdef, shardings, mesh,
                                   cfg.param_sharding), state,
        placed(range(start, cfg.steps)),
        start=start, step_flops=step_flops,
        peak_flops=peak and peak * 1e12 * mesh.size, checkpointer=ckpt,
        show=is_main and not cfg.quiet)
    if ckpt is not None:
      ckpt.save(cfg.steps, state, final=True)
    if losses:
      log(f"steps {start}..{cfg.steps - 1} in {time.perf_counter() - t0:.1f}"
          f" s: loss {losses[0]:.4f} -> {losses[-1]:.4f}; {tok_s:,.0f} tok/s"
          " after compilation" + (f", MFU {mfu:.1%}" if mfu else ""))
    eval_cp, eval_nocp = None, None
    if not cfg.no_compare:
      # The last batch trained on (none trained: the next one).
      batch = last["batch"] if last else next(placed([cfg.steps]))
      lm = nnx.merge(graphdef, state)[0]
      eval_cp = train.evaluate(lm, batch)
      # Every process takes part in gathering the sharded parameters and
      # the global batch.
      params = multihost_utils.process_allgather(nnx.state(lm), tiled=True)
      whole = multihost_utils.process_allgather(
          (batch.tensors, batch.cu_seqlens_padded, batch.cu_seqlens),
          tiled=True)
  batches.close()
  if eval_cp is not None and is_main:   # one device, whole parameters
    nocp = model.make_layout(cfg, None, max_seqlen)
    lm = nnx.merge(nnx.graphdef(nnx.eval_shape(
        lambda: model.PackedLM(cfg, nocp, rngs=nnx.Rngs(0)))), params)
    tensors, cu_p, cu = whole
    tensors = {k: jax_cp.data.restore_from_cp(v, cu_p, layout, seq_dim=1)
               for k, v in tensors.items()}
    eval_nocp = train.evaluate(lm, jax_cp.data.make_global_batch(
        tensors, cu_p, nocp, cu_seqlens=cu))
    rel = abs(eval_cp - eval_nocp) / max(abs(eval_nocp), 1e-12)
    tol = 1e-4 if cfg.dtype == "float32" else 5e-3   # sums in other orders
    log(f"final params, last batch: loss with CP {eval_cp:.6f}, without CP "
        f"(one device) {eval_nocp:.6f}: relative difference {rel:.1e} "
        f"({'within' if rel <= tol else 'ABOVE'} {tol:g})")
    if rel > tol:
      raise SystemExit("the CP and no-CP losses disagree")
  result = dataclasses.asdict(cfg) | dict(
      losses=losses, start_step=start, eval_loss_cp=eval_cp,
      eval_loss_nocp=eval_nocp, tokens_per_s=tok_s, mfu=mfu,
      max_seqlen=max_seqlen, process_index=jax.process_index(),
      num_processes=jax.process_count(), local_rows=local.tolist())
  if cfg.report and ("{process}" in cfg.report or is_main):
    path = pathlib.Path(cfg.report.replace("{process}",
                                           str(jax.process_index())))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
  return result
