"""Real batches meet the library: MaxText's trailing padding, a CPBatch
under ``jit`` given inputs of another length, and one ``seq_dim``
convention across the data functions.

* Trailing padding (one empty slot, valid length 0, of any padded length)
  never counts against ``max_seqlen``: a MaxText-style batch with any
  amount of it runs with ``max_seqlen`` equal to its longest document,
  every output and q/k/v gradient equal to plain masked attention in
  float64 on the unpartitioned rows (both strategies, the halo and the
  DUAL_CHUNK_SWAP chunking, eager and under ``jit``).
* A real overlong document raises, naming the row, the slot and its
  valid and padded lengths.
* A :class:`jax_cp.CPBatch` under ``jit`` checks q/k/v's token count and
  rows against its static shapes before any kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import data
from tests import reference
from tests._devices import requires_devices

HQ, HKV, D = 4, 2, 16


def _maxtext_segments(rng, rows: int, t: int, longest: int):
  """Segment ids ``[rows, t]``: documents of 1..``longest`` tokens back to
  back, then trailing padding of a random amount (one row all padding but
  its first document when ``rows`` > 2). Every row's longest document is
  at most ``longest``, and one of them is exactly that long."""
  seg = np.zeros((rows, t), np.int32)
  for r in range(rows):
    fill = int(rng.integers(longest + 1, t // 2)) if r != 2 else 7
    c, d = 0, 1
    while c < fill:
      n = min(int(rng.integers(1, longest + 1)), fill - c)
      seg[r, c:c + n] = d
      c, d = c + n, d + 1
  seg[0, :longest] = 1          # the longest document, at the row's start
  seg[0, longest] = 2 if seg[0, longest] == 1 else seg[0, longest]
  return seg


def _reference(q, k, v, cu, cuP):
  """float64 masked attention on the unpartitioned rows, and its
  gradients of ``sum(out * w)``."""
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))

    def loss(q, k, v, w):
      return jnp.sum(reference.batched_attention(q, k, v, cu, cuP) * w)

    return q64, k64, v64, loss


def _restore(x, cuP, layout):
  return np.asarray(data.restore_from_cp(x, cuP, layout))


@requires_devices(8)
@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
# Under jit (the in-graph guard of a host-checked batch); eagerly the same
# program runs op by op, over a minute on two CPU cores.
@pytest.mark.parametrize("jit", [True])
def test_trailing_padding_trains_at_the_longest_document(strategy, jit):
  rng = np.random.default_rng(0 if strategy == "no_load_balance" else 1)
  cp, t, longest = 4, 128, 20
  mesh = jax.make_mesh((2, cp), ("data", "cp"))
  layout0 = jax_cp.CPLayout(mesh=mesh, batch_axis="data", strategy=strategy)
  multiple = data.pad_multiple_for(layout0)
  seg = _maxtext_segments(rng, 4, t, longest)
  tokens = rng.integers(1, 256, seg.shape) * (seg > 0)
  rows = data.rows_from_segment_ids(seg, tokens, pad_multiple=multiple)
  bound = data.longest_padded_document(rows.cu_seqlens_padded,
                                       rows.cu_seqlens)
  # The bound is the longest document (rounded up to the strategy's
  # padding), far below the trailing padding of most rows.
  assert bound == -(-longest // multiple) * multiple
  assert data.longest_padded_document(rows.cu_seqlens_padded) > 2 * bound
  layout = layout0.replace(max_seqlen=bound)
  x = rng.standard_normal((4, t, HQ + 2 * HKV, D)).astype(np.float32)
  batch = data.make_global_batch({"x": x}, rows.cu_seqlens_padded, layout,
                                 cu_seqlens=rows.cu_seqlens)
  assert batch.checked_max_seqlen == bound and batch.total_tokens == t
  w = rng.standard_normal((4, t, HQ, D)).astype(np.float32)
  w_cp = data.make_global_batch({"w": w}, rows.cu_seqlens_padded, layout,
                                cu_seqlens=rows.cu_seqlens).tensors["w"]

  def loss(xx, ww, b):
    q, k, v = jnp.split(xx, [HQ, HQ + HKV], axis=2)
    return jnp.sum(jax_cp.cp_attention(q, k, v, b) * ww)

  f = jax.value_and_grad(loss)
  with jax.set_mesh(mesh):
    if jit:
      f = jax.jit(f)
    val, g = f(batch.tensors["x"], w_cp, batch)
  g = _restore(g, rows.cu_seqlens_padded, layout)

  q64, k64, v64, ref_loss = _reference(
      x[:, :, :HQ], x[:, :, HQ:HQ + HKV], x[:, :, HQ + HKV:],
      rows.cu_seqlens, rows.cu_seqlens_padded)
  with jax.enable_x64(True):
    ref_val, ref_g = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(
        q64, k64, v64, jnp.asarray(w, jnp.float64))
  assert np.isfinite(float(val))
  np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5)
  got = np.split(g, [HQ, HQ + HKV], axis=2)
  valid = np.stack([reference.valid_token_mask(c, p) for c, p in zip(
      rows.cu_seqlens, rows.cu_seqlens_padded)])
  for name, a, b in zip("qkv", got, ref_g):
    b = np.asarray(b)
    assert np.isfinite(a).all(), name
    err = np.abs(a - b)[valid].max() / np.abs(b[valid]).max()
    assert err < 1e-4, (name, err)


@requires_devices(8)
def test_all_padding_row_and_empty_slots_pass_the_bound():
  """A row of padding alone (one empty slot of T tokens) and a row of one
  short document pass a bound of that document's length."""
  mesh = jax.make_mesh((2, 4), ("data", "cp"))
  layout = jax_cp.CPLayout(mesh=mesh, batch_axis="data",
                           strategy="no_load_balance", max_seqlen=5)
  seg = np.zeros((2, 64), np.int32)
  seg[1, :5] = 1
  rows = data.rows_from_segment_ids(seg, seg * 3)
  batch = data.make_global_batch(rows.tensors, rows.cu_seqlens_padded,
                                 layout, cu_seqlens=rows.cu_seqlens)
  assert batch.checked_max_seqlen == 5
  # Without the valid lengths every padded slot counts, as before.
  with pytest.raises(ValueError, match="cu_seqlens not given"):
    data.make_global_batch(rows.tensors, rows.cu_seqlens_padded, layout)


