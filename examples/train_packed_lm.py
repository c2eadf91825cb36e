"""Train a small byte-level decoder LM on packed documents with context
parallelism.

The documents are the Python standard library's source files (real,
variable-length text, no download; see ``packed_data.py``), packed into rows
of ``--seq-len`` tokens. Each row is split over the ``cp`` axis of a
``(data, cp)`` mesh with the chosen load-balancing strategy, and a
``jit``-compiled AdamW step trains a stack of
:class:`jax_cp.nnx.TransformerLayer` (Flax NNX; ``--api linen`` trains the
same model built from :class:`jax_cp.flax.TransformerLayer`, with the same
parameters) in the *global view*: arrays hold whole rows in
:func:`jax_cp.reorder_for_cp` layout, sharded over the mesh, and
:func:`jax_cp.cp_attention` opens its own ``shard_map``. One
:class:`jax_cp.CPLayout`, made in :func:`build_model`, lays out the batches
(:func:`place_batch`) and configures the model's attention. At the end, the
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
    python examples/train_packed_lm.py --api linen
    python examples/train_packed_lm.py --checkpoint-dir /tmp/lm  # rerun resumes
    python examples/train_packed_lm.py --device gpu --dp 1 --cp 2 \\
        --dtype bfloat16 --seq-len 8192 --d-model 512 --layers 4
    # two processes on this machine, cp=8 spanning both (4 devices each):
    for i in 0 1; do python examples/train_packed_lm.py --dp 1 --cp 8 \\
        --coordinator localhost:29500 --num-processes 2 --process-id $i & done

On CPU (unless ``--device gpu``), a single process asks XLA for
``max(8, dp*cp)`` virtual devices before importing jax (unless ``XLA_FLAGS``
already sets ``--xla_force_host_platform_device_count``); with N processes
each gets ``dp*cp/N`` (``jax_num_cpu_devices``). With ``--device gpu`` the
flags of ``xla_flags.py`` are added, and ``dp x cp`` defaults to ``1 x``
(all GPUs present).

The training step is what pretraining jobs use:

* parameters and optimizer state sharded over the whole ``(data, cp)`` mesh
  (FSDP / ZeRO, :func:`state_shardings`): each weight is all-gathered where
  it is used and its gradient reduce-scattered back to its shard, so the
  optimizer update runs once per shard, not on every device
  (``--param-sharding replicated`` keeps one full copy per device);
* the byte embedding is a one-hot matmul (:class:`ByteEmbed`);
* the next batches are built on a host thread while the device runs the
  current step (:func:`prefetched`), and the host waits for the device only
  every ``--log-every`` steps;
* AdamW with warmup, cosine decay and gradient clipping
  (:func:`make_optimizer`); the progress line shows the model FLOP
  utilisation (:func:`model_flops`).

The pieces (:func:`build_model`, :func:`make_optimizer`,
:func:`state_shardings`, :func:`init_state`, :func:`make_train_step`,
:func:`place_batch`) are importable; ``benchmarks/bench_step.py`` times the
same step.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import xla_flags


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
  p.add_argument("--api", choices=("nnx", "linen"), default="nnx",
                 help="Flax API of the model (same parameters either way)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="float32", help="computation dtype")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=512, help="tokens per row")
  p.add_argument("--batch", type=int, default=2, help="rows per step")
  p.add_argument("--dp", type=int, default=None,
                 help="data-parallel size (default: 2 on CPU; on GPU, "
                 "devices / cp, else 1)")
  p.add_argument("--cp", type=int, default=None,
                 help="context-parallel size (default: 4 on CPU; on GPU, "
                 "the devices present / dp)")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--lr", type=float, default=None,
                 help="peak learning rate (default: min(3e-3, 0.6/d_model))")
  p.add_argument("--warmup", type=int, default=None,
                 help="linear warmup steps (default: 10%% of --steps, at "
                 "most 100)")
  p.add_argument("--param-sharding", choices=("fsdp", "replicated"),
                 default="fsdp", help="parameters and optimizer state: "
                 "sharded over data x cp, or one copy per device")
  p.add_argument("--prefetch", type=int, default=2,
                 help="batches built ahead on a host thread (0: none)")
  p.add_argument("--log-every", type=int, default=10,
                 help="the host waits for the device (loss, progress line) "
                 "every this many steps")
  p.add_argument("--peak-tflops", type=float, default=None,
                 help="device peak TFLOP/s for the MFU (default: the bf16 "
                 "dense peak of known GPUs)")
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
  p.add_argument("--doc-order", choices=("balanced", "packed"),
                 default="balanced",
                 help="balanced: each row's documents reordered so that "
                 "no_load_balance's contiguous chunks hold equal attention "
                 "work (dual_chunk_swap needs no reordering); packed: as "
                 "packed")
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


CPU_DP, CPU_CP = 2, 4   # the CPU default mesh (8 virtual devices)


def _configure_platform(argv: Sequence[str]) -> None:
  """Before jax is imported: GPU runs get the flags of ``xla_flags.py``,
  CPU runs virtual devices for the mesh."""
  args, _ = build_parser().parse_known_args(argv)
  if args.device == "gpu":
    xla_flags.add_gpu_flags()
    return
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  # Several processes: main() sets jax_num_cpu_devices (dp*cp/N) instead.
  if (_num_processes(args) <= 1
      and "xla_force_host_platform_device_count" not in flags):
    dp, cp = choose_mesh_shape(args.dp, args.cp, "cpu", None)
    n = max(8, dp * cp)
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={n}".strip())


def choose_mesh_shape(dp: int | None, cp: int | None, device: str,
                      num_devices: int | None,
                      batch: int | None = None) -> tuple[int, int]:
  """``(dp, cp)``: the values given, the rest chosen. On CPU ``2 x 4``; on
  GPU (``num_devices`` present) ``cp`` = all of them with ``dp`` = 1 (one
  long row per step gains most from context parallelism), or the other
  factor when one is given (a chosen ``dp`` also divides ``batch``)."""
  if device == "cpu" or num_devices is None:
    return (dp or CPU_DP, cp or CPU_CP)
  if dp is None and cp is None:
    return 1, num_devices
  if dp is None:
    dp = max(num_devices // cp, 1)
    return (math.gcd(dp, batch) if batch else dp), cp
  if cp is None:
    return dp, max(num_devices // dp, 1)
  return dp, cp


if __name__ == "__main__":
  _configure_platform(sys.argv[1:])

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
  import jax_cp
except ImportError:  # running from a checkout without installing
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import jax_cp
import multihost  # noqa: E402
import packed_data  # noqa: E402

import jax_cp.flax  # noqa: E402
import jax_cp.nnx  # noqa: E402

DATA, CP = "data", "cp"


class ByteEmbed(nn.Module):
  """Embedding of a small vocabulary as a one-hot matmul.

  ``tokens [..] -> [.., features]`` as ``one_hot(tokens) @ embedding``. A
  gather (``nn.Embed``) has a scatter-add as its backward: every token's
  gradient row is added into one of only 256 table rows, so the adds
  collide and serialise; for a row of 32k tokens that single scatter took
  29 % of a training step on an H200. As a matmul, the backward is
  ``one_hot^T @ dx``, a ``[256, T] x [T, features]`` GEMM, and the forward
  costs ``2 * T * 256 * features`` FLOPs, a small fraction of one layer's.

  Attributes:
    num_embeddings: vocabulary size.
    features: embedding width.
    dtype: computation dtype.
    param_dtype: dtype of the table.
  """

  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    table = self.param("embedding", nn.initializers.normal(stddev=1.0),
                       (self.num_embeddings, self.features), self.param_dtype)
    one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
    return one_hot @ table.astype(self.dtype)


def _pin(layout: jax_cp.CPLayout, x):
  """In the global view with CP, ``x [B, T, ...]`` constrained to the
  batch's sharding ``P(batch_axis, cp_axis)``."""
  if layout.mesh is None or layout.is_local or layout.cp_axis is None:
    return x
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(layout.mesh, P(layout.batch_axis, layout.cp_axis)))


