"""Training: loss, optimizer, sharded state (FSDP), step, and the loop with
its progress bar and model FLOP utilisation (MFU)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import optax
import tqdm
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from examples.packed_lm.config import Config
from examples.packed_lm.lm_loss import token_losses
from examples.packed_lm.model import PackedLM

# bf16 dense peak TFLOP/s per device, by device kind (vendor spec sheets).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0,
                    "B200": 2250.0}


def peak_tflops(device) -> float | None:
  """The bf16 dense peak of ``device``'s kind, or ``None`` if unknown."""
  return next((v for k, v in PEAK_BF16_TFLOPS.items()
               if k in device.device_kind), None)


def loss_fn(model: PackedLM, batch: jax_cp.CPBatch):
  """Mean next-byte cross entropy over the batch's real targets; the
  logits and their softmax one chunk of tokens at a time (never the whole
  ``[B, T, 256]`` float32 logits, forward or backward)."""
  mask = batch.tensors["loss_mask"]
  ce = token_losses(model, batch)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW on gradients clipped at norm 1; a linear warmup to ``cfg.lr``,
  then a cosine to ``lr / 10``."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.01))


def _stacked(path) -> bool:
  """A parameter (or its optimizer state) of the scanned layers: its
  leading axis is the layer's."""
  return any(getattr(k, "key", getattr(k, "name", None)) == "layers"
             for k in path)


def param_spec(shape, mesh, mode: str = "fsdp", stacked: bool = False) -> P:
  """FSDP: the first dimension the mesh size divides (NCCL gathers
  contiguous shards) over all the mesh's axes (``data`` and the cp ones),
  never a ``stacked`` parameter's layer axis; else, or replicated:
  ``P()``."""
  if mode not in ("fsdp", "replicated"):
    raise ValueError(f"param sharding mode={mode!r} is not one of "
                     "['fsdp', 'replicated']")
  n = mesh.size
  dims = [i for i, d in enumerate(shape) if d % n == 0 and not (
      stacked and i == 0)]
  if mode == "replicated" or n == 1 or not dims:
    return P()
  return P(*[tuple(mesh.axis_names) if i == dims[0] else None
             for i in range(len(shape))])


def init_state(cfg: Config, layout: jax_cp.CPLayout, tx, mesh, *,
               abstract: bool = False):
  """``(graphdef, state, shardings)`` of the model and its optimizer
  (with ``abstract``, the state as ``jax.ShapeDtypeStruct`` with its
  shardings, for compiling on devices that hold no data)."""
  def create():
    model = PackedLM(cfg, layout, rngs=nnx.Rngs(cfg.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, shapes = nnx.split(nnx.eval_shape(create))
  shardings = jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(
      mesh, param_spec(x.shape, mesh, cfg.param_sharding,
                       stacked=_stacked(path))), shapes)
  if abstract:
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=s), shapes, shardings)
  else:
    state = jax.jit(lambda: nnx.split(create())[1],
                    out_shardings=shardings)()
  return graphdef, state, shardings


def make_train_step(graphdef, shardings, mesh, mode: str = "fsdp"
                    ) -> Callable:
  """The jitted ``(state, batch) -> (state, loss)``; each gradient takes
  its parameter's sharding (FSDP: reduce-scattered, not all-reduced)."""
  pin = lambda path, g: jax.lax.with_sharding_constraint(
      g, NamedSharding(mesh, param_spec(g.shape, mesh, mode,
                                        stacked=_stacked(path))))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, jax.tree_util.tree_map_with_path(pin, grads))
    return nnx.state((model, optimizer)), loss

  return jax.jit(step, donate_argnums=0,
                 out_shardings=(shardings, NamedSharding(mesh, P())))


def evaluate(model: PackedLM, batch: jax_cp.CPBatch) -> float:
  """The loss of ``model`` on ``batch``."""
  return float(nnx.jit(loss_fn)(model, batch).addressable_data(0))


def train_loop(cfg: Config, step_fn, state, batches: Iterable, *,
               start: int, step_flops: Callable[[int], float],
               peak_flops: float | None, checkpointer=None,
               show: bool = True):
  """Steps ``start .. cfg.steps - 1``, waiting for the device every
  ``cfg.log_every``: ``(state, losses, tokens_per_s, mfu)``. The losses
  of the steps since the last wait stay device arrays (``pending``) and
  become floats at each wait, so host memory does not grow with the
  steps by an array object per step."""
  losses, pending, tok_s, mfu, flops = [], [], 0.0, None, 0.0
  bar = tqdm.tqdm(total=cfg.steps, initial=start, disable=not show,
                  unit="step", dynamic_ncols=True)
  for step, batch in zip(range(start, cfg.steps), batches):
    state, loss = step_fn(state, batch)
    pending.append(loss)
    done = step + 1
    if checkpointer is not None:
      checkpointer.save(done, state)
    if step > start:   # timed: the steps after the first (compilation)
      flops += step_flops(step)
      if (done - start) % cfg.log_every and done < cfg.steps:
        continue
    losses += [float(x.addressable_data(0)) for x in pending]  # waits
    pending.clear()
    value = losses[-1]
    if step == start:
      t0 = time.perf_counter()
    elif (dt := time.perf_counter() - t0) > 0:
      tok_s = (step - start) * cfg.batch * cfg.seq_len / dt
      mfu = peak_flops and flops / dt / peak_flops
    bar.set_postfix_str(f"loss {value:.4f}, {tok_s:,.0f} tok/s" + (
        f", MFU {mfu:.1%}" if mfu else ""), refresh=False)
    bar.update(done - bar.n)
  bar.close()
  return state, losses + [float(x.addressable_data(0)) for x in pending], \
      tok_s, mfu
