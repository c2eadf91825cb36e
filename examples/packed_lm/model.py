"""The model (Flax NNX): byte embedding, :class:`jax_cp.nnx.TransformerLayer`
s, RMSNorm and logits; and the run's :class:`jax_cp.CPLayout`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jax_cp.nnx
from examples.packed_lm.config import Config

DATA, CP = "data", "cp"
#: The two cp axes of ``comm_type="all_to_all+ring"`` (``--cp-inner``).
CP_OUTER, CP_INNER = "cp_outer", "cp_inner"
VOCAB_SIZE = 256   # bytes


def cp_axis(cfg: Config) -> str | tuple[str, str]:
  """The layout's ``cp_axis``: ``cp``, or ``(cp_outer, cp_inner)`` with
  ``cfg.cp_inner``."""
  return CP if cfg.cp_inner is None else (CP_OUTER, CP_INNER)


def mesh_shape(cfg: Config, dp: int, cp: int) -> dict[str, int]:
  """The mesh's axes and sizes: ``data`` and :func:`cp_axis`'s."""
  if cfg.cp_inner is None:
    return {DATA: dp, CP: cp}
  if cfg.cp_inner < 1 or cp % cfg.cp_inner:
    raise ValueError(f"cp_inner={cfg.cp_inner} does not divide cp={cp}")
  return {DATA: dp, CP_OUTER: cp // cfg.cp_inner, CP_INNER: cfg.cp_inner}


def make_layout(cfg: Config, mesh=None,
                max_seqlen: int | None = None) -> jax_cp.CPLayout:
  """Rows over ``cp`` of ``mesh``, batch over ``data``; ``mesh=None``: no
  CP. ``max_seqlen`` is checked on the host when a batch is built
  (``jax_cp.data.make_global_batch``), so the steps trust it."""
  cp = (dict(cp_axis=None) if mesh is None else
        dict(mesh=mesh, cp_axis=cp_axis(cfg), batch_axis=DATA,
             strategy=cfg.strategy, comm_type=cfg.comm_type))
  return jax_cp.CPLayout(backend=cfg.backend, max_seqlen=max_seqlen, **cp)


class PackedLM(nnx.Module):
  """Float32 parameters, ``cfg.dtype`` computation; the activations keep
  the batch's sharding (weights are gathered to the tokens, not vice versa)."""

  def __init__(self, cfg: Config, layout: jax_cp.CPLayout, *,
               rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.num_layers, self.layout, self.dtype = cfg.layers, layout, dtype
    self.embed = nnx.Embed(VOCAB_SIZE, cfg.d_model, rngs=rngs,
                           embedding_init=nnx.initializers.normal(1.0))
    make = lambda rngs: jax_cp.nnx.TransformerLayer(
        cfg.heads, cfg.d_model, num_kv_heads=cfg.kv_heads, dtype=dtype,
        layout=layout, remat=cfg.remat, mlp_chunk_size=cfg.mlp_chunk_size,
        layer_chunk_size=cfg.layer_chunk_size, rngs=rngs)
    self.scan_layers = cfg.scan_layers
    if cfg.scan_layers:
      # One layer's parameters stacked on a leading axis of num_layers.
      self.layers = nnx.split_rngs(splits=cfg.layers)(
          nnx.vmap(make, in_axes=0, out_axes=0))(rngs)
    else:
      for i in range(cfg.layers):
        setattr(self, f"layer_{i}", make(rngs))
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.logits = nnx.Linear(cfg.d_model, VOCAB_SIZE, dtype=dtype,
                             rngs=rngs)

  def hidden_states(self, batch: jax_cp.CPBatch):
    """``[B, T, d_model]``: the layers' output, before the final norm."""
    pin, t = self.layout.shard_tokens, batch.tensors
    # A one-hot matmul: a gather's backward scatter-adds into 256 rows and
    # colliding adds serialise (29 % of a 32k-token H200 step); this is a GEMM.
    one_hot = jax.nn.one_hot(t["tokens"], VOCAB_SIZE, dtype=self.dtype)
    x = pin(one_hot @ self.embed.embedding[...].astype(self.dtype))
    if self.scan_layers:
      # A loop over the stacked layers: XLA schedules one layer's body.
      def body(layer, x):
        return pin(layer(x, batch, None, t["position_ids"]))
      return nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(
          self.layers, x)
    for i in range(self.num_layers):
      x = pin(getattr(self, f"layer_{i}")(x, batch, None,
                                          t["position_ids"]))
    return x

  def __call__(self, batch: jax_cp.CPBatch):
    """float32 logits ``[B, T, 256]`` of the batch's ``tokens``."""
    x = self.hidden_states(batch)
    return self.layout.shard_tokens(
        self.logits(self.final_norm(x)).astype(jnp.float32))


def matmul_params(model: PackedLM) -> int:
  """The parameters of matmuls: all but the embedding (a lookup)."""
  count = lambda m: sum(x.size for x in jax.tree.leaves(
      nnx.state(m, nnx.Param)))
  return count(model) - count(model.embed)