class PackedLM(nn.Module):
  """Byte embedding, ``num_layers`` CP transformer layers, RMSNorm, logits
  (Flax Linen).

  In the global view, the activations between layers are pinned to the
  batch's sharding, ``P(batch_axis, cp_axis)``: every device keeps its own
  tokens from layer to layer, and sharded weights are gathered to the
  tokens rather than tokens to the weights.

  Attributes:
    num_layers: transformer layers.
    d_model: model width.
    num_heads: query heads.
    num_kv_heads: key/value heads.
    vocab_size: output classes (256 bytes).
    dtype: computation dtype (parameters are float32).
    layout: the :class:`jax_cp.CPLayout`, handed to every layer.
  """

  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  vocab_size: int = packed_data.VOCAB_SIZE
  dtype: jnp.dtype = jnp.float32
  layout: jax_cp.CPLayout = jax_cp.CPLayout(cp_axis=None)

  @nn.compact
  def __call__(self, tokens, cu_seqlens, cu_seqlens_padded, position_ids):
    pin = lambda x: _pin(self.layout, x)
    x = pin(ByteEmbed(self.vocab_size, self.d_model, dtype=self.dtype,
                      name="embed")(tokens))
    for i in range(self.num_layers):
      x = pin(jax_cp.flax.TransformerLayer(
          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
          dtype=self.dtype, layout=self.layout, name=f"layer_{i}")(
              x, cu_seqlens, cu_seqlens_padded, position_ids))
    x = nn.RMSNorm(dtype=self.dtype, name="final_norm")(x)
    return pin(nn.Dense(self.vocab_size, dtype=self.dtype,
                        name="logits")(x).astype(jnp.float32))


