"""The MaxText-style Linen decoder of examples/maxtext_style.py
(docs/model.md): fed a MaxText batch whose rows end in different amounts
of padding, one of them a single short document, it trains at data 2 x
cp 4 under both strategies with ``max_seqlen`` the longest document, and
its CP loss and gradients equal those of the same parameters on the
MaxText batch as it is, with plain masked attention on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from examples import maxtext_style as ex
from tests import reference as ref
from tests._devices import devices, requires_devices

CFG = ex.Config()


def dense_attention(q, k, v, segments):
  """Plain attention, float32: causal within each document of the
  segment-id convention ``(segment_ids, positions)``; 0 on padding."""
  seg, pos = segments
  rep = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  mask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
          & (pos[:, None, :] <= pos[:, :, None]))
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return jnp.where((seg != 0)[:, :, None, None], out, 0.0)


def reference_loss(params, mt):
  """The same decoder without CP on the MaxText batch as it is: its own
  positions, targets and target segmentation."""
  model = ex.Decoder(CFG, attention_op=dense_attention)
  seg, pos = mt["inputs_segmentation"], mt["inputs_position"]
  logits = model.apply({"params": params}, mt["inputs"], pos, (seg, pos))
  return ex.cross_entropy(logits, mt["targets"],
                          mt["targets_segmentation"] != 0)


def test_the_batch_has_trailing_padding_of_every_amount():
  mt = ex.maxtext_batch(0)
  pads = (mt["inputs_segmentation"] == 0).sum(axis=1)
  assert pads.tolist() == [13, 25, 41, 61]
  assert (mt["inputs"][mt["inputs_segmentation"] > 0] > 0).all()


@pytest.fixture(scope="module")
def reference():
  """The batch, the parameters, and the loss and gradients without CP."""
  mt = ex.maxtext_batch(7)
  params = ex.init_params(ex.Decoder(CFG, attention_op=dense_attention),
                          seed=1)
  loss, grads = jax.jit(jax.value_and_grad(reference_loss))(params, mt)
  return mt, params, float(loss), grads


@requires_devices(8)
@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
def test_cp_loss_and_gradients_equal_the_model_without_cp(strategy,
                                                          reference):
  mt, params, want_loss, want_grads = reference
  mesh = jax.make_mesh((2, 4), (ex.DATA, ex.CP), devices=devices(8))
  layout = ex.make_layout(mesh, strategy)
  # max_seqlen: the longest document (30), rounded up to 2*cp = 8 tokens
  # under DUAL_CHUNK_SWAP; the rows' trailing padding is longer.
  assert layout.max_seqlen == {"no_load_balance": 30,
                               "dual_chunk_swap": 32}[strategy]
  batch = ex.cp_batch(mt, layout)
  assert batch.checked_max_seqlen == layout.max_seqlen
  pads = (mt["inputs_segmentation"] == 0).sum(axis=1)
  assert pads.max() > layout.max_seqlen
  model = ex.Decoder(CFG, attention_op=jax_cp.cp_attention)
  with jax.set_mesh(mesh):
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, b: ex.loss_fn(p, model, b)))(params, batch)
  assert np.isfinite(float(loss)) and float(loss) > 1.0
  assert float(loss) == pytest.approx(want_loss, rel=1e-5)
  flat = jax.tree_util.tree_leaves_with_path(grads)
  want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
  assert len(flat) == len(want) == 12
  for path, g in flat:
    assert np.abs(np.asarray(want[path])).max() > 0, path
    assert ref.rel_err(g, want[path]) < 1e-5, (
        jax.tree_util.keystr(path), ref.rel_err(g, want[path]))


@requires_devices(8)
def test_main_trains():
  losses = ex.main(["--steps", "4"])
  assert len(losses) == 4 and all(np.isfinite(losses))
  assert losses[-1] < losses[0]