@pytest.mark.parametrize("strategy,valid,padded", [
    ("no_load_balance", 33, 33), ("dual_chunk_swap", 33, 40)])
def test_an_overlong_document_names_row_slot_and_lengths(strategy, valid,
                                                         padded):
  layout = jax_cp.CPLayout(cp_size=4, strategy=strategy, max_seqlen=32)
  seg = np.zeros((2, 128), np.int32)
  seg[0, :10] = 1
  seg[1, :3], seg[1, 3:3 + valid] = 1, 2
  rows = data.rows_from_segment_ids(
      seg, seg + 1, pad_multiple=data.pad_multiple_for(layout))
  with pytest.raises(ValueError) as e:
    data.get_batch_on_this_cp_rank(
        rows.cu_seqlens_padded, rows.tokens, layout=layout, cp_rank=0,
        cu_seqlens=rows.cu_seqlens)
  msg = str(e.value)
  assert "max_seqlen=32" in msg and "slot 1 of row 1" in msg, msg
  assert f"valid length {valid}" in msg and f"padded length {padded}" in msg


def test_dual_chunk_swap_counts_a_padded_slot_that_holds_tokens():
  """DUAL_CHUNK_SWAP cuts a slot by its padded length: a short document in
  a long slot counts with the slot (its chunks are that long); the same
  slot empty does not."""
  cu = np.array([[0, 3, 3]])
  cuP = np.array([[0, 48, 64]])
  layout = jax_cp.CPLayout(cp_size=2, strategy="dual_chunk_swap",
                           max_seqlen=16)
  with pytest.raises(ValueError, match="padded length 48"):
    data.get_batch_on_this_cp_rank(cuP, np.zeros((1, 64)), layout=layout,
                                   cp_rank=0, cu_seqlens=cu)
  nlb = layout.replace(strategy="no_load_balance")
  data.get_batch_on_this_cp_rank(cuP, np.zeros((1, 64)), layout=nlb,
                                 cp_rank=0, cu_seqlens=cu)


@requires_devices(4)
@pytest.mark.parametrize("t_in", [32, 128])
def test_batch_under_jit_checks_the_token_count(t_in):
  """q/k/v of another length than the batch's rows raise under jit (the
  metadata are traced there), before any kernel."""
  mesh = jax.make_mesh((4,), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, strategy="dual_chunk_swap")
  cu = np.array([[0, 40, 56]], np.int32)
  cuP = np.array([[0, 48, 64]], np.int32)
  batch = data.make_global_batch(np.zeros((1, 64, 2), np.float32), cuP,
                                 layout, cu_seqlens=cu)
  q = jnp.ones((1, t_in, 2, 8), jnp.float32)
  with jax.set_mesh(mesh), pytest.raises(
      ValueError, match=f"{t_in} tokens per row.*batch's rows have 64"):
    jax.jit(lambda q, b: jax_cp.cp_attention(q, q, q, b))(q, batch)
  q2 = jnp.ones((2, 64, 2, 8), jnp.float32)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="rows"):
    jax.jit(lambda q, b: jax_cp.cp_attention(q, q, q, b))(q2, batch)


@requires_devices(4)
def test_module_under_jit_checks_the_batch_token_count():
  from flax import nnx

  import jax_cp.nnx
  mesh = jax.make_mesh((4,), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, strategy="dual_chunk_swap")
  cuP = np.array([[0, 64]], np.int32)
  batch = data.make_global_batch(np.zeros((1, 64, 2), np.float32), cuP,
                                 layout, cu_seqlens=cuP)
  layer = jax_cp.nnx.TransformerLayer(2, 16, layout=layout,
                                      rngs=nnx.Rngs(0))
  x = jnp.ones((1, 128, 16), jnp.float32)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="128 tokens"):
    nnx.jit(lambda m, x, b: m(x, b))(layer, x, batch)


def test_seq_dim_defaults_follow_the_metadata():
  """Batched metadata: tokens on dim 1 by default in every data function;
  unbatched: dim 0; a wrong count names seq_dim."""
  layout = jax_cp.CPLayout(cp_size=2, strategy="dual_chunk_swap")
  cuP = np.array([[0, 8, 16], [0, 4, 16]], np.int32)
  x = np.random.default_rng(0).standard_normal((2, 16, 3))
  y = data.reorder_for_cp(x, cuP, layout)
  np.testing.assert_array_equal(
      y, data.reorder_for_cp(x, cuP, layout, seq_dim=1))
  np.testing.assert_array_equal(data.restore_from_cp(y, cuP, layout), x)
  parts = data.get_batch_on_this_cp_rank(cuP, x, layout=layout, cp_rank=1)
  np.testing.assert_array_equal(parts[0], y[:, 8:])
  np.testing.assert_array_equal(
      data.reorder_for_cp(x[0], cuP[0], layout),
      data.reorder_for_cp(x[0], cuP[0], layout, seq_dim=0))
  with pytest.raises(ValueError, match="seq_dim=1"):
    data.reorder_for_cp(x[:, :8], cuP, layout)
  with pytest.raises(ValueError, match="seq_dim=0"):
    data.restore_from_cp(x, cuP[0], layout)