class NnxByteEmbed(nnx.Module):
  """:class:`ByteEmbed` in Flax NNX (the same ``embedding`` table)."""

  def __init__(self, num_embeddings: int, features: int, *,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.num_embeddings, self.dtype = num_embeddings, dtype
    self.embedding = nnx.Param(jax.random.normal(
        rngs.params(), (num_embeddings, features), jnp.float32))

  def __call__(self, tokens):
    one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
    return one_hot @ self.embedding[...].astype(self.dtype)


class NnxPackedLM(nnx.Module):
  """:class:`PackedLM` in Flax NNX: the same layers, parameter names and
  shapes (``embed``, ``layer_i``, ``final_norm``, ``logits``); the layout is
  static configuration of every layer."""

  def __init__(self, num_layers: int, d_model: int, num_heads: int,
               num_kv_heads: int, *, vocab_size: int = packed_data.VOCAB_SIZE,
               dtype=jnp.float32, layout: jax_cp.CPLayout, rngs: nnx.Rngs):
    self.num_layers, self.layout = num_layers, layout
    self.embed = NnxByteEmbed(vocab_size, d_model, dtype=dtype, rngs=rngs)
    for i in range(num_layers):
      setattr(self, f"layer_{i}", jax_cp.nnx.TransformerLayer(
          num_heads, d_model, num_kv_heads=num_kv_heads, dtype=dtype,
          layout=layout, rngs=rngs))
    self.final_norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
    self.logits = nnx.Linear(d_model, vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, cu_seqlens, cu_seqlens_padded, position_ids):
    pin = lambda x: _pin(self.layout, x)
    x = pin(self.embed(tokens))
    for i in range(self.num_layers):
      x = pin(getattr(self, f"layer_{i}")(x, cu_seqlens, cu_seqlens_padded,
                                          position_ids))
    return pin(self.logits(self.final_norm(x)).astype(jnp.float32))


class NnxModel:
  """An NNX model behind Linen's ``init``/``apply``: the training step,
  the optimizer, the FSDP shardings and the checkpoints are the same code
  for both APIs, and the parameters the same pure dicts
  (``{"params": {...}}``, Linen's names), so a checkpoint of one API
  restores into the other.

  ``make(rngs)`` builds the module; :meth:`apply` merges the parameters
  into its graph definition (where the static layout lives) and calls it.
  """

  def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], layout):
    self.make, self.layout = make, layout
    self.graphdef, self.abstract = nnx.split(
        nnx.eval_shape(lambda: make(nnx.Rngs(0))))

  def init(self, key, *args) -> dict:
    del args   # NNX modules know their shapes when built
    return {"params": nnx.to_pure_dict(nnx.state(self.make(nnx.Rngs(key)),
                                                 nnx.Param))}

  def apply(self, variables, *args):
    state = jax.tree.map(lambda x: x, self.abstract)   # a fresh copy
    nnx.replace_by_pure_dict(state, variables["params"])
    return nnx.merge(self.graphdef, state)(*args)


def make_layout(*, mesh=None, strategy: str = "dual_chunk_swap",
                backend: str = "auto", max_seqlen: int | None = None,
                cp_axis: str | None = CP) -> jax_cp.CPLayout:
  """The run's one layout: rows split over ``cp_axis`` of ``mesh`` (batch
  over ``data``) with ``strategy``; ``cp_axis=None``: no CP.

  Every batch is checked against ``max_seqlen`` on the host when it is
  built (:func:`place_batch`, :func:`host_batch`), so attention needs no
  in-graph check of the bound (``max_seqlen_violation="checked_on_host"``:
  no ``lax.cond`` per layer, each of which would make the host wait for the
  GPU)."""
  if cp_axis is None:
    return jax_cp.CPLayout(cp_axis=None, backend=backend,
                           max_seqlen=max_seqlen,
                           max_seqlen_violation="checked_on_host")
  return jax_cp.CPLayout(mesh=mesh, cp_axis=cp_axis, batch_axis=DATA,
                         strategy=strategy, backend=backend,
                         max_seqlen=max_seqlen,
                         max_seqlen_violation="checked_on_host")


