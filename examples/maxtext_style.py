"""A MaxText-style Flax Linen decoder, trained context parallel by jax_cp.

docs/model.md walks through it. The model is written as for one device:
an embedding, ``nn.scan`` over decoder layers (RMSNorm, GQA attention with
rotary positions, a gated MLP), a final norm and the logits. Two things
make it context parallel: its attention op is :func:`jax_cp.cp_attention`,
and every per-token input it reads (tokens, positions, labels, loss mask)
comes from the batch, in the layout's token order; nothing in the model
makes positions with ``arange`` or labels by shifting the tokens.

The data are a MaxText-style batch (``inputs``, ``inputs_segmentation``,
``inputs_position``, ``targets``, ``targets_segmentation``): documents back
to back, each row ending in its own amount of padding. Four calls take it
to a training step (:func:`cp_batch`, :func:`make_train_step`)::

  rows = jax_cp.data.rows_from_segment_ids(...)         # 1. packed rows
  batch = jax_cp.data.make_global_batch(...)            # 2. on the mesh
  Decoder(cfg, attention_op=jax_cp.cp_attention)        # 3. CP attention
  with jax.set_mesh(mesh): state = step(state, batch)   # 4. the jitted step

Run it on 8 virtual CPU devices (data 2 x cp 4)::

  python -m examples.maxtext_style [--strategy no_load_balance] [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":  # 8 virtual CPU devices, set before JAX starts
  os.environ.setdefault("XLA_FLAGS",
                        "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cp  # noqa: E402

DATA, CP = "data", "cp"

# Documents per row of a batch: rows end in 13, 25, 41 and 61 tokens of
# padding (64 tokens a row); the last row is one short document.
DOC_LENGTHS = ((15, 13, 6, 17), (30, 9), (11, 5, 7), (3,))
SEQ_LEN = 64


@dataclasses.dataclass(frozen=True)
class Config:
  """The decoder's sizes."""

  vocab_size: int = 64
  emb_dim: int = 32
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8
  mlp_dim: int = 64
  num_layers: int = 2
  rope_theta: float = 10000.0


# ------------------------------------------------------------------ model


def rotary(x, positions, theta: float):
  """Rotary position embedding of ``x [B, T, H, D]`` at ``positions
  [B, T]``: each token's position in its document, from the batch."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x.dtype)


class Embed(nn.Module):
  """Token embedding. On a mesh of ``Explicit`` axes (``jax.make_mesh``'s
  default) a lookup says where its output goes: with the ids' tokens."""

  vocab_size: int
  features: int

  @nn.compact
  def __call__(self, ids):
    table = self.param("embedding", nn.initializers.normal(1.0),
                       (self.vocab_size, self.features))
    return table.at[ids].get(out_sharding=jax.typeof(ids).sharding)


class DecoderLayer(nn.Module):
  """Pre-norm layer: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

  ``attention_op(q, k, v, metadata)`` is the attention: q ``[B, T, Hq,
  D]``, k and v ``[B, T, Hkv, D]``, causal within each document
  (:func:`jax_cp.cp_attention` with a :class:`jax_cp.CPBatch` as
  ``metadata``)."""

  cfg: Config
  attention_op: Callable

  @nn.compact
  def __call__(self, x, positions, metadata):
    cfg = self.cfg
    dense = lambda heads, name: nn.DenseGeneral(
        (heads, cfg.head_dim), use_bias=False, name=name)
    h = nn.RMSNorm(name="pre_self_attention_norm")(x)
    q = rotary(dense(cfg.num_heads, "query")(h), positions, cfg.rope_theta)
    k = rotary(dense(cfg.num_kv_heads, "key")(h), positions, cfg.rope_theta)
    v = dense(cfg.num_kv_heads, "value")(h)
    attn = self.attention_op(q, k, v, metadata)
    x = x + nn.DenseGeneral(cfg.emb_dim, axis=(-2, -1), use_bias=False,
                            name="out")(attn)
    h = nn.RMSNorm(name="post_self_attention_norm")(x)
    gate = nn.Dense(cfg.mlp_dim, use_bias=False, name="wi_0")(h)
    up = nn.Dense(cfg.mlp_dim, use_bias=False, name="wi_1")(h)
    x = x + nn.Dense(cfg.emb_dim, use_bias=False, name="wo")(
        nn.silu(gate) * up)
    return x, None


class Decoder(nn.Module):
  """Embedding, ``nn.scan`` over ``num_layers`` decoder layers (their
  parameters stacked on a leading axis), final norm, logits."""

  cfg: Config
  attention_op: Callable

  @nn.compact
  def __call__(self, tokens, positions, metadata):
    cfg = self.cfg
    x = Embed(cfg.vocab_size, cfg.emb_dim, name="token_embedder")(tokens)
    layers = nn.scan(DecoderLayer, variable_axes={"params": 0},
                     split_rngs={"params": True},
                     in_axes=(nn.broadcast, nn.broadcast),
                     length=cfg.num_layers)
    x, _ = layers(cfg, self.attention_op, name="layers")(x, positions,
                                                         metadata)
    x = nn.RMSNorm(name="decoder_norm")(x)
    return nn.Dense(cfg.vocab_size, use_bias=False, name="logits_dense")(x)


