"""jax_cp.data's segment-id converters: rows in the segment-id convention
(MaxText, grain) to PackedRows and back, per-token features both ways, and
the metadata of aligned rows on the device.

References: :func:`jax_cp.data.pack_documents` on the same documents (rows
that fill exactly), the documents themselves, metadata written out by
hand, plain attention on the unpartitioned row (tests/reference.py), and
the attention mask written in the segment-id convention (same id,
non-zero, causal by position), which shares nothing with the
cumulative-length metadata."""


import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grain import experimental as grain_exp

import jax_cp
from jax_cp import CPLayout, data
from tests import reference as ref
from tests._devices import devices

T = 64


def _docs_filling(rng, rows, seq_len, multiple, max_slot=24):
  """Per row, documents whose padded lengths sum to exactly ``seq_len``."""
  out = []
  for _ in range(rows):
    slots, left = [], seq_len
    while left:
      s = min(left, multiple * int(rng.integers(1, max_slot // multiple + 2)))
      slots.append(s)
      left -= s
    out.append([rng.integers(1, 256, int(rng.integers(max(1, s - multiple + 1),
                                                      s + 1))).astype(np.int32)
                for s in slots])
  return out


def _segment_rows(docs_per_row, seq_len, multiple=1):
  """Rows in the segment-id convention: documents back to back, each
  starting at the next multiple of ``multiple`` (1: MaxText's trailing
  padding), ids 1, 2, ... per row; (segment_ids, tokens, positions)."""
  b = len(docs_per_row)
  seg, tok, pos = (np.zeros((b, seq_len), np.int32) for _ in range(3))
  for r, docs in enumerate(docs_per_row):
    c = 0
    for i, d in enumerate(docs):
      seg[r, c:c + d.size], tok[r, c:c + d.size] = i + 1, d
      pos[r, c:c + d.size] = np.arange(d.size)
      c += -(-d.size // multiple) * multiple
  return seg, tok, pos


def _assert_rows_equal(got, want):
  for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
            "cu_seqlens_padded"):
    np.testing.assert_array_equal(getattr(got, k), getattr(want, k), k)


def _segment_mask(seg, pos):
  """[T, T] in the segment-id convention: same non-zero id, causal."""
  return ((seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
          & (pos[None, :] <= pos[:, None]))


# ------------------------------------------------------------ conversion


@pytest.mark.parametrize("multiple", [1, 8])
def test_maxtext_rows_equal_pack_documents_of_the_same_documents(multiple):
  rng = np.random.default_rng(multiple)
  docs = _docs_filling(rng, 3, T, multiple)
  seg, tok, pos = _segment_rows(docs, T)          # trailing padding only
  want = data.pack_documents([d for row in docs for d in row], T, 3,
                             multiple, max_docs=16)
  got = data.rows_from_segment_ids(seg, tok, positions=pos,
                                   pad_multiple=multiple, max_docs=16)
  _assert_rows_equal(got, want)
  # MaxText's targets and targets_segmentation move with their tokens.
  targets, tseg = np.zeros_like(tok), np.zeros_like(seg)
  for r, row in enumerate(docs):
    c = 0
    for i, d in enumerate(row):
      targets[r, c:c + d.size - 1], tseg[r, c:c + d.size - 1] = d[1:], i + 1
      c += d.size
  got = data.rows_from_segment_ids(
      seg, tok, targets, positions=pos, loss_mask=tseg != 0,
      pad_multiple=multiple, max_docs=16)
  _assert_rows_equal(got, want)


@pytest.mark.parametrize("padding,multiple", [
    ("trailing", 1), ("trailing", 8), ("between", 8), ("between", 4)])
def test_random_rows_keep_the_segment_id_attention_mask(padding, multiple):
  """Every pair of tokens may attend in the converted rows exactly when
  the segment-id convention says so, and each token keeps its value and
  its position."""
  rng = np.random.default_rng(hash((padding, multiple)) % 2**32)
  b = 4
  docs = [[rng.integers(1, 256, int(rng.integers(1, 12))).astype(np.int32)
           for _ in range(int(rng.integers(0, 5)))] for _ in range(b)]
  seg, tok, pos = _segment_rows(docs, T, multiple if padding == "between"
                                else 1)
  rows = data.rows_from_segment_ids(seg, tok, positions=pos,
                                    pad_multiple=multiple, padding=padding)
  plens = np.diff(rows.cu_seqlens_padded, axis=1)
  assert not (plens % multiple).any()
  index = data.segment_index(seg, rows.cu_seqlens, rows.cu_seqlens_padded)
  for r in range(b):
    valid = seg[r] != 0
    np.testing.assert_array_equal(index[r] >= 0, valid)
    i = index[r, valid]
    np.testing.assert_array_equal(rows.tokens[r, i], tok[r, valid])
    np.testing.assert_array_equal(rows.position_ids[r, i], pos[r, valid])
    m = ref.doc_mask(rows.cu_seqlens[r], rows.cu_seqlens_padded[r])
    np.testing.assert_array_equal(m[np.ix_(i, i)], _segment_mask(
        seg[r], pos[r])[np.ix_(valid, valid)])
    # Padding tokens attend nothing and are never targets.
    assert not m[np.setdiff1d(np.arange(T), i)].any()
    assert rows.loss_mask[r].sum() == sum(max(d.size - 1, 0)
                                          for d in docs[r])


def test_aligned_rows_keep_every_token_in_place():
  rng = np.random.default_rng(5)
  docs = [[rng.integers(1, 256, int(n)).astype(np.int32)
           for n in rng.integers(1, 14, 4)] for _ in range(3)]
  seg, tok, pos = _segment_rows(docs, T, 8)       # gaps: grain's alignment
  rows = data.rows_from_segment_ids(seg, tok, positions=pos,
                                    pad_multiple=8, padding="between")
  np.testing.assert_array_equal(rows.tokens, tok)   # padding tokens are 0
  for r in range(3):
    starts = np.flatnonzero(np.diff(seg[r], prepend=0) > 0)
    end = -(-(np.flatnonzero(seg[r])[-1] + 1) // 8) * 8
    # Each document's slot runs to the next one's start; the padding after
    # the last one's (next multiple of 8) is an empty slot.
    np.testing.assert_array_equal(rows.cu_seqlens_padded[r, :6],
                                  [*starts, end, T])
    np.testing.assert_array_equal(np.diff(rows.cu_seqlens[r, :6]),
                                  [d.size for d in docs[r]] + [0])
  assert (rows.cu_seqlens_padded[:, 5:] == T).all()
  with pytest.raises(ValueError, match=r"row 0, position \d+: segment id 2 "
                     "after padding started"):
    data.rows_from_segment_ids(seg, tok, pad_multiple=8)   # trailing


def test_grain_first_fit_packing_with_the_layouts_alignment():
  """grain's FirstFitPackIterDataset aligned to pad_multiple_for: the
  rows convert without moving a token, and hold grain's documents."""
  cp = 4
  layout = CPLayout(cp_size=cp, strategy="dual_chunk_swap")
  multiple = data.pad_multiple_for(layout)
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, 256, int(n)).astype(np.int32)
          for n in rng.integers(1, 30, 40)]
  ds = grain_exp.FirstFitPackIterDataset(
      grain.MapDataset.source(docs).map(lambda d: {"tokens": d})
      .to_iter_dataset(), length_struct={"tokens": T}, num_packing_bins=4,
      pack_alignment_struct={"tokens": multiple}, shuffle_bins=False)
  batch = next(iter(ds.batch(4)))
  seg, tok = batch["tokens_segment_ids"], batch["tokens"]
  rows = data.rows_from_segment_ids(
      seg, tok, positions=batch["tokens_positions"], pad_multiple=multiple,
      padding="between")
  np.testing.assert_array_equal(rows.tokens, tok)
  got = [rows.tokens[r, a:a + n] for r in range(4) for a, n in zip(
      rows.cu_seqlens_padded[r, :-1], np.diff(rows.cu_seqlens[r])) if n]
  assert sorted(map(bytes, got)) == sorted(
      map(bytes, docs[:len(got)])), "not grain's first documents"
  # The on-device variant reads the same metadata from the segment ids.
  cu, cu_p = jax.jit(data.cu_seqlens_from_segment_ids,
                     static_argnums=(1, 2))(
      jnp.asarray(seg), rows.cu_seqlens.shape[1] - 1, multiple)
  np.testing.assert_array_equal(cu, rows.cu_seqlens)
  np.testing.assert_array_equal(cu_p, rows.cu_seqlens_padded)


@pytest.mark.parametrize("multiple", [1, 8])
def test_on_device_metadata_equals_the_host_converters(multiple):
  rng = np.random.default_rng(multiple + 10)
  docs = [[rng.integers(1, 256, int(n)).astype(np.int32)
           for n in rng.integers(1, 12, int(k))]
          for k in (0, 1, 3, 5)]                   # an empty row too
  seg, tok, _ = _segment_rows(docs, T, multiple)
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=multiple,
                                    padding="between", max_docs=6)
  cu, cu_p = jax.jit(data.cu_seqlens_from_segment_ids,
                     static_argnums=(1, 2))(seg, 6, multiple)
  assert cu.dtype == cu_p.dtype == jnp.int32
  np.testing.assert_array_equal(cu, rows.cu_seqlens)
  np.testing.assert_array_equal(cu_p, rows.cu_seqlens_padded)
  one, one_p = data.cu_seqlens_from_segment_ids(seg[2], 6, multiple)
  np.testing.assert_array_equal(one_p, rows.cu_seqlens_padded[2])
  np.testing.assert_array_equal(one, rows.cu_seqlens[2])
  with pytest.raises(ValueError, match="must hold integers"):
    data.cu_seqlens_from_segment_ids(seg.astype(np.float32), 6, multiple)


def _leading_padding_rows():
  """Two rows of 8 tokens, documents aligned to 2: row 1 starts with
  padding; (segment_ids, cu_seqlens, cu_seqlens_padded) with the metadata
  written out: row 1's first slot is the padding, empty."""
  seg = np.array([[1, 1, 1, 0, 2, 2, 2, 0],
                  [0, 0, 1, 1, 2, 2, 2, 0]], np.int32)
  cu = np.array([[0, 3, 6, 6, 6], [0, 0, 2, 5, 5]], np.int32)
  cu_p = np.array([[0, 4, 8, 8, 8], [0, 2, 4, 8, 8]], np.int32)
  return seg, cu, cu_p


def test_on_device_metadata_of_a_row_that_starts_with_padding():
  """The metadata start at 0, the leading padding an empty slot, concrete
  and traced; attention on them, without CP and with NO_LOAD_BALANCE at
  cp=2, equals the reference on the metadata written out."""
  seg, want_cu, want_cu_p = _leading_padding_rows()
  cu, cu_p = data.cu_seqlens_from_segment_ids(seg, 4, 2)
  np.testing.assert_array_equal(cu, want_cu)
  np.testing.assert_array_equal(cu_p, want_cu_p)
  rng = np.random.default_rng(8)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 8, h, 4)), jnp.float32)
             for h in (2, 1, 1))
  want = ref.batched_attention(q, k, v, want_cu, want_cu_p)
  assert float(jnp.abs(want[1, 2:7]).min()) > 0   # the documents attend

  def attend(layout):
    def f(seg, q, k, v):
      meta = data.cu_seqlens_from_segment_ids(seg, 4, 2)
      return jax_cp.cp_attention(q, k, v, meta, layout=layout)
    return f

  no_cp = CPLayout(cp_axis=None, backend="xla")
  np.testing.assert_allclose(attend(no_cp)(seg, q, k, v), want, atol=1e-5)
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  nlb = CPLayout(mesh=mesh, strategy="no_load_balance", backend="xla")
  with jax.set_mesh(mesh):
    got = jax.jit(attend(nlb))(jnp.asarray(seg), q, k, v)
    traced = jax.jit(lambda s: data.cu_seqlens_from_segment_ids(s, 4, 2))(
        jnp.asarray(seg))
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(traced[0], want_cu)
  np.testing.assert_array_equal(traced[1], want_cu_p)