def build_model(args, *, mesh=None, max_seqlen: int | None = None,
                cp_axis: str | None = CP):
  """The model of ``args`` (``api``, default ``"nnx"``; ``layers``,
  ``d_model``, ``heads``, ``kv_heads``, ``dtype``, ``backend``,
  ``strategy``): context parallel over ``cp_axis`` of ``mesh`` (batch over
  ``data``), or with ``cp_axis=None`` the plain model on one device. The one
  place where the model and its layout (``model.layout``, for
  :func:`place_batch`) are made. Either API's model has ``init`` and
  ``apply`` with the same parameters."""
  layout = make_layout(mesh=mesh, strategy=args.strategy,
                       backend=args.backend, max_seqlen=max_seqlen,
                       cp_axis=cp_axis)
  sizes = (args.layers, args.d_model, args.heads, args.kv_heads)
  dtype = jnp.dtype(args.dtype)
  api = getattr(args, "api", "nnx")
  if api == "linen":
    return PackedLM(*sizes, dtype=dtype, layout=layout)
  if api != "nnx":
    raise ValueError(f"api={api!r} is not one of ['nnx', 'linen']")
  return NnxModel(lambda rngs: NnxPackedLM(*sizes, dtype=dtype,
                                           layout=layout, rngs=rngs), layout)


def loss_fn(model, params, batch: jax_cp.CPBatch):
  """Mean next-byte cross entropy over the real targets of the batch (its
  metadata and layout go to the model as one argument; a batch laid out
  otherwise than the model's layout raises)."""
  t = batch.tensors
  logits = model.apply(params, t["tokens"], batch, None, t["position_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, t["labels"])
  mask = t["loss_mask"]
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def default_lr(d_model: int) -> float:
  """Peak learning rate ``min(3e-3, 0.6 / d_model)``: wider models take
  smaller steps (about 6e-4 at d_model 1024, 1.5e-4 at 4096, in line with
  the usual GPT-style settings), small CPU models keep 3e-3."""
  return min(3e-3, 0.6 / d_model)


def default_warmup(steps: int) -> int:
  """Linear warmup over 10 % of the run, at most 100 steps."""
  return max(1, min(100, steps // 10))


def make_optimizer(lr: float, warmup: int, steps: int
                   ) -> optax.GradientTransformation:
  """AdamW (``b2=0.95``, weight decay 0.01) after clipping the global
  gradient norm at 1.0; the learning rate rises linearly from 0 to ``lr``
  over ``warmup`` steps, then follows a cosine to ``lr / 10`` at ``steps``.

  Why: Adam's first steps divide by second-moment estimates built from a
  handful of gradients, so a large step size at step 1 throws the loss up
  (lr 3e-3 with 3 warmup steps took the 44 M-parameter model from 5.8 to
  14.4 by step 6); the warmup lets the estimates settle, the clipping
  bounds any single step, and ``b2=0.95`` lets the estimates follow the
  gradients' fast changes early in training. With the defaults (lr
  5.9e-4, 6 warmup steps of 60) that model's loss falls from 5.7 to 2.4 in
  50 steps on 2 H200s, without a rise."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.01))


def fsdp_spec(shape: Sequence[int], mesh) -> P:
  """The FSDP spec of one array: its first dimension divisible by the mesh
  size sharded over ``(data, cp)`` (every parameter sharded over the whole
  mesh, as MaxText's FSDP does); arrays with no such dimension (scalars,
  tiny vectors) are replicated.

  Why the first: NCCL gathers and scatters whole contiguous shards, so a
  parameter sharded along a later dimension costs a transpose of the
  gathered weight (or of its gradient) at every step. With the largest
  dimension sharded instead, the MLP's ``up`` kernel ``[d, 4d]`` and the
  attention's ``out`` kernel ``[heads, head_dim, d]`` were sharded along
  their last one, and this example's step at cp=2 on H200 ran two
  transposes a layer (``input_transpose_fusion``, 0.26 ms a step, in the
  ratio of those two kernels' sizes) that one GPU does not run."""
  n = mesh.shape[DATA] * mesh.shape[CP]
  if n == 1:
    return P()
  dims = [i for i, d in enumerate(shape) if d % n == 0]
  if not dims:
    return P()
  spec = [None] * len(shape)
  spec[dims[0]] = (DATA, CP)
  return P(*spec)


def state_shardings(abstract, mesh, mode: str = "fsdp"):
  """Shardings of a state tree (parameters, optimizer state, step) of
  ``jax.ShapeDtypeStruct`` leaves: :func:`fsdp_spec` per leaf for
  ``"fsdp"`` (Adam's moments are sharded like their parameter), one copy per
  device for ``"replicated"``."""
  if mode not in ("fsdp", "replicated"):
    raise ValueError(f"param sharding mode={mode!r} is not one of "
                     "['fsdp', 'replicated']")
  if mode == "replicated":
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
  return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(x.shape, mesh)),
                      abstract)


def init_state(model, tx, batch, seed: int, mesh,
               mode: str = "fsdp"):
  """``({step, params, opt_state}, shardings)``: the state initialised
  directly in its shardings (no full copy on one device first)."""
  def init(batch):
    t = batch.tensors
    params = model.init(jax.random.key(seed), t["tokens"], batch, None,
                        t["position_ids"])
    return {"step": jnp.int32(0), "params": params,
            "opt_state": tx.init(params)}
  shardings = state_shardings(jax.eval_shape(init, batch), mesh, mode)
  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)(batch)
  return state, shardings


def make_train_step(model, tx, shardings, mesh) -> Callable:
  """The jitted step ``(state, batch) -> (state, loss)``; the state is
  donated and keeps ``shardings``. The gradients are constrained to the
  parameters' shardings, so with FSDP each is reduce-scattered to its
  shard rather than all-reduced whole."""
  grad_shardings = shardings["params"]

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, batch))(state["params"])
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss

  return jax.jit(train_step, donate_argnums=0,
                 out_shardings=(shardings, NamedSharding(mesh, P())))


