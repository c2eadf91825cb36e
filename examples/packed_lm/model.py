"""The model: a byte embedding, :class:`jax_cp.nnx.TransformerLayer` s,
RMSNorm and logits (Flax NNX), and the run's one :class:`jax_cp.CPLayout`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jax_cp
import jax_cp.nnx
from examples.packed_lm.config import Config

DATA, CP = "data", "cp"
VOCAB_SIZE = 256   # bytes


def make_layout(cfg: Config, mesh=None,
                max_seqlen: int | None = None) -> jax_cp.CPLayout:
  """Rows over ``cp`` of ``mesh``, batch over ``data``; ``mesh=None``: no
  CP. ``max_seqlen`` is checked on the host when a batch is built
  (:func:`jax_cp.make_global_batch`): no in-graph ``cond`` per layer."""
  kw = dict(backend=cfg.backend, max_seqlen=max_seqlen,
            max_seqlen_violation="checked_on_host")
  if mesh is None:
    return jax_cp.CPLayout(cp_axis=None, **kw)
  return jax_cp.CPLayout(mesh=mesh, cp_axis=CP, batch_axis=DATA,
                         strategy=cfg.strategy, **kw)


class ByteEmbed(nnx.Module):
  """Embedding as a one-hot matmul: a gather's backward scatter-adds every
  token's gradient into one of 256 rows, adds that collide and serialise
  (29 % of a 32k-token step on an H200); the matmul's is one GEMM."""

  def __init__(self, num_embeddings: int, features: int, *, dtype,
               rngs: nnx.Rngs):
    self.num_embeddings, self.dtype = num_embeddings, dtype
    self.embedding = nnx.Param(jax.random.normal(
        rngs.params(), (num_embeddings, features), jnp.float32))

  def __call__(self, tokens):
    one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
    return one_hot @ self.embedding[...].astype(self.dtype)


class PackedLM(nnx.Module):
  """``embed``, ``layer_0 .. layer_{n-1}``, ``final_norm``, ``logits``;
  float32 parameters, ``cfg.dtype`` computation. Between layers the
  activations keep the batch's sharding (:meth:`CPLayout.shard_tokens`):
  sharded weights are gathered to the tokens, not tokens to weights."""

  def __init__(self, cfg: Config, layout: jax_cp.CPLayout, *,
               rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_layers, self.layout = cfg.layers, layout
    self.embed = ByteEmbed(VOCAB_SIZE, cfg.d_model, dtype=dtype, rngs=rngs)
    for i in range(cfg.layers):
      setattr(self, f"layer_{i}", jax_cp.nnx.TransformerLayer(
          cfg.heads, cfg.d_model, num_kv_heads=cfg.kv_heads, dtype=dtype,
          layout=layout, remat=cfg.remat, rngs=rngs))
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.logits = nnx.Linear(cfg.d_model, VOCAB_SIZE, dtype=dtype,
                             rngs=rngs)

  def __call__(self, batch: jax_cp.CPBatch):
    """Logits ``[B, T, 256]`` (float32) of a batch's ``tokens``."""
    pin, t = self.layout.shard_tokens, batch.tensors
    x = pin(self.embed(t["tokens"]))
    for i in range(self.num_layers):
      x = pin(getattr(self, f"layer_{i}")(x, batch, None,
                                          t["position_ids"]))
    return pin(self.logits(self.final_norm(x)).astype(jnp.float32))


def matmul_params(model: nnx.Module) -> int:
  """Parameters that take part in matmuls: all but the embedding table
  (whose one-hot product counts as a lookup, as usual)."""
  count = lambda m: sum(x.size for x in jax.tree.leaves(
      nnx.state(m, nnx.Param)))
  return count(model) - count(model.embed)