@pytest.mark.parametrize("row, max_docs, match", [
    ([1, 1, 2, 2, 1, 1, 0, 0], 4, r"row 1: segment id 1 starts again at "
     r"position 4"),
    ([1, 1, 1, 2, 2, 0, 0, 0], 4, r"row 1: a document starts at position "
     r"3, not a multiple of pad_multiple=2"),
    ([0, 0, 1, 1, 2, 2, 2, 0], 2, r"row 1 needs 3 slots .*more than "
     r"max_docs=2"),
])
def test_on_device_metadata_check_concrete_ids(row, max_docs, match):
  seg = np.array([[1, 1, 0, 0, 0, 0, 0, 0], row], np.int32)
  with pytest.raises(ValueError, match=match):
    data.cu_seqlens_from_segment_ids(seg, max_docs, 2)
  with pytest.raises(ValueError, match=match):
    data.cu_seqlens_from_segment_ids(jnp.asarray(seg), max_docs, 2)


# ------------------------------------------------------ overflow, inverse


def test_a_row_that_no_longer_fits_raises_or_is_truncated():
  rng = np.random.default_rng(2)
  lens = [13, 13, 13, 13, 11]                      # 63 tokens, 80 padded
  row = [rng.integers(1, 256, n).astype(np.int32) for n in lens]
  short = [rng.integers(1, 256, 5).astype(np.int32)]
  seg, tok, pos = _segment_rows([short, row], T)
  with pytest.raises(ValueError, match=r"row 1 does not fit in seq_len=64 "
                     r"tokens.*multiple of 16.*need 80 tokens, 16 more"):
    data.rows_from_segment_ids(seg, tok, pad_multiple=16)
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=16,
                                    overflow="truncate")
  np.testing.assert_array_equal(rows.cu_seqlens_padded[1, :5],
                                [0, 16, 32, 48, 64])
  np.testing.assert_array_equal(rows.cu_seqlens[1, :5], [0, 13, 26, 39, 52])
  np.testing.assert_array_equal(rows.tokens[1, 48:61], row[3])
  # The last document kept ends inside the row: no target on its last
  # token.
  assert rows.loss_mask[1, 48:61].sum() == 12
  # The inverse: the dropped document's tokens get the fill value.
  back = data.to_segment_layout(rows.tokens, seg, rows, fill=-1)
  np.testing.assert_array_equal(back[1, :52], tok[1, :52])
  assert (back[1, 52:] == -1).all()
  # A longer row fits them all.
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=16,
                                    seq_len=96)
  assert rows.tokens.shape == (2, 96) and rows.cu_seqlens[1, 5] == 63


