"""jax_cp.data's packing (documents into rows with a strategy's padding,
balanced document order) and make_global_batch without CP
(cp_axis=None)."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp import CPLayout
from jax_cp.data import (
  balance_rows,
  make_global_batch,
  pack_documents,
  pad_multiple_for,
)
from jax_cp.planning import estimate_cp_imbalance
from tests._devices import devices


def _docs(seed: int, n: int = 40, high: int = 90):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 256, size=int(rng.integers(1, high)))
          for _ in range(n)]


def _documents(rows, r) -> list[bytes]:
  """The documents of row ``r``, sorted."""
  cu, cuP = rows.cu_seqlens[r], rows.cu_seqlens_padded[r]
  return sorted(rows.tokens[r, cuP[b]:cuP[b] + cu[b + 1] - cu[b]].tobytes()
                for b in range(len(cu) - 1))


def _check_rows(rows, docs, pad_multiple):
  """Every row well formed, and its documents, in order, the input
  documents (split ones as consecutive pieces)."""
  cu, cuP = rows.cu_seqlens, rows.cu_seqlens_padded
  lens, plens = np.diff(cu, axis=1), np.diff(cuP, axis=1)
  assert (cuP[:, -1] == rows.seq_len).all()
  assert (lens <= plens).all() and (plens % pad_multiple == 0).all()
  assert (plens - lens < pad_multiple).all()          # minimal padding
  stream = []
  for r in range(rows.num_rows):
    for b in np.nonzero(plens[r])[0]:
      s, n = cuP[r, b], lens[r, b]
      doc = rows.tokens[r, s:s + n]
      stream.append(doc)
      np.testing.assert_array_equal(rows.labels[r, s:s + n - 1], doc[1:])
      assert rows.loss_mask[r, s:s + n - 1].all()
      assert not rows.loss_mask[r, s + n - 1:cuP[r, b + 1]].any()
      assert (rows.tokens[r, s + n:cuP[r, b + 1]] == 0).all()
      np.testing.assert_array_equal(rows.position_ids[r, s:s + n],
                                    np.arange(n))
  flat = np.concatenate(stream)
  np.testing.assert_array_equal(flat, np.concatenate(docs)[:flat.size])


@pytest.mark.parametrize("strategy, cp, multiple", [
    ("dual_chunk_swap", 4, 8), ("no_load_balance", 4, 1),
    ("dual_chunk_swap", 1, 2)])
def test_pack_documents_pads_for_the_strategy(strategy, cp, multiple):
  assert pad_multiple_for(CPLayout(cp_size=cp, strategy=strategy)) == multiple
  docs = _docs(cp)
  rows = pack_documents(iter(docs), 128, 5, multiple)
  _check_rows(rows, docs, multiple)
  assert rows.cu_seqlens.shape[1] % 8 == 1          # slots: multiple of 8
  # Row i does not depend on the number of rows.
  np.testing.assert_array_equal(
      pack_documents(iter(docs), 128, 2, multiple).tokens,
      rows.tokens[:2])
  assert rows[1:3].num_rows == 2 and rows[np.array([4])].tokens.shape == (
      1, 128)


def test_long_documents_are_split_across_rows():
  docs = [np.arange(1, 101), np.arange(1, 6)]
  rows = pack_documents(iter(docs * 3), seq_len=64, num_rows=3,
                               pad_multiple=4)
  _check_rows(rows, docs * 3, 4)
  # Row 0 is the head of document 0, row 1 starts with its tail.
  np.testing.assert_array_equal(rows.cu_seqlens_padded[0, :2], [0, 64])
  np.testing.assert_array_equal(rows.tokens[1, :36], np.arange(65, 101))
  assert rows.max_seqlen == 64


def test_pack_documents_validation():
  with pytest.raises(ValueError, match="multiple of pad_multiple=8"):
    pack_documents(iter(_docs(0)), 60, 1, 8)
  with pytest.raises(ValueError, match="ran out"):
    pack_documents(iter(_docs(0, n=2)), 512, 3)
  with pytest.raises(ValueError, match="max_docs=1 < "):
    pack_documents(iter(_docs(0)), 128, 2, max_docs=1)
  with pytest.raises(ValueError, match="cp_size must be a positive int"):
    pad_multiple_for(CPLayout(cp_size=0))
  with pytest.raises(ValueError, match="layout must be a jax_cp.CPLayout"):
    pad_multiple_for("dual_chunk_swap")


def test_balance_rows_keeps_the_documents_and_evens_the_work():
  cp = 4
  docs = _docs(5, n=120, high=200)
  packed = pack_documents(iter(docs), 1024, 4)
  layout = CPLayout(cp_size=cp, strategy="no_load_balance")
  rows = balance_rows(packed, layout)
  for r in range(rows.num_rows):
    assert _documents(rows, r) == _documents(packed, r)
    work = [max(estimate_cp_imbalance(
        x.cu_seqlens[r], x.cu_seqlens_padded[r], layout).pairs_per_rank)
            for x in (packed, rows)]
    assert work[1] <= work[0]
  assert not np.array_equal(rows.tokens, packed.tokens)
  for r in range(rows.num_rows):   # labels, mask, positions move along
    lens = np.diff(rows.cu_seqlens[r])
    for b in np.nonzero(lens)[0]:
      s, n = rows.cu_seqlens_padded[r, b], lens[b]
      np.testing.assert_array_equal(rows.labels[r, s:s + n - 1],
                                    rows.tokens[r, s + 1:s + n])
      np.testing.assert_array_equal(rows.position_ids[r, s:s + n],
                                    np.arange(n))
  dcs = pack_documents(iter(docs), 512, 2, 4)
  np.testing.assert_array_equal(
      balance_rows(dcs, CPLayout(cp_size=2)).tokens, dcs.tokens)


# --------------------------------------- make_global_batch without CP


def test_global_batch_without_cp_shards_rows_over_the_batch_axis():
  rows = pack_documents(iter(_docs(1)), 64, 4)
  mesh = jax.make_mesh((4,), ("data",), devices=devices(4),
                       axis_types=(AxisType.Auto,))
  layout = CPLayout(cp_axis=None, mesh=mesh, batch_axis="data")
  batch = make_global_batch(rows.tensors, rows.cu_seqlens_padded, layout,
                            cu_seqlens=rows.cu_seqlens)
  assert batch.layout.cp_axis is None
  for k, x in batch.tensors.items():     # physical order, rows sharded
    np.testing.assert_array_equal(np.asarray(x), getattr(rows, k))
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    assert x.addressable_shards[1].data.shape == (1, 64)
  np.testing.assert_array_equal(np.asarray(batch.cu_seqlens), rows.cu_seqlens)
  again = make_global_batch(rows.tokens, rows.cu_seqlens_padded, layout,
                            global_batch_size=4)
  np.testing.assert_array_equal(np.asarray(again.tensors), rows.tokens)


def test_global_batch_without_cp_or_mesh_is_on_one_device():
  rows = pack_documents(iter(_docs(2)), 64, 2)
  layout = CPLayout(cp_axis=None, max_seqlen=rows.max_seqlen)
  batch = make_global_batch(rows.tensors, rows.cu_seqlens_padded, layout,
                            cu_seqlens=rows.cu_seqlens)
  x = batch.tensors["tokens"]
  assert x.sharding.device_set == {jax.local_devices()[0]}
  np.testing.assert_array_equal(np.asarray(x), rows.tokens)
  np.testing.assert_array_equal(np.asarray(batch.cu_seqlens_padded),
                                rows.cu_seqlens_padded)
  with pytest.raises(ValueError, match="max_seqlen=2 is smaller"):
    make_global_batch(rows.tokens, rows.cu_seqlens_padded,
                      layout.replace(max_seqlen=2))
  with pytest.raises(ValueError, match="batch_axis='data' needs the "
                     "layout's mesh"):
    make_global_batch(rows.tokens, rows.cu_seqlens_padded,
                      layout.replace(batch_axis="data"))
  with pytest.raises(ValueError, match="needs the layout's mesh"):
    make_global_batch(rows.tokens, rows.cu_seqlens_padded,
                      CPLayout(cp_size=2))
