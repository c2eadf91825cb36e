"""Train a small byte-level decoder LM on packed documents with context
parallelism.

The documents are the Python standard library's source files (real,
variable-length text, no download; see ``packed_data.py``), packed into rows
of ``--seq-len`` tokens. Each row is split over the ``cp`` axis of a
``(data, cp)`` mesh with the chosen load-balancing strategy, and a
``jit``-compiled AdamW step trains a stack of
:class:`jax_cp.flax.TransformerLayer` in the *global view*: arrays hold whole
rows in :func:`jax_cp.reorder_for_cp` layout, sharded over the mesh, and
:func:`jax_cp.cp_attention` opens its own ``shard_map``. At the end, the
final parameters are evaluated on the last batch both with CP and without it
(``cp_axis=None`` on one device): the two losses must agree.

Several processes (hosts): the same command on every host, with
``--coordinator host0:PORT --num-processes N --process-id I`` (or
``$JAX_CP_COORDINATOR``, ``$JAX_CP_NUM_PROCESSES``, ``$JAX_CP_PROCESS_ID``;
see ``multihost.py``). The ``(data, cp)`` mesh puts each cp group on as few
processes as possible (dp across them); each process builds every step's
batch from its own rows only (:func:`jax_cp.process_batch_rows`,
:func:`jax_cp.make_global_batch`) and each device receives only its cp
slice. Process 0 prints; ``--report`` writes the returned dict as JSON.

Run (CPU, 8 virtual devices, dp=2 x cp=4; a couple of minutes on 2 cores)::

    python examples/train_packed_lm.py
    python examples/train_packed_lm.py --strategy no_load_balance
    python examples/train_packed_lm.py --checkpoint-dir /tmp/lm  # rerun resumes
    python examples/train_packed_lm.py --device gpu --dp 1 --cp 2 \\
        --dtype bfloat16 --seq-len 8192 --d-model 512 --layers 4
    # two processes on this machine, cp=8 spanning both (4 devices each):
    for i in 0 1; do python examples/train_packed_lm.py --dp 1 --cp 8 \\
        --coordinator localhost:29500 --num-processes 2 --process-id $i & done

On CPU (unless ``--device gpu``), a single process asks XLA for
``max(8, dp*cp)`` virtual devices before importing jax (unless ``XLA_FLAGS``
already sets ``--xla_force_host_platform_device_count``); with N processes
each gets ``dp*cp/N`` (``jax_num_cpu_devices``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Dict, List, Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="float32", help="computation dtype")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=512, help="tokens per row")
  p.add_argument("--batch", type=int, default=2, help="rows per step")
  p.add_argument("--dp", type=int, default=2, help="data-parallel size")
  p.add_argument("--cp", type=int, default=4, help="context-parallel size")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--strategy", choices=("dual_chunk_swap", "no_load_balance"),
                 default="dual_chunk_swap")
  p.add_argument("--backend", choices=("auto", "xla", "cudnn"),
                 default="auto", help="varlen attention backend")
  p.add_argument("--max-seqlen", type=int, default=None,
                 help="static bound on padded document length "
                 "(default: computed from the data)")
  p.add_argument("--max-doc-len", type=int, default=None,
                 help="cut files to this many bytes (default: seq-len / 2)")
  p.add_argument("--checkpoint-dir", default=None,
                 help="save here (orbax) and resume from the last step")
  p.add_argument("--checkpoint-every", type=int, default=50)
  p.add_argument("--no-compare", action="store_true",
                 help="skip the final comparison with a no-CP evaluation")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  p.add_argument("--report", default=None, metavar="FILE",
                 help="write the returned dict as JSON; with several "
                 "processes, '{process}' in FILE is replaced by the process "
                 "id (without it, process 0 writes)")
  g = p.add_argument_group(
      "several processes", "one process per host (default: from the "
      "environment, see multihost.py; nothing set: single process)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="address of process 0 (default: $JAX_CP_COORDINATOR, "
                 "else $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="default: $JAX_CP_NUM_PROCESSES")
  g.add_argument("--process-id", type=int, default=None,
                 help="default: $JAX_CP_PROCESS_ID")
  return p


def _num_processes(args) -> int:
  """The process count asked on the command line or in the environment."""
  if args.num_processes is not None:
    return args.num_processes
  try:   # a malformed value is reported by multihost.init_distributed
    return int(os.environ.get("JAX_CP_NUM_PROCESSES", ""))
  except ValueError:
    return 1


def _configure_platform(argv: Sequence[str]) -> None:
  """Before jax is imported: CPU runs get virtual devices for the mesh."""
  args, _ = build_parser().parse_known_args(argv)
  if args.device == "gpu":
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  # Several processes: main() sets jax_num_cpu_devices (dp*cp/N) instead.
  if (_num_processes(args) <= 1
      and "xla_force_host_platform_device_count" not in flags):
    n = max(8, args.dp * args.cp)
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={n}".strip())


if __name__ == "__main__":
  _configure_platform(sys.argv[1:])

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
  import jax_cp  # noqa: E402,F401  pylint: disable=unused-import
except ImportError:  # running from a checkout without installing
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax_cp  # noqa: E402,F401  pylint: disable=unused-import
from jax_cp.flax import TransformerLayer  # noqa: E402
from jax_cp.flax.settings import cp_settings  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multihost  # noqa: E402
import packed_data  # noqa: E402

DATA, CP = "data", "cp"


class PackedLM(nn.Module):
  """Byte embedding, ``num_layers`` CP transformer layers, RMSNorm, logits.

  Attributes:
    num_layers: transformer layers.
    d_model: model width.
    num_heads: query heads.
    num_kv_heads: key/value heads.
    vocab_size: output classes (256 bytes).
    dtype: computation dtype (parameters are float32).
    cp_axis, cp_strategy, attn_backend, max_seqlen, mesh, batch_axis,
      cp_comm_type, local_view: CP settings handed to every layer.
  """

  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  vocab_size: int = packed_data.VOCAB_SIZE
  dtype: jnp.dtype = jnp.float32
  cp_axis: Optional[str] = None
  cp_strategy: str = "dual_chunk_swap"
  cp_comm_type: str = "all_gather"
  attn_backend: str = "auto"
  max_seqlen: Optional[int] = None
  mesh: Optional[jax.sharding.Mesh] = None
  batch_axis: Optional[str] = None
  local_view: bool = False

  @nn.compact
  def __call__(self, tokens, cu_seqlens, cu_seqlens_padded, position_ids):
    x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype,
                 name="embed")(tokens)
    for i in range(self.num_layers):
      x = TransformerLayer(num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, dtype=self.dtype,
                           **cp_settings(self), name=f"layer_{i}")(
                               x, cu_seqlens, cu_seqlens_padded, position_ids)
    x = nn.RMSNorm(dtype=self.dtype, name="final_norm")(x)
    return nn.Dense(self.vocab_size, dtype=self.dtype, name="logits")(
        x).astype(jnp.float32)


def loss_fn(model: PackedLM, params, batch: Dict[str, jax.Array]):
  """Mean next-byte cross entropy over the real targets of the batch."""
  logits = model.apply(params, batch["tokens"], batch["cu_seqlens"],
                       batch["cu_seqlens_padded"], batch["position_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                       batch["labels"])
  mask = batch["loss_mask"]
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_mesh(dp: int, cp: int, device: str):
  """The ``(data, cp)`` mesh with Auto axes: XLA propagates the batch
  shardings through the model (with Explicit axes, the default of
  ``jax.make_mesh``, the embedding gather would need an explicit
  out_sharding)."""
  devices = jax.devices()
  auto = (jax.sharding.AxisType.Auto,) * 2
  if devices[0].platform != device:
    raise SystemExit(f"--device {device} asked, but jax runs on "
                     f"{devices[0].platform}")
  n_proc = jax.process_count()
  if n_proc == 1:
    if len(devices) < dp * cp:
      raise SystemExit(
          f"dp*cp = {dp * cp} devices needed, jax sees {len(devices)}; on "
          "CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return jax.make_mesh((dp, cp), (DATA, CP), devices=devices[:dp * cp],
                         axis_types=auto)
  # Several processes: the first dp*cp/N devices of every process, each cp
  # group on as few consecutive processes as possible (inside a host and
  # its NVLink domain when cp <= devices per process), dp across them.
  per = dp * cp // n_proc
  if per * n_proc != dp * cp:
    raise SystemExit(f"dp*cp = {dp * cp} devices must be spread evenly over "
                     f"the {n_proc} processes")
  chosen = []
  for p in range(n_proc):
    own = sorted((d for d in devices if d.process_index == p),
                 key=lambda d: d.id)
    if len(own) < per:
      raise SystemExit(f"dp*cp/processes = {per} devices needed per "
                       f"process, process {p} has {len(own)}")
    chosen += own[:per]
  return multihost.make_mesh(dp, cp, axis_names=(DATA, CP), axis_types=auto,
                             devices=chosen)


def place_batch(rows: packed_data.PackedRows, mesh,
                local: np.ndarray, strategy: str,
                max_seqlen: int) -> Dict[str, jax.Array]:
  """Global view on the mesh from *this process's* rows ``local`` (global
  row indices of :func:`jax_cp.process_batch_rows`): token arrays
  ``[B, T]`` in :func:`jax_cp.reorder_for_cp` layout sharded ``P(data,
  cp)`` (each device gets only its cp slice), metadata ``[B, N+1]`` sharded
  ``P(data)``. ``rows`` is the whole global batch in physical order; only
  ``rows[local]`` is read."""
  mine = {k: v[local] for k, v in rows.as_dict().items()}
  tokens, cu_seqlens_padded = jax_cp.make_global_batch(
      {k: mine[k] for k in packed_data.PackedRows.TOKEN_FIELDS},
      mine["cu_seqlens_padded"], mesh, cp_axis=CP, batch_axis=DATA,
      load_balancing_strategy=strategy, max_seqlen=max_seqlen,
      global_batch_size=rows.num_rows)
  cu_seqlens = jax_cp.make_global_metadata(
      mine["cu_seqlens"], mesh, batch_axis=DATA,
      global_batch_size=rows.num_rows)
  return {**tokens, "cu_seqlens": cu_seqlens,
          "cu_seqlens_padded": cu_seqlens_padded}


class Checkpointer:
  """Orbax checkpoints of ``{step, params, opt_state}`` plus the run's
  config (a resumed run must use the same model and data settings).

  With several processes, the directory must be shared by all of them (one
  path on a shared file system, or the same local directory for processes
  of one machine): orbax writes the replicated state once and synchronises
  the processes itself; ``run_config.json`` is read by every process before
  process 0 writes it."""

  _KEYS = ("layers", "d_model", "heads", "kv_heads", "seq_len", "batch",
           "seed", "strategy", "max_doc_len")

  def __init__(self, directory: str, args, every: int):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    self._ocp = ocp
    self.path = pathlib.Path(directory).resolve()
    self.path.mkdir(parents=True, exist_ok=True)
    self.every = every
    config = {k: getattr(args, k) for k in self._KEYS}
    cfg_file = self.path / "run_config.json"
    exists = cfg_file.exists()
    if exists:
      old = json.loads(cfg_file.read_text())
      diff = {k: (old.get(k), v) for k, v in config.items()
              if old.get(k) != v}
      if diff:
        raise SystemExit(f"--checkpoint-dir {self.path} holds a run with "
                         f"other settings (old, new): {diff}")
    if jax.process_count() > 1:   # everyone has read before anyone writes
      ocp.multihost.sync_global_processes("jax_cp_example_run_config")
    if not exists and jax.process_index() == 0:
      cfg_file.write_text(json.dumps(config, indent=1))
    self.manager = ocp.CheckpointManager(
        self.path / "state", options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True))
    self._last_saved = self.manager.latest_step()

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def restore(self, abstract):
    """The latest checkpoint, placed like ``abstract`` (a tree of
    ``jax.ShapeDtypeStruct`` with shardings)."""
    return self.manager.restore(
        self.latest_step(), args=self._ocp.args.StandardRestore(abstract))

  def save(self, step: int, state, force: bool = False) -> None:
    """Saves every ``every`` steps, or now with ``force`` (a step already
    saved is not saved again)."""
    if step == self._last_saved:
      return
    if force or step % self.every == 0:
      self.manager.save(step, args=self._ocp.args.StandardSave(state),
                        force=force)
      self._last_saved = step

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _progress(step: int, total: int, loss: float, tok_s: float) -> str:
  width = 30
  done = int(width * step / max(total, 1))
  return (f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total} "
          f"loss {loss:.4f} {tok_s:,.0f} tok/s")


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains and returns ``{"losses": [...], "start_step", "eval_loss_cp",
  "eval_loss_nocp", "tokens_per_s", "local_rows", ...}`` (losses of the
  steps run here; ``eval_loss_nocp`` on process 0 only; ``local_rows``: the
  rows of each global batch that this process loads)."""
  args = build_parser().parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  if args.batch % args.dp:
    raise SystemExit(f"--batch {args.batch} must be divisible by --dp "
                     f"{args.dp}")
  if args.max_doc_len is None:
    args.max_doc_len = args.seq_len // 2
  # Several processes: jax.distributed first, before any device query.
  n_proc = _num_processes(args)
  cpu_devices = None
  if n_proc > 1 and args.device == "cpu":
    cpu_devices = args.dp * args.cp // n_proc
    if cpu_devices * n_proc != args.dp * args.cp:
      raise SystemExit(f"dp*cp = {args.dp * args.cp} CPU devices cannot be "
                       f"split evenly over {n_proc} processes")
  if not jax.distributed.is_initialized():
    try:
      multihost.init_distributed(args.coordinator, args.num_processes,
                                 args.process_id, cpu_devices=cpu_devices)
    except ValueError as e:
      raise SystemExit(f"several processes: {e}") from None
  is_main = jax.process_index() == 0
  log = print if is_main and not args.quiet else (lambda *a, **k: None)
  mesh = make_mesh(args.dp, args.cp, args.device)
  # The rows of every global batch that this process loads: those of the
  # data shards its devices hold (all of them when dp == 1).
  local = jax_cp.process_batch_rows(mesh, args.batch, DATA)

  # Data: row i is the same whatever --steps is, so a resumed run continues
  # on the batches it has not seen.
  rows = packed_data.load_stdlib_rows(
      args.steps * args.batch, args.seq_len, cp_size=args.cp,
      strategy=args.strategy, seed=args.seed, max_doc_len=args.max_doc_len)
  max_seqlen = args.max_seqlen or rows.max_seqlen
  # Every process makes the same rows (same seed) but passes on only its
  # own (place_batch). Global view: make_global_batch puts the tokens in
  # reorder_for_cp layout, so that a contiguous split over the cp axis gives
  # every rank its strategy's tokens, and hands each device only its slice
  # (jax_cp.get_batch_on_this_cp_rank). (A per-rank model would instead
  # feed TransformerLayer with local_view=True inside a shard_map.)
  docs = int((np.diff(rows.cu_seqlens, axis=1) > 0).sum())
  log(f"data: {rows.num_rows} rows x {rows.seq_len} tokens, {docs} documents "
      f"from the stdlib, max_seqlen={max_seqlen}, "
      f"{rows.loss_mask.mean():.1%} real targets")

  common = dict(num_layers=args.layers, d_model=args.d_model,
                num_heads=args.heads, num_kv_heads=args.kv_heads, dtype=dtype,
                attn_backend=args.backend, max_seqlen=max_seqlen)
  model = PackedLM(cp_axis=CP, cp_strategy=args.strategy, mesh=mesh,
                   batch_axis=DATA, **common)
  warmup = min(20, args.steps // 4)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.1),
                   weight_decay=0.01)

  def init(batch):
    params = model.init(jax.random.key(args.seed), batch["tokens"],
                        batch["cu_seqlens"], batch["cu_seqlens_padded"],
                        batch["position_ids"])
    return {"step": jnp.int32(0), "params": params,
            "opt_state": tx.init(params)}

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, batch))(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss

  def batch_at(step: int):
    # The metadata are global arrays too: arguments of the jitted step (a
    # jit cannot close over arrays spanning other processes).
    return place_batch(rows.rows(step * args.batch, (step + 1) * args.batch),
                       mesh, local, args.strategy, max_seqlen)

  ckpt = (Checkpointer(args.checkpoint_dir, args, args.checkpoint_every)
          if args.checkpoint_dir else None)
  with jax.set_mesh(mesh):
    # Parameters and optimizer state are replicated; the batch is sharded.
    replicated = NamedSharding(mesh, P())
    start = 0
    if ckpt is not None and ckpt.latest_step() is not None:
      abstract = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=replicated),
          jax.eval_shape(init, batch_at(0)))
      state = ckpt.restore(abstract)
      start = int(state["step"])
      log(f"resuming at step {start} from the checkpoint in {ckpt.path}"
          + ("" if start < args.steps else " (nothing left to train)"))
    else:
      state = jax.jit(init, out_shardings=replicated)(batch_at(0))
    step_fn = jax.jit(train_step, donate_argnums=0)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    log(f"model: {args.layers} layers, d_model {args.d_model}, "
        f"{args.heads} heads / {args.kv_heads} kv heads, {n_params:,} params"
        f"; mesh dp={args.dp} x cp={args.cp} ({args.strategy}), "
        f"{args.dtype}, backend {args.backend}")
    if jax.process_count() > 1:
      groups = [sorted({d.process_index for d in g}) for g in mesh.devices]
      log(f"{jax.process_count()} processes x "
          f"{mesh.size // jax.process_count()} "
          f"devices; processes of each cp group: {groups}; process 0 loads "
          f"rows {local.tolist()} of each batch")
    losses: List[float] = []
    timed_tokens, timed_s, t_start = 0, 0.0, time.perf_counter()
    for step in range(start, args.steps):
      t0 = time.perf_counter()
      state, loss = step_fn(state, batch_at(step))
      loss = float(loss.addressable_data(0))    # replicated
      dt = time.perf_counter() - t0
      losses.append(loss)
      if step > start:          # the first step includes compilation
        timed_tokens += args.batch * args.seq_len
        timed_s += dt
      if ckpt is not None:
        ckpt.save(step + 1, state)
      if is_main and not args.quiet:
        print(_progress(step + 1, args.steps, loss,
                        timed_tokens / timed_s if timed_s else 0.0),
              end="", flush=True)
    if is_main and not args.quiet and losses:
      print()
    if ckpt is not None:
      if losses:
        ckpt.save(args.steps, state, force=True)
      ckpt.close()
    tok_s = timed_tokens / timed_s if timed_s else 0.0
    wall = time.perf_counter() - t_start

    # The same final parameters on the last batch, with and without CP.
    last = max(args.steps - 1, 0)
    eval_loss_cp = eval_loss_nocp = None
    if not args.no_compare:
      eval_loss_cp = float(jax.jit(lambda p, b: loss_fn(model, p, b))(
          state["params"], batch_at(last)).addressable_data(0))
  if not args.no_compare and is_main:
    # Process 0 alone, on one of its devices: the parameters are replicated,
    # so its local copy is the whole of them.
    nocp_model = PackedLM(cp_axis=None, **common)
    host_batch = rows.rows(last * args.batch,
                           (last + 1) * args.batch).as_dict()
    local_params = jax.tree.map(lambda x: x.addressable_data(0),
                                state["params"])
    eval_loss_nocp = float(jax.jit(lambda p, b: loss_fn(nocp_model, p, b))(
        local_params, host_batch))

  if losses:
    k = min(10, len(losses))
    log(f"trained steps {start}..{args.steps - 1} in {wall:.1f}s: loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f} (mean of last {k}: "
        f"{np.mean(losses[-k:]):.4f}); {tok_s:,.0f} tok/s after compilation")
  if eval_loss_nocp is not None:
    rel = abs(eval_loss_cp - eval_loss_nocp) / max(abs(eval_loss_nocp), 1e-12)
    log(f"final params on the last batch (step {last}): loss with CP (dp="
        f"{args.dp} x cp={args.cp}, {args.strategy}) {eval_loss_cp:.6f} vs "
        f"without CP (cp_axis=None, one device, same params and batch) "
        f"{eval_loss_nocp:.6f}: relative difference {rel:.2e}")
  result = {"losses": losses, "start_step": start, "steps": args.steps,
            "eval_loss_cp": eval_loss_cp, "eval_loss_nocp": eval_loss_nocp,
            "tokens_per_s": tok_s, "max_seqlen": max_seqlen,
            "process_index": jax.process_index(),
            "num_processes": jax.process_count(),
            "local_rows": local.tolist()}
  if args.report and ("{process}" in args.report or is_main):
    path = pathlib.Path(args.report.replace("{process}",
                                            str(jax.process_index())))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