def test_a_truncated_document_keeps_the_target_of_its_last_token():
  """Documents of 13, 13, 13 and 20 tokens padded to 16 need 80 tokens:
  the last is cut at the row's end, and its last kept token's label is
  its next token in the document, a target (mask 1); a document that ends
  inside the row has none on its last token."""
  rng = np.random.default_rng(9)
  row = [rng.integers(1, 256, n).astype(np.int32) for n in (13, 13, 13, 20)]
  seg, tok, _ = _segment_rows([row], T)
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=16,
                                    overflow="truncate")
  np.testing.assert_array_equal(rows.cu_seqlens_padded[0, :5],
                                [0, 16, 32, 48, 64])
  np.testing.assert_array_equal(rows.cu_seqlens[0, :5], [0, 13, 26, 39, 55])
  np.testing.assert_array_equal(rows.tokens[0, 48:64], row[3][:16])
  np.testing.assert_array_equal(rows.labels[0, 48:64], row[3][1:17])
  np.testing.assert_array_equal(rows.loss_mask[0, 48:64], np.ones(16))
  for start in (0, 16, 32):                       # whole documents
    np.testing.assert_array_equal(rows.loss_mask[0, start:start + 16],
                                  [1] * 12 + [0] * 4)
    assert rows.labels[0, start + 12] == 0


