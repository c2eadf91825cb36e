"""Training: loss, optimizer, sharded state (FSDP), step, and the loop
with its progress bar and model FLOP utilisation (MFU)."""

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
from examples.packed_lm.model import CP, DATA, PackedLM

# bf16 dense peak TFLOP/s per device, by device kind (vendor spec sheets).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0,
                    "B200": 2250.0}


def peak_tflops(device) -> float | None:
  """The bf16 dense peak of ``device``'s kind, or ``None`` if unknown."""
  kind = getattr(device, "device_kind", "")
  return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)


def loss_fn(model: PackedLM, batch: jax_cp.CPBatch):
  """Mean next-byte cross entropy over the real targets of the batch."""
  t = batch.tensors
  ce = optax.softmax_cross_entropy_with_integer_labels(model(batch),
                                                       t["labels"])
  return jnp.sum(ce * t["loss_mask"]) / jnp.maximum(jnp.sum(t["loss_mask"]),
                                                    1.0)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW (``b2=0.95``, weight decay 0.01) after clipping the gradient
  norm at 1.0; linear warmup to ``cfg.lr`` (Adam's first second-moment
  estimates are poor: without it the loss jumps), then a cosine to
  ``lr / 10``."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.01))


def param_spec(shape, mesh, mode: str = "fsdp") -> P:
  """FSDP: the first dimension divisible by the mesh size sharded over
  ``(data, cp)`` (every parameter over the whole mesh); arrays with none
  (scalars, small vectors), and ``mode="replicated"``: one copy per device.
  The first, not the largest: NCCL gathers contiguous shards, so a later
  dimension costs a transpose of the gathered weight at every step."""
  if mode not in ("fsdp", "replicated"):
    raise ValueError(f"param sharding mode={mode!r} is not one of "
                     "['fsdp', 'replicated']")
  n = mesh.shape[DATA] * mesh.shape[CP]
  dims = [i for i, d in enumerate(shape) if d % n == 0]
  if mode == "replicated" or n == 1 or not dims:
    return P()
  return P(*[(DATA, CP) if i == dims[0] else None
             for i in range(len(shape))])


def init_state(cfg: Config, layout: jax_cp.CPLayout, tx, mesh):
  """``(graphdef, state, shardings)`` of the model (``state[0]``) and its
  ``nnx.Optimizer`` (``state[1]``), created in its shardings (Adam's
  moments like their parameters; no full copy on one device first)."""
  def create():
    model = PackedLM(cfg, layout, rngs=nnx.Rngs(cfg.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  shardings = jax.tree.map(lambda x: NamedSharding(
      mesh, param_spec(x.shape, mesh, cfg.param_sharding)), abstract)
  state = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
  return graphdef, state, shardings


def make_train_step(graphdef, shardings, mesh, mode: str = "fsdp"
                    ) -> Callable:
  """The jitted step ``(state, batch) -> (state, loss)``; the state is
  donated and keeps ``shardings``. Gradients are constrained to their
  parameters' shardings: with FSDP each is reduce-scattered to its shard,
  not all-reduced whole."""
  def pin(g):
    return jax.lax.with_sharding_constraint(
        g, NamedSharding(mesh, param_spec(g.shape, mesh, mode)))

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, jax.tree.map(pin, grads))
    return nnx.state((model, optimizer)), loss

  return jax.jit(step, donate_argnums=0,
                 out_shardings=(shardings, NamedSharding(mesh, P())))


def evaluate(graphdef, params, batch) -> float:
  """The loss on ``batch`` of the model ``graphdef`` (of any layout) with
  ``params``."""
  loss = jax.jit(lambda p, b: loss_fn(nnx.merge(graphdef, p), b))(params,
                                                                  batch)
  return float(loss.addressable_data(0))


def train_loop(cfg: Config, step_fn, state, batches: Iterable, *,
               start: int, step_flops: Callable[[int], float],
               peak_flops: float | None, checkpointer=None,
               show: bool = True):
  """Steps ``start .. cfg.steps - 1``; returns ``(state, losses,
  tokens_per_s, mfu)``. The host waits for the device every
  ``cfg.log_every`` steps only. Tokens/s and MFU (``step_flops(step)`` over
  ``peak_flops``, the whole mesh's FLOP/s) are timed from the end of the
  first step (compilation) to the last wait."""
  losses, tok_s, mfu = [], 0.0, None
  t_timed, timed_flops, timed_tokens = None, 0.0, 0
  bar = tqdm.tqdm(total=cfg.steps, initial=start, disable=not show,
                  unit="step", dynamic_ncols=True)
  for step, batch in zip(range(start, cfg.steps), batches):
    state, loss = step_fn(state, batch)
    losses.append(loss)
    if t_timed is not None:
      timed_tokens += cfg.batch * cfg.seq_len
      timed_flops += step_flops(step)
    if checkpointer is not None:
      checkpointer.save(step + 1, state)
    done = step + 1
    if step != start and (done - start) % cfg.log_every and done < cfg.steps:
      continue
    value = float(loss.addressable_data(0))   # waits for the device
    now = time.perf_counter()
    if t_timed is None:
      t_timed = now
    elif now > t_timed:
      tok_s = timed_tokens / (now - t_timed)
      if peak_flops:
        mfu = timed_flops / (now - t_timed) / peak_flops
    bar.set_postfix_str(f"loss {value:.4f}, {tok_s:,.0f} tok/s" + (
        f", MFU {mfu:.1%}" if mfu is not None else ""), refresh=False)
    bar.update(done - bar.n)
  bar.close()
  return state, [float(x.addressable_data(0)) for x in losses], tok_s, mfu