def matmul_params(params) -> int:
  """Parameters that take part in matmuls: all but the embedding table
  (whose one-hot product is counted as a lookup, as usual)."""
  total = sum(x.size for x in jax.tree.leaves(params))
  embed = sum(x.size for x in jax.tree.leaves(params["params"]["embed"]))
  return total - embed


def model_flops(cu_seqlens, *, tokens: int, n_params: int, num_layers: int,
                num_heads: int, head_dim: int) -> float:
  """Model FLOPs of one training step (forward + backward), without
  recomputation:

  * matmuls: ``6 * n_params * tokens`` (2 per multiply-add, forward 1x and
    backward 2x), ``tokens`` all the positions of the batch, padding
    included (the projections run on it);
  * attention, per layer, per document of valid length ``L`` (each row of
    ``cu_seqlens``), causal: ``pairs = L (L + 1) / 2`` query-key pairs;
    forward ``2 * 2 * pairs * num_heads * head_dim`` (``Q K^T`` and ``P V``),
    backward twice that, so ``12 * pairs * num_heads * head_dim``.

  ``cu_seqlens``: ``[B, N+1]`` cumulative valid lengths (host array)."""
  lens = np.diff(np.asarray(cu_seqlens, np.int64), axis=-1)
  pairs = float(np.sum(lens * (lens + 1) // 2))
  attn = 12.0 * pairs * num_heads * head_dim * num_layers
  return 6.0 * n_params * tokens + attn


# bf16 dense peak TFLOP/s per device, by device kind (vendor spec sheets).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0,
                    "B200": 2250.0}


def peak_tflops(device) -> float | None:
  """The bf16 dense peak of ``device``'s kind, or ``None`` if unknown."""
  kind = getattr(device, "device_kind", "")
  for name, tflops in PEAK_BF16_TFLOPS.items():
    if name in kind:
      return tflops
  return None


def prefetched(make: Callable[[int], dict], steps: Iterable[int],
               depth: int) -> Iterator[dict]:
  """``make(step)`` for each of ``steps``, in order, with up to ``depth``
  of them built ahead on a host thread (``depth=0``: built in the loop).
  The batches are the same either way; only when they are built changes."""
  if depth <= 0:
    for step in steps:
      yield make(step)
    return
  it = iter(steps)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    ahead = collections.deque(pool.submit(make, s)
                              for _, s in zip(range(depth), it))
    while ahead:
      batch = ahead.popleft().result()
      nxt = next(it, None)
      if nxt is not None:
        ahead.append(pool.submit(make, nxt))
      yield batch


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


def place_batch(rows: packed_data.PackedRows, layout: jax_cp.CPLayout,
                local: np.ndarray) -> jax_cp.CPBatch:
  """Global view on the layout's mesh from *this process's* rows ``local``
  (global row indices of :func:`jax_cp.process_batch_rows`): a
  :class:`jax_cp.CPBatch` of token arrays ``[B, T]`` in the layout
  (:func:`jax_cp.reorder_for_cp` order, sharded ``P(data, cp)``; each
  device gets only its cp slice) and metadata ``[B, N+1]`` sharded
  ``P(data)``, carrying ``layout``. ``rows`` is the whole global batch in
  physical order; only ``rows[local]`` is read."""
  mine = {k: v[local] for k, v in rows.as_dict().items()}
  return jax_cp.make_global_batch(
      {k: mine[k] for k in packed_data.PackedRows.TOKEN_FIELDS},
      mine["cu_seqlens_padded"], layout, cu_seqlens=mine["cu_seqlens"],
      global_batch_size=rows.num_rows)


def host_batch(rows: packed_data.PackedRows,
               layout: jax_cp.CPLayout) -> jax_cp.CPBatch:
  """The rows on the host, whole and in physical order: the batch of a
  model without CP (``layout.cp_axis is None``)."""
  if layout.cp_axis is not None:
    raise ValueError("host_batch is the batch of a layout without CP")
  d = rows.as_dict()
  if layout.max_seqlen is not None:
    jax_cp.partition.check_max_seqlen_bound(d["cu_seqlens_padded"],
                                            layout.max_seqlen)
  return jax_cp.CPBatch(
      tensors={k: d[k] for k in packed_data.PackedRows.TOKEN_FIELDS},
      cu_seqlens_padded=d["cu_seqlens_padded"], cu_seqlens=d["cu_seqlens"],
      layout=layout)


#: Test-only hook (the recovery test): the save of the step named here
#: SIGKILLs the process once every file of the checkpoint is written and
#: before orbax commits it (the rename of its temporary directory).
KILL_IN_SAVE_ENV = "JAX_CP_EXAMPLE_KILL_IN_SAVE"


def _kill_in_save_hook(ocp):
  """With ``$JAX_CP_EXAMPLE_KILL_IN_SAVE`` set, orbax's atomic-rename
  temporary path, killing the process at the commit of that step; else
  None (orbax's default)."""
  step = os.environ.get(KILL_IN_SAVE_ENV)
  if not step:
    return None

  class KillBeforeCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
    async def finalize(self, *args, **kwargs):
      if self.get_final().name == step:
        os.kill(os.getpid(), signal.SIGKILL)
      return await super().finalize(*args, **kwargs)

  return KillBeforeCommit


class Checkpointer:
  """Orbax checkpoints of ``{step, params, opt_state}`` plus the run's
  config (a resumed run must use the same model and data settings).

  With several processes, the directory must be shared by all of them (one
  path on a shared file system, or the same local directory for processes
  of one machine): orbax writes every shard of the state once (each
  process its own) and synchronises the processes itself;
  ``run_config.json`` is read by every process before process 0 writes it.
  The parameter sharding is not part of the config: a state saved with
  ``--param-sharding fsdp`` restores into ``replicated`` and back."""

  _KEYS = ("layers", "d_model", "heads", "kv_heads", "seq_len", "batch",
           "seed", "strategy", "max_doc_len", "doc_order")

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
      old.setdefault("doc_order", "packed")   # runs saved before the option
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
            max_to_keep=2, create=True,
            temporary_path_class=_kill_in_save_hook(ocp)))
    self._last_saved = self.manager.latest_step()

  def latest_step(self) -> int | None:
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