def test_outputs_go_back_to_the_segment_id_layout():
  """Per-token values of the packed rows (here logits-like [B, T, V], and
  in a CP layout first restored) come back where the caller's tokens are;
  numpy and JAX, inside jit."""
  rng = np.random.default_rng(7)
  docs = [[rng.integers(1, 256, int(n)).astype(np.int32)
           for n in rng.integers(1, 15, 4)] for _ in range(2)]
  seg, tok, pos = _segment_rows(docs, T)
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=8,
                                    overflow="truncate")
  x = rng.standard_normal((2, T, 3)).astype(np.float32)
  feats = np.zeros((2, T, 3), np.float32)   # values at the packed positions
  idx = data.segment_index(seg, rows.cu_seqlens, rows.cu_seqlens_padded)
  for r in range(2):
    v = idx[r] >= 0
    feats[r, idx[r, v]] = x[r, v]
  got = data.to_segment_layout(feats, seg, rows, fill=np.nan)
  v = idx >= 0
  np.testing.assert_array_equal(got[v], x[v])
  assert np.isnan(got[~v]).all() and (v == (seg != 0)).all()
  got_j = jax.jit(lambda f: data.to_segment_layout(
      f, seg, (rows.cu_seqlens, rows.cu_seqlens_padded)))(feats)
  np.testing.assert_array_equal(np.asarray(got_j)[v], x[v])
  assert (np.asarray(got_j)[~v] == 0).all()
  # From a CP layout: restore_from_cp, then back.
  layout = CPLayout(cp_size=4)
  cp_feats = data.reorder_for_cp(feats, rows.cu_seqlens_padded, layout,
                                 seq_dim=1)
  back = data.to_segment_layout(data.restore_from_cp(
      cp_feats, rows.cu_seqlens_padded, layout, seq_dim=1), seg, rows)
  np.testing.assert_array_equal(back[v], x[v])