def cross_entropy(logits, labels, mask):
  """Mean cross entropy over the tokens where ``mask`` is 1. A one-hot
  product, not a gather: on ``Explicit`` axes it needs no sharding of its
  own."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  ce = -jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1)
  return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_fn(params, model: Decoder, batch: jax_cp.CPBatch):
  """The CP loss: tokens, positions, labels and loss mask all from the
  batch, in the layout's token order."""
  t = batch.tensors
  logits = model.apply({"params": params}, t["tokens"], t["position_ids"],
                       batch)
  return cross_entropy(logits, t["labels"], t["loss_mask"])


# ------------------------------------------------------------------- data


def maxtext_batch(seed: int, vocab_size: int = Config.vocab_size,
                  doc_lengths=DOC_LENGTHS, seq_len: int = SEQ_LEN) -> dict:
  """A batch in MaxText's packed format: documents back to back from each
  row's start, trailing padding (segment id 0); ``targets`` the next token
  of the same document, marked by ``targets_segmentation``."""
  rng = np.random.default_rng(seed)
  keys = ("inputs", "inputs_segmentation", "inputs_position", "targets",
          "targets_segmentation")
  out = {k: np.zeros((len(doc_lengths), seq_len), np.int32) for k in keys}
  for r, lengths in enumerate(doc_lengths):
    start = 0
    for i, n in enumerate(lengths):
      doc = rng.integers(1, vocab_size, n)
      s = slice(start, start + n)
      out["inputs"][r, s] = doc
      out["inputs_segmentation"][r, s] = i + 1
      out["inputs_position"][r, s] = np.arange(n)
      out["targets"][r, start:start + n - 1] = doc[1:]
      out["targets_segmentation"][r, start:start + n - 1] = i + 1
      start += n
  return out


def make_layout(mesh, strategy: str, doc_lengths=DOC_LENGTHS
                ) -> jax_cp.CPLayout:
  """Rows over ``cp``, batch over ``data``, ``max_seqlen`` the longest
  document of the batches (rounded up to DUAL_CHUNK_SWAP's padding)."""
  cp = mesh.shape[CP]
  longest = max(max(row) for row in doc_lengths)
  if strategy == "dual_chunk_swap":
    longest = -(-longest // (2 * cp)) * 2 * cp
  return jax_cp.CPLayout(mesh=mesh, cp_axis=CP, batch_axis=DATA,
                         strategy=strategy, max_seqlen=longest)


def cp_batch(mt: dict, layout: jax_cp.CPLayout) -> jax_cp.CPBatch:
  """Calls 1 and 2: the MaxText batch as packed rows for the layout (each
  document padded to its multiple; MaxText's targets move with their
  tokens), then this process's rows on the mesh in the layout's order."""
  rows = jax_cp.data.rows_from_segment_ids(
      mt["inputs_segmentation"], mt["inputs"], mt["targets"],
      positions=mt["inputs_position"],
      loss_mask=mt["targets_segmentation"] != 0,
      pad_multiple=jax_cp.data.pad_multiple_for(layout),
      max_docs=8)   # fixed for the run: one compiled step for every batch
  return jax_cp.data.make_global_batch(
      rows.tensors, rows.cu_seqlens_padded, layout,
      cu_seqlens=rows.cu_seqlens)


# ---------------------------------------------------------------- training


@dataclasses.dataclass(frozen=True)
class TrainState:
  """Parameters and optimizer state (a pytree)."""

  params: Any
  opt_state: Any


jax.tree_util.register_dataclass(TrainState, ["params", "opt_state"], [])


def make_train_step(model: Decoder, optimizer: optax.GradientTransformation):
  """Call 4: ``step(state, batch) -> (state, loss)``, jitted; call it
  under ``jax.set_mesh(mesh)``."""
  @jax.jit
  def step(state: TrainState, batch: jax_cp.CPBatch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, model, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state,
                                          state.params)
    return TrainState(optax.apply_updates(state.params, updates),
                      opt_state), loss
  return step


def init_params(model: Decoder, seed: int = 0):
  """The parameters, from a single-device forward on a dummy row (no CP:
  initialization runs no attention worth a mesh)."""
  x = jnp.zeros((1, 8), jnp.int32)
  def no_attention(q, k, v, metadata):
    del k, v, metadata
    return q
  init_model = Decoder(model.cfg, attention_op=no_attention)
  return jax.jit(init_model.init)(jax.random.key(seed), x, x, None)[
      "params"]


def main(argv: list[str] | None = None) -> list[float]:
  """Trains a few steps on one MaxText-style batch (the loss falls as the
  model learns it); returns the losses."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--strategy", default="no_load_balance",
                      choices=["no_load_balance", "dual_chunk_swap"])
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args(argv)
  mesh = jax.make_mesh((2, 4), (DATA, CP))
  layout = make_layout(mesh, args.strategy)
  cfg = Config()
  model = Decoder(cfg, attention_op=jax_cp.cp_attention)
  optimizer = optax.adamw(1e-2)
  params = init_params(model)
  # Replicated on the mesh, as the step returns it: one compile.
  state = jax.device_put(TrainState(params, optimizer.init(params)),
                         jax.sharding.NamedSharding(mesh, P()))
  step = make_train_step(model, optimizer)
  batch = cp_batch(maxtext_batch(0, cfg.vocab_size), layout)
  losses = []
  for i in range(args.steps):
    with jax.set_mesh(mesh):
      state, loss = step(state, batch)
    losses.append(float(loss))
    print(f"step {i}: loss {losses[-1]:.4f}")
  return losses


if __name__ == "__main__":
  main()
