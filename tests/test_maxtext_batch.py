"""A MaxText-format packed batch (``inputs``, ``inputs_segmentation``,
``inputs_position``, ``targets``, ``targets_segmentation``) trains through
jax_cp with one conversion call.

The example's NNX model takes a CP step (cp=4, both strategies) on the
converted batch; its loss and gradients equal those of the same documents
packed by :func:`jax_cp.data.pack_documents`, and those of the model
without CP on the MaxText rows as they are (no padding needed there, so no
token moves). ``jax_cp.cp_attention_fn`` in Flax's own attention, fed the
converted metadata, gives on every token what Flax's default attention
gives with the mask written in the segment-id convention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_cp
from examples.packed_lm import config, model, train
from jax_cp import CPLayout, data
from tests._devices import devices, requires_devices

B, T, CP = 2, 64, 4


def _documents(seed, multiple):
  """Per row, byte documents in slots of multiples of 8 that fill the row
  exactly, each shorter than its slot by less than ``multiple``."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(B):
    slots, left = [], T
    while left:
      s = min(left, 8 * int(rng.integers(1, 4)))
      slots.append(s)
      left -= s
    rows.append([rng.integers(1, 256, int(rng.integers(
        max(2, s - multiple + 1), s + 1))).astype(np.int32) for s in slots])
  return rows


def _maxtext_batch(docs):
  """MaxText's packed format: documents back to back, trailing padding;
  ``targets`` the next token of the same document, whose segmentation
  marks the positions that have one."""
  batch = {k: np.zeros((B, T), np.int32) for k in (
      "inputs", "inputs_segmentation", "inputs_position", "targets",
      "targets_segmentation")}
  for r, row in enumerate(docs):
    c = 0
    for i, d in enumerate(row):
      n = d.size
      batch["inputs"][r, c:c + n] = d
      batch["inputs_segmentation"][r, c:c + n] = i + 1
      batch["inputs_position"][r, c:c + n] = np.arange(n)
      batch["targets"][r, c:c + n - 1] = d[1:]
      batch["targets_segmentation"][r, c:c + n - 1] = i + 1
      c += n
  return batch


def _convert(batch, pad_multiple):
  """The one conversion call."""
  return data.rows_from_segment_ids(
      batch["inputs_segmentation"], batch["inputs"], batch["targets"],
      positions=batch["inputs_position"],
      loss_mask=batch["targets_segmentation"] != 0,
      pad_multiple=pad_multiple, max_docs=16)


def _loss_and_grads(cfg, layout, rows, mesh):
  lm = model.PackedLM(cfg, layout, rngs=nnx.Rngs(0))
  batch = data.make_global_batch(rows.tensors, rows.cu_seqlens_padded,
                                 layout, cu_seqlens=rows.cu_seqlens)
  step = nnx.jit(nnx.value_and_grad(train.loss_fn))
  if mesh is None:
    loss, grads = step(lm, batch)
  else:
    with jax.set_mesh(mesh):
      loss, grads = step(lm, batch)
  return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@requires_devices(CP)
@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance"])
def test_maxtext_batch_trains_like_packed_documents(strategy):
  cfg = config.Config(layers=1, d_model=32, heads=2, kv_heads=1, seq_len=T,
                      batch=B, strategy=strategy, backend="xla")
  mesh = jax.make_mesh((1, CP), (model.DATA, model.CP), devices=devices(CP),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  layout = model.make_layout(cfg, mesh, T)
  multiple = data.pad_multiple_for(layout)
  docs = _documents(3, multiple)
  batch = _maxtext_batch(docs)

  rows = _convert(batch, multiple)
  packed = data.pack_documents([d for row in docs for d in row], T, B,
                               multiple, max_docs=16)
  for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
            "cu_seqlens_padded"):
    np.testing.assert_array_equal(getattr(rows, k), getattr(packed, k), k)
  if strategy == "dual_chunk_swap":     # documents were re-laid
    assert not np.array_equal(rows.tokens, batch["inputs"])

  loss, grads = _loss_and_grads(cfg, layout, rows, mesh)
  want_loss, want_grads = _loss_and_grads(cfg, layout, packed, mesh)
  assert loss == want_loss
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)

  # Without CP, on the MaxText rows as they are (nothing to pad): the same
  # loss and gradients up to the order of the sums.
  as_is = _convert(batch, 1)
  np.testing.assert_array_equal(as_is.tokens, batch["inputs"])
  nocp_loss, nocp_grads = _loss_and_grads(
      cfg, model.make_layout(cfg, None, T), as_is, None)
  assert loss == pytest.approx(nocp_loss, rel=1e-5)
  assert np.isfinite(loss) and loss > 1.0
  def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())
  jax.tree.map(close, grads, nocp_grads)


@requires_devices(2 * CP)
@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance"])
def test_cp_attention_fn_on_segment_id_metadata(strategy):
  e, h = 16, 2
  mesh = jax.make_mesh((2, CP), ("data", "cp"), devices=devices(2 * CP))
  layout = CPLayout(mesh=mesh, strategy=strategy, batch_axis="data",
                    backend="xla")
  batch = _maxtext_batch(_documents(11, 8))
  seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
  rows = _convert(batch, data.pad_multiple_for(layout))
  x = np.random.default_rng(0).standard_normal((B, T, e)).astype(np.float32)
  # The caller's activations, placed like their tokens in the packed rows.
  index = data.segment_index(seg, rows.cu_seqlens, rows.cu_seqlens_padded)
  x_rows = np.zeros_like(x)
  for r in range(B):
    v = index[r] >= 0
    x_rows[r, index[r, v]] = x[r, v]

  mha = nnx.MultiHeadAttention(h, e, qkv_features=e, use_bias=False,
                               decode=False, rngs=nnx.Rngs(0),
                               attention_fn=jax_cp.cp_attention_fn(layout))
  cp_batch = data.make_global_batch(dict(x=x_rows), rows.cu_seqlens_padded,
                                    layout, cu_seqlens=rows.cu_seqlens)
  with jax.set_mesh(mesh):
    out = nnx.jit(lambda m, b: m(b.tensors["x"], mask=b))(mha, cp_batch)
  got = data.to_segment_layout(
      data.restore_from_cp(np.asarray(out), rows.cu_seqlens_padded,
                           layout, seq_dim=1), seg, rows)

  dense = nnx.MultiHeadAttention(h, e, qkv_features=e, use_bias=False,
                                 decode=False, rngs=nnx.Rngs(1))
  nnx.update(dense, nnx.state(mha, nnx.Param))
  mask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
          & (pos[:, None, :] <= pos[:, :, None]))[:, None]
  want = np.asarray(dense(jnp.asarray(x), mask=mask))
  valid = seg != 0
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
  assert (got[~valid] == 0).all()