@pytest.mark.parametrize("padding, multiple", [("trailing", 8),
                                               ("between", 4)])
@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jnp"])
def test_features_go_into_the_packed_rows(padding, multiple, xp):
  """A per-token float feature ``[B, T, 2]`` of the segment-id batch lands
  where rows_from_segment_ids puts its token (rows re-laid with trailing
  padding, or kept with padding between documents), ``fill`` on the
  packed rows' padding, and to_segment_layout takes it back."""
  rng = np.random.default_rng(multiple)
  docs = [[rng.integers(1, 256, int(n)).astype(np.int32)
           for n in rng.integers(1, 13, 4)] for _ in range(3)]
  seg, tok, _ = _segment_rows(docs, T, multiple if padding == "between"
                              else 1)
  rows = data.rows_from_segment_ids(seg, tok, pad_multiple=multiple,
                                    padding=padding)
  kept = np.array_equal(rows.tokens, tok)
  assert kept == (padding == "between")
  feat = rng.standard_normal(seg.shape + (2,)).astype(np.float32)
  feat[..., 0] = tok                     # channel 0: the token itself
  got = data.from_segment_layout(xp.asarray(feat), seg, rows, fill=np.nan)
  assert type(got) is type(xp.asarray(feat)) and got.shape == (3, T, 2)
  got = np.asarray(got)
  for r in range(3):
    valid = ref.valid_token_mask(rows.cu_seqlens[r],
                                 rows.cu_seqlens_padded[r])
    np.testing.assert_array_equal(got[r, valid, 0], rows.tokens[r, valid])
    assert np.isnan(got[r, ~valid]).all()
  back = np.asarray(data.to_segment_layout(xp.asarray(got), seg, rows))
  np.testing.assert_array_equal(back[seg != 0], feat[seg != 0])