def _progress(step: int, total: int, loss: float, tok_s: float,
              mfu: float | None) -> str:
  width = 30
  done = int(width * step / max(total, 1))
  util = f" MFU {mfu:.1%}" if mfu is not None else ""
  return (f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total} "
          f"loss {loss:.4f} {tok_s:,.0f} tok/s{util}")


def main(argv: Sequence[str] | None = None) -> dict:
  """Trains and returns ``{"losses": [...], "start_step", "eval_loss_cp",
  "eval_loss_nocp", "tokens_per_s", "mfu", "local_rows", ...}`` (losses of
  the steps run here; ``eval_loss_nocp`` on process 0 only; ``local_rows``:
  the rows of each global batch that this process loads)."""
  args = build_parser().parse_args(argv)
  if args.max_doc_len is None:
    args.max_doc_len = args.seq_len // 2
  if args.strategy != "no_load_balance":
    args.doc_order = "packed"   # DUAL_CHUNK_SWAP's work ignores the order
  # Several processes: jax.distributed first, before any device query.
  n_proc = _num_processes(args)
  cpu_devices = None
  if n_proc > 1 and args.device == "cpu":
    args.dp, args.cp = choose_mesh_shape(args.dp, args.cp, "cpu", None)
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
  chosen = (args.dp is None, args.cp is None)
  args.dp, args.cp = choose_mesh_shape(args.dp, args.cp, args.device,
                                       jax.device_count(), args.batch)
  if args.batch % args.dp:
    raise SystemExit(f"--batch {args.batch} must be divisible by --dp "
                     f"{args.dp}")
  lr = args.lr if args.lr is not None else default_lr(args.d_model)
  warmup = (args.warmup if args.warmup is not None
            else default_warmup(args.steps))
  is_main = jax.process_index() == 0
  log = print if is_main and not args.quiet else (lambda *a, **k: None)
  if any(chosen):
    log(f"mesh: dp={args.dp} x cp={args.cp} chosen for the "
        f"{jax.device_count()} {args.device.upper()} devices present "
        "(set --dp/--cp to choose)")
  mesh = make_mesh(args.dp, args.cp, args.device)
  # The rows of every global batch that this process loads: those of the
  # data shards its devices hold (all of them when dp == 1).
  local = jax_cp.process_batch_rows(mesh, args.batch, DATA)

  # Data: row i is the same whatever --steps is, so a resumed run continues
  # on the batches it has not seen.
  rows = packed_data.load_stdlib_rows(
      args.steps * args.batch, args.seq_len, cp_size=args.cp,
      strategy=args.strategy, seed=args.seed, max_doc_len=args.max_doc_len,
      balance=args.doc_order == "balanced")
  max_seqlen = args.max_seqlen or rows.max_seqlen
  # Every process makes the same rows (same seed) but passes on only its
  # own (place_batch). Global view: make_global_batch puts the tokens in
  # the layout's reorder_for_cp order, so that a contiguous split over the
  # cp axis gives every rank its strategy's tokens, and hands each device
  # only its slice (jax_cp.get_batch_on_this_cp_rank). (A per-rank model
  # would instead use layout.replace(view="local") inside a shard_map.)
  docs = int((np.diff(rows.cu_seqlens, axis=1) > 0).sum())
  log(f"data: {rows.num_rows} rows x {rows.seq_len} tokens, {docs} documents "
      f"from the stdlib, max_seqlen={max_seqlen}, "
      f"{rows.loss_mask.mean():.1%} real targets"
      + (f", documents in {args.doc_order} order"
         if args.strategy == "no_load_balance" else ""))

  model = build_model(args, mesh=mesh, max_seqlen=max_seqlen)
  tx = make_optimizer(lr, warmup, args.steps)

  def batch_at(step: int):
    # The metadata are global arrays too: arguments of the jitted step (a
    # jit cannot close over arrays spanning other processes).
    return place_batch(rows.rows(step * args.batch, (step + 1) * args.batch),
                       model.layout, local)

  ckpt = (Checkpointer(args.checkpoint_dir, args, args.checkpoint_every)
          if args.checkpoint_dir else None)
  with jax.set_mesh(mesh):
    start = 0
    state, shardings = init_state(model, tx, batch_at(0), args.seed, mesh,
                                  args.param_sharding)
    if ckpt is not None and ckpt.latest_step() is not None:
      abstract = jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          state, shardings)
      del state
      state = ckpt.restore(abstract)
      start = int(state["step"])
      log(f"resuming at step {start} from the checkpoint in {ckpt.path}"
          + ("" if start < args.steps else " (nothing left to train)"))
    step_fn = make_train_step(model, tx, shardings, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    head_dim = args.d_model // args.heads
    tokens_per_step = args.batch * args.seq_len
    peak = args.peak_tflops or peak_tflops(jax.devices()[0])

    n_matmul = matmul_params(state["params"])

    def step_flops(step: int) -> float:
      cu = rows.cu_seqlens[step * args.batch:(step + 1) * args.batch]
      return model_flops(cu, tokens=tokens_per_step, n_params=n_matmul,
                         num_layers=args.layers, num_heads=args.heads,
                         head_dim=head_dim)

    log(f"model ({args.api}): {args.layers} layers, d_model {args.d_model}, "
        f"{args.heads} heads / {args.kv_heads} kv heads, {n_params:,} params"
        f" ({args.param_sharding}); mesh dp={args.dp} x cp={args.cp} "
        f"({args.strategy}), {args.dtype}, backend {args.backend}; AdamW lr "
        f"{lr:.2e}, {warmup} warmup steps, cosine decay, clip 1.0")
    if jax.process_count() > 1:
      groups = [sorted({d.process_index for d in g}) for g in mesh.devices]
      log(f"{jax.process_count()} processes x "
          f"{mesh.size // jax.process_count()} "
          f"devices; processes of each cp group: {groups}; process 0 loads "
          f"rows {local.tolist()} of each batch")
    loss_arrays: list[jax.Array] = []
    # Timing from the end of the first step (compilation) to the last
    # wait; the steps in between run back to back.
    t_start = time.perf_counter()
    t_timed, timed_flops, timed_tokens, tok_s, mfu = None, 0.0, 0, 0.0, None
    last_step = start
    for step, batch in zip(range(start, args.steps),
                           prefetched(batch_at, range(start, args.steps),
                                      args.prefetch)):
      state, loss = step_fn(state, batch)
      loss_arrays.append(loss)
      if t_timed is not None:
        timed_tokens += tokens_per_step
        timed_flops += step_flops(step)
      if ckpt is not None:
        ckpt.save(step + 1, state)
      last_step = step + 1
      wait = (step == start or (step + 1 - start) % args.log_every == 0
              or step + 1 == args.steps)
      if not wait:
        continue
      value = float(loss.addressable_data(0))   # waits for the device
      now = time.perf_counter()
      if t_timed is None:        # the first step includes compilation
        t_timed = now
      elif now > t_timed:
        tok_s = timed_tokens / (now - t_timed)
        if peak:
          mfu = timed_flops / (now - t_timed) / (peak * 1e12 * mesh.size)
      if is_main and not args.quiet:
        print(_progress(last_step, args.steps, value, tok_s, mfu), end="",
              flush=True)
    losses = [float(x.addressable_data(0)) for x in loss_arrays]
    if is_main and not args.quiet and losses:
      print()
    if ckpt is not None:
      if losses:
        ckpt.save(args.steps, state, force=True)
      ckpt.close()
    wall = time.perf_counter() - t_start

    # The same final parameters on the last batch, with and without CP.
    last = max(args.steps - 1, 0)
    eval_loss_cp = eval_loss_nocp = None
    if not args.no_compare:
      eval_loss_cp = float(jax.jit(lambda p, b: loss_fn(model, p, b))(
          state["params"], batch_at(last)).addressable_data(0))
      # Every process takes part in gathering the (sharded) parameters.
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      full_params = multihost_utils.process_allgather(state["params"],
                                                      tiled=True)
  if not args.no_compare and is_main:
    # Process 0 alone, on one device, with the whole parameters.
    nocp_model = build_model(args, max_seqlen=max_seqlen, cp_axis=None)
    last_rows = host_batch(rows.rows(last * args.batch,
                                     (last + 1) * args.batch),
                           nocp_model.layout)
    eval_loss_nocp = float(jax.jit(lambda p, b: loss_fn(nocp_model, p, b))(
        full_params, last_rows))

  if losses:
    k = min(10, len(losses))
    util = f", MFU {mfu:.1%}" if mfu is not None else ""
    log(f"trained steps {start}..{args.steps - 1} in {wall:.1f}s: loss "
        f"{losses[0]:.4f} -> {losses[-1]:.4f} (mean of last {k}: "
        f"{np.mean(losses[-k:]):.4f}); {tok_s:,.0f} tok/s after compilation"
        f"{util}")
  if eval_loss_nocp is not None:
    rel = abs(eval_loss_cp - eval_loss_nocp) / max(abs(eval_loss_nocp), 1e-12)
    log(f"final params on the last batch (step {last}): loss with CP (dp="
        f"{args.dp} x cp={args.cp}, {args.strategy}) {eval_loss_cp:.6f} vs "
        f"without CP (cp_axis=None, one device, same params and batch) "
        f"{eval_loss_nocp:.6f}: relative difference {rel:.2e}")
  result = {"losses": losses, "start_step": start, "steps": args.steps,
            "eval_loss_cp": eval_loss_cp, "eval_loss_nocp": eval_loss_nocp,
            "tokens_per_s": tok_s, "mfu": mfu, "max_seqlen": max_seqlen,
            "dp": args.dp, "cp": args.cp, "lr": lr, "warmup": warmup,
            "param_sharding": args.param_sharding, "api": args.api,
            "strategy": args.strategy, "doc_order": args.doc_order,
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
