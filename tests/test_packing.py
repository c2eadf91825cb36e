"""jax_cp.data's packing (documents into rows with a strategy's padding,
balanced document order) and make_global_batch without CP
(cp_axis=None)."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp import CPLayout
from jax_cp.data import (
  DocumentPacker,
  balance_rows,
  default_max_docs,
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
  with pytest.raises(ValueError, match="row 0 needs more than max_docs=1 "
                     "document slots: 1 documents fill 76 of its "
                     "seq_len=128 tokens"):
    pack_documents(iter(_docs(0)), 128, 2, max_docs=1)
  with pytest.raises(ValueError, match="cp_size must be a positive int"):
    pad_multiple_for(CPLayout(cp_size=0))
  with pytest.raises(ValueError, match="layout must be a jax_cp.CPLayout"):
    pad_multiple_for("dual_chunk_swap")


def _pieces(rows) -> list[np.ndarray]:
  """The documents (pieces) of every row, in order."""
  lens = np.diff(rows.cu_seqlens, axis=1)
  return [rows.tokens[r, s:s + n]
          for r in range(rows.num_rows)
          for s, n in zip(rows.cu_seqlens_padded[r], lens[r]) if n]


def _boundaries(parts) -> set[int]:
  """Where each of ``parts`` ends in their concatenation."""
  return set(np.cumsum([p.size for p in parts]).tolist())


@pytest.mark.parametrize("seq_len, multiple", [(512, 1), (256, 8),
                                               (2048, 4), (1536, 2)])
def test_default_slots_are_the_same_for_every_batch(seq_len, multiple):
  """20 batches of documents of 1 to 400 tokens: every batch, of repeated
  pack_documents calls or of a DocumentPacker, has the same metadata
  shape, a function of seq_len and pad_multiple alone (the last two cases
  had 8, 16 and 24 slots when the default was the most a row needed)."""
  slots = 8 * math.ceil(math.ceil(seq_len / max(multiple, 64)) / 8)
  assert default_max_docs(seq_len, multiple) == slots
  docs = _docs(7, n=2000, high=400)
  stream = iter(docs)
  shapes = {pack_documents(stream, seq_len, 2, multiple).cu_seqlens.shape
            for _ in range(20)}
  assert shapes == {(2, slots + 1)}
  packer = DocumentPacker(iter(docs), seq_len, 2, multiple)
  assert packer.max_docs == slots
  shapes = {next(packer).cu_seqlens_padded.shape for _ in range(20)}
  assert shapes == {(2, slots + 1)}
  # "fit": the most a row of the batch needs, rounded up to 8 (varies).
  fit = pack_documents(iter(docs), seq_len, 20, multiple, max_docs="fit")
  need = max((np.diff(fit.cu_seqlens_padded, axis=1) > 0).sum(1))
  assert fit.cu_seqlens.shape == (20, -(-need // 8) * 8 + 1)


@pytest.mark.parametrize("multiple, max_seqlen", [(1, None), (8, None),
                                                  (4, 50)])
def test_packer_carries_cut_tails_into_the_next_batch(multiple, max_seqlen):
  """Every token of the documents lands in exactly one row of one batch,
  in order; a document cut at a batch's end goes on at the start of the
  next batch; the batches are the rows of one pack_documents call."""
  docs = _docs(11, n=150, high=120)
  packer = DocumentPacker(iter(docs), 128, 3, multiple,
                          max_seqlen=max_seqlen)
  batches, done, cut = [], 0, 0
  whole = np.concatenate(docs)
  for rows in packer:
    batches.append(rows)
    _check_rows(rows, [whole[done:]], multiple)   # goes on where it was
    done += int(rows.cu_seqlens[:, -1].sum())
    np.testing.assert_array_equal(packer.pending,
                                  whole[done:done + packer.pending.size])
    cut += packer.pending.size > 0
  assert len(batches) > 10 and cut > 3      # the test exercises carrying
  placed = [p for rows in batches for p in _pieces(rows)]
  flat = np.concatenate(placed)
  np.testing.assert_array_equal(flat, whole[:flat.size])
  # No piece spans two documents.
  assert {b for b in _boundaries(docs) if b < flat.size} <= _boundaries(
      placed)
  one = pack_documents(iter(docs), 128, 3 * len(batches), multiple,
                       max_seqlen=max_seqlen)
  for k, rows in enumerate(batches):
    for field in ("tokens", "labels", "loss_mask", "position_ids",
                  "cu_seqlens", "cu_seqlens_padded"):
      np.testing.assert_array_equal(getattr(rows, field),
                                    getattr(one, field)[3 * k:3 * k + 3])
  # Iteration ended because fewer tokens were left than a batch holds.
  assert whole.size - flat.size < 3 * 128


def test_packer_pending_is_the_rest_of_the_cut_document():
  docs = [np.arange(1, 301), np.arange(1, 101)]
  packer = DocumentPacker(iter(docs), 64, 2)
  first = next(packer)
  np.testing.assert_array_equal(first.tokens.ravel(), np.arange(1, 129))
  np.testing.assert_array_equal(packer.pending, np.arange(129, 301))
  second = next(packer)         # the tail goes on, positions from 0
  np.testing.assert_array_equal(second.tokens.ravel(), np.arange(129, 257))
  np.testing.assert_array_equal(second.position_ids[0], np.arange(64))
  third = next(packer)
  np.testing.assert_array_equal(third.tokens[0, :44], np.arange(257, 301))
  np.testing.assert_array_equal(third.tokens[0, 44:], np.arange(1, 21))
  np.testing.assert_array_equal(third.tokens[1], np.arange(21, 85))
  np.testing.assert_array_equal(packer.pending, np.arange(85, 101))
  with pytest.raises(StopIteration):   # 16 tokens left: no full batch
    next(packer)
  # pack_documents packs once: a second call on the same iterator starts
  # with the next document, the cut tail dropped (as documented).
  stream = iter(docs)
  pack_documents(stream, 64, 2)
  np.testing.assert_array_equal(
      pack_documents(stream, 20, 2).tokens.ravel(), np.arange(1, 41))


@pytest.mark.parametrize("multiple, bound, piece", [(1, 50, 50), (8, 50, 48),
                                                    (4, 64, 64)])
def test_max_seqlen_splits_long_documents(multiple, bound, piece):
  """Documents longer than the bound are cut into pieces of the largest
  multiple of pad_multiple not above it; the pieces, in order, are the
  documents, and no padded document is longer than the bound."""
  rng = np.random.default_rng(bound + multiple)
  docs = [rng.integers(1, 256, size=int(n))
          for n in rng.integers(1, 400, size=60)]
  rows = pack_documents(iter(docs), 256, 12, multiple, max_seqlen=bound)
  _check_rows(rows, docs, multiple)
  assert rows.max_seqlen <= bound
  placed = _pieces(rows)
  flat = np.concatenate(placed)
  assert max(p.size for p in placed) == piece
  # Every document boundary and every multiple of the piece length inside
  # a document is a piece boundary (row ends add more).
  cuts, start = set(), 0
  for d in docs:
    cuts |= {start + k for k in range(piece, d.size, piece)}
    start += d.size
    cuts.add(start)
  assert {c for c in cuts if c < flat.size} <= _boundaries(placed)
  # Rows of the same documents, each already split by hand, are the same.
  split = [d[k:k + piece] for d in docs for k in range(0, d.size, piece)]
  want = pack_documents(iter(split), 256, 12, multiple)
  np.testing.assert_array_equal(rows.tokens, want.tokens)
  np.testing.assert_array_equal(rows.cu_seqlens_padded,
                                want.cu_seqlens_padded)
  np.testing.assert_array_equal(rows.loss_mask, want.loss_mask)


def test_split_long_document_passes_the_layout_bound():
  """A document longer than the layout's max_seqlen fails the batch
  unless pack_documents splits it at that bound."""
  docs = [np.arange(1, 1001), np.arange(1, 30)]
  layout = CPLayout(cp_axis=None, max_seqlen=100)
  whole = pack_documents(iter(docs), 256, 2)
  with pytest.raises(ValueError, match="max_seqlen=100 is smaller"):
    make_global_batch(whole.tokens, whole.cu_seqlens_padded, layout)
  rows = pack_documents(iter(docs), 256, 2, max_seqlen=100)
  batch = make_global_batch(rows.tensors, rows.cu_seqlens_padded, layout,
                            cu_seqlens=rows.cu_seqlens)
  np.testing.assert_array_equal(np.asarray(batch.tensors["tokens"]),
                                rows.tokens)
  np.testing.assert_array_equal(rows.tokens.ravel(), np.arange(1, 513))
  np.testing.assert_array_equal(rows.position_ids[0, 95:105],
                                [95, 96, 97, 98, 99, 0, 1, 2, 3, 4])
  assert rows.loss_mask[0, 99] == 0 and rows.loss_mask[0, 98] == 1


def test_packer_validation():
  docs = _docs(3, n=400, high=20)      # short: many documents per row
  with pytest.raises(ValueError, match=r"batch 0, row 0 needs more than "
                     r"max_docs=8 document slots: 8 documents fill \d+ of "
                     r"its seq_len=512 tokens.*seq_len // pad_multiple = "
                     r"512 always fits"):
    next(DocumentPacker(iter(docs), 512, 2))
  packer = DocumentPacker(iter([np.arange(1, 65)] * 4 + docs), 128, 2,
                          max_docs=12)
  next(packer)
  with pytest.raises(ValueError, match="batch 1, row 1 needs more than "
                     "max_docs=12"):
    next(packer)
  with pytest.raises(ValueError, match="the packer stopped at an error: "
                     "batch 1, row 1"):
    next(packer)
  rows = pack_documents(iter(docs), 512, 2, max_docs=512)
  assert rows.cu_seqlens.shape == (2, 513)
  for kwargs, match in [
      ({"max_docs": "many"}, "max_docs must be None, 'fit' or a positive "
       "int, got 'many'"),
      ({"max_docs": 0}, "max_docs must be a positive int, got 0"),
      ({"max_seqlen": 4}, "max_seqlen=4 is smaller than pad_multiple=8"),
      ({"max_seqlen": 2.5}, "max_seqlen must be a positive int"),
      ({"num_rows": 0}, "num_rows must be a positive int, got 0"),
      ({"seq_len": 60}, "seq_len=60 must be a multiple of pad_multiple=8")]:
    args = {"seq_len": 64, "num_rows": 2, "pad_multiple": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
      DocumentPacker(iter(docs), **args)
    with pytest.raises(ValueError, match=match):
      pack_documents(iter(docs), **args)
  with pytest.raises(ValueError, match="multiple of pad_multiple=3"):
    default_max_docs(64, 3)
  for bad, what in [(np.ones((4, 4), np.int32), r"shape \(4, 4\)"),
                    (np.linspace(1, 9, 40), "dtype float64")]:
    with pytest.raises(ValueError, match="document 2 of docs must be a 1-D "
                       f"array of int token ids, got .*{what}"):
      pack_documents(iter([docs[0], [], bad] + docs), 64, 2)
    packer = DocumentPacker(iter([docs[0], [], bad] + docs), 64, 2)
    with pytest.raises(ValueError, match="document 2 of docs"):
      next(packer)
    with pytest.raises(ValueError, match="stopped at an error: document 2"):
      next(packer)


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