# ------------------------------------------------------------ bad input


def _good():
  rng = np.random.default_rng(3)
  docs = [[rng.integers(1, 256, n).astype(np.int32) for n in (5, 7, 3)]
          for _ in range(2)]
  return _segment_rows(docs, 32)


@pytest.mark.parametrize("edit,kwargs,match", [
    (lambda s, t, p: s.__setitem__((1, 14), 1), {},
     r"row 1: segment id 1 starts again at position 14 after its run ended "
     r"at position 5"),
    (lambda s, t, p: s.__setitem__((0, 20), 9), {},
     r"row 0, position 20: segment id 9 after padding started at position "
     r"15"),
    (lambda s, t, p: p.__setitem__((1, 5), 1), {},
     r"positions\[1, 5\] = 1 disagrees.*restarts at 0 \(segment id 2 starts"
     r" at position 5\)"),
    (lambda s, t, p: p.__setitem__((0, 8), 7), {},
     r"positions\[0, 8\] = 7 disagrees.*step by 1.*positions\[0, 7\] = 2"),
    (lambda s, t, p: None, {"max_docs": 2}, r"max_docs=2 < 4 slots in row 0 "
     r"\(its documents, and its padding after them\)"),
    (lambda s, t, p: None, {"seq_len": 30, "pad_multiple": 4},
     r"seq_len=30 must be a multiple of pad_multiple=4"),
    (lambda s, t, p: None, {"padding": "leading"},
     r"padding='leading' is not one of \['trailing', 'between'\]"),
    (lambda s, t, p: None, {"overflow": "drop"}, r"overflow='drop'"),
    (lambda s, t, p: None, {"pad_multiple": 0}, r"pad_multiple must be a "
     r"positive int, got 0"),
])
def test_bad_rows_name_the_row_and_position(edit, kwargs, match):
  seg, tok, pos = _good()
  edit(seg, tok, pos)
  with pytest.raises(ValueError, match=match):
    data.rows_from_segment_ids(seg, tok, positions=pos, **kwargs)


def test_bad_arrays_are_refused():
  seg, tok, pos = _good()
  with pytest.raises(ValueError, match=r"segment_ids must hold integers, "
                     "got dtype float32"):
    data.rows_from_segment_ids(seg.astype(np.float32), tok)
  with pytest.raises(ValueError, match=r"labels has shape \(2, 31\), "
                     r"segment_ids \(2, 32\)"):
    data.rows_from_segment_ids(seg, tok, tok[:, 1:])
  with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\]"):
    data.rows_from_segment_ids(seg[0], tok[0])
  seg[1, 3] = -2
  with pytest.raises(ValueError, match=r"segment_ids\[1, 3\] = -2 is "
                     "negative"):
    data.rows_from_segment_ids(seg, tok)


def test_pad_multiple_of_a_layout():
  dcs = CPLayout(cp_size=4, strategy="dual_chunk_swap")
  nlb = CPLayout(cp_size=4, strategy="no_load_balance")
  seg, tok, _ = _good()
  rows = data.rows_from_segment_ids(seg, tok,
                                    pad_multiple=data.pad_multiple_for(dcs))
  assert not (np.diff(rows.cu_seqlens_padded, axis=1) % 8).any()
  rows = data.rows_from_segment_ids(seg, tok,
                                    pad_multiple=data.pad_multiple_for(nlb))
  np.testing.assert_array_equal(rows.tokens, tok)       # no padding needed
  with pytest.raises(ValueError, match="pad_multiple must be a positive "
                     "int, got CPLayout"):
    data.rows_from_segment_ids(seg, tok, pad_multiple=dcs)
