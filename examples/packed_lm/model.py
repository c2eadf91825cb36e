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
  """Rows split over ``cp`` of ``mesh`` (batch over ``data``) with the
  strategy; ``mesh=None``: no CP, one device. Every batch is checked
  against ``max_seqlen`` on the host when it is built
  (:func:`jax_cp.make_global_batch`), so attention needs no in-graph check
  (no ``lax.cond`` per layer, which would make the host wait for the GPU).
  """
  kw = dict(backend=cfg.backend, max_seqlen=max_seqlen,
            max_seqlen_violation="checked_on_host")
  if mesh is None:
    return jax_cp.CPLayout(cp_axis=None, **kw)
  return jax_cp.CPLayout(mesh=mesh, cp_axis=CP, batch_axis=DATA,
                         strategy=cfg.strategy, **kw)


class ByteEmbed(nnx.Module):
  """Embedding of a small vocabulary as a one-hot matmul.

  A gather's backward is a scatter-add of every token's gradient into one
  of only 256 table rows: the adds collide and serialise (29 % of a step
  of 32k tokens on an H200). As a matmul the backward is a ``[256, T] x [T,
  features]`` GEMM, and the forward a small fraction of one layer's FLOPs.
  """

  def __init__(self, num_embeddings: int, features: int, *, dtype,
               rngs: nnx.Rngs):
    self.num_embeddings, self.dtype = num_embeddings, dtype
    self.embedding = nnx.Param(jax.random.normal(
        rngs.params(), (num_embeddings, features), jnp.float32))

  def __call__(self, tokens):
    one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
    return one_hot @ self.embedding[...].astype(self.dtype)


class PackedLM(nnx.Module):
  """``embed``, ``layer_0 .. layer_{n-1}``, ``final_norm``, ``logits``.

  Parameters are float32, computation in ``cfg.dtype``. In the global view
  the activations between layers keep the batch's sharding
  (:meth:`jax_cp.CPLayout.shard_tokens`): every device keeps its own
  tokens, and sharded weights are gathered to them.
  """

  def __init__(self, cfg: Config, layout: jax_cp.CPLayout, *,
               rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_layers, self.layout = cfg.layers, layout
    self.embed = ByteEmbed(VOCAB_SIZE, cfg.d_model, dtype=dtype, rngs=rngs)
    remat = {} if cfg.remat == "none" else {"remat": cfg.remat}
    for i in range(cfg.layers):
      setattr(self, f"layer_{i}", jax_cp.nnx.TransformerLayer(
          cfg.heads, cfg.d_model, num_kv_heads=cfg.kv_heads, dtype=dtype,
          layout=layout, rngs=rngs, **remat))
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
