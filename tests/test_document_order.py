"""jax_cp.planning.balance_document_order / permute_documents: the
per-rank work against a count from the reference mask, the reordered row's
contents, and CP attention on a reordered row against the reference on the
original."""

from __future__ import annotations

import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp.planning import (
  balance_document_order,
  document_order,
  estimate_cp_imbalance,
  permute_documents,
  recommend_strategy,
)
from tests import reference as ref
from tests._devices import devices


def _nlb(cp):
  return CPLayout(cp_size=cp, strategy="no_load_balance")


def _row(rng, n_docs, total, cp, empty_tail=0):
  """A random NO_LOAD_BALANCE row of ``total`` tokens (``total % cp == 0``):
  ``n_docs`` documents, some with padding and some empty of valid tokens,
  then ``empty_tail`` unused slots."""
  cuts = np.sort(rng.choice(np.arange(1, total), n_docs - 1, replace=False))
  plens = np.diff(np.concatenate([[0], cuts, [total]]))
  lens = np.maximum(plens - rng.integers(0, 3, n_docs), 0)
  lens[rng.random(n_docs) < 0.1] = 0
  lens = np.concatenate([lens, np.zeros(empty_tail, int)])
  plens = np.concatenate([plens, np.zeros(empty_tail, int)])
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  cuP = np.concatenate([[0], np.cumsum(plens)]).astype(np.int32)
  return cu, cuP


def _mask_pairs(cu, cuP, cp, left=-1):
  """Per-rank (query, key) pairs under NO_LOAD_BALANCE, counted from the
  reference's document mask (rows of each rank's contiguous chunk)."""
  m = ref.doc_mask(cu, cuP, causal=True, window=left)
  tl = m.shape[0] // cp
  return np.array([int(m[r * tl:(r + 1) * tl].sum()) for r in range(cp)])


def _imbalance(pairs):
  return pairs.max() / pairs.mean() if pairs.sum() else 1.0


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("left", [-1, 0, 5, 40])
def test_never_worse_and_counts_match_the_mask(cp, left):
  rng = np.random.default_rng(100 * cp + left)
  window = None if left < 0 else (left, 0)
  for trial in range(6):
    cu, cuP = _row(rng, int(rng.integers(2, 24)), 48 * cp, cp,
                   empty_tail=trial % 3)
    order = balance_document_order(cu, cuP, _nlb(cp), window_size=window)
    assert sorted(order) == list(range(len(cu) - 1))
    cu2, cuP2 = permute_documents(order, cu, cuP)
    before, after = _mask_pairs(cu, cuP, cp, left), \
        _mask_pairs(cu2, cuP2, cp, left)
    assert after.sum() == before.sum()          # the same documents
    assert after.max() <= before.max()
    est = estimate_cp_imbalance(cu2, cuP2, _nlb(cp), window_size=window)
    np.testing.assert_array_equal(est.pairs_per_rank, after)
    # Empty slots stay where they were.
    empty = np.flatnonzero(np.diff(cuP) == 0)
    np.testing.assert_array_equal(order[empty], empty)


def test_swap_scores_match_a_recount():
  """The per-swap scores the search ranks candidates by equal the pairs of
  the swapped row counted from the reference mask."""
  rng = np.random.default_rng(7)
  for cp, left in ((2, -1), (3, 4), (4, 0), (5, 17)):
    cu, cuP = _row(rng, 9, 30 * cp, cp, empty_tail=1)
    lens, plens = np.diff(cu).astype(np.int64), np.diff(cuP).astype(np.int64)
    pre = document_order._Prefix(lens, plens, left)
    bounds = np.arange(cp + 1) * (int(cuP[-1]) // cp)
    i, j = np.triu_indices(len(lens), k=1)
    got = document_order._swap_rank_pairs(pre, i, j, bounds)
    for k in range(len(i)):
      order = np.arange(len(lens))
      order[[i[k], j[k]]] = order[[j[k], i[k]]]
      cu2, cuP2 = permute_documents(order, cu, cuP)
      np.testing.assert_array_equal(got[k], _mask_pairs(cu2, cuP2, cp, left),
                                    err_msg=f"swap {i[k]},{j[k]}")


@pytest.mark.parametrize("left", [-1, 255])
def test_balances_a_row_of_few_long_documents(left):
  """Twelve documents of 1k-8k tokens at cp=2, packed longest first: one
  rank has well over the mean; the reordered row is within half a percent
  of it."""
  rng = np.random.default_rng(3)
  lens = np.sort(rng.integers(1024, 8193, 12))[::-1]
  lens[-1] += (-lens.sum()) % 2
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  window = None if left < 0 else (left, 0)
  before = estimate_cp_imbalance(cu, cu, _nlb(2),
                                 window_size=window).imbalance
  order = balance_document_order(cu, cu, _nlb(2), window_size=window)
  cu2, _ = permute_documents(order, cu, cu)
  after = estimate_cp_imbalance(cu2, cu2, _nlb(2),
                                window_size=window).imbalance
  assert before > 1.01
  assert after < 1.005


def test_sampled_swaps_are_the_pairs_they_index():
  """The swaps a round samples by index are ``np.triu_indices``'s pairs
  at those indices (the exhaustive list is never built)."""
  for m in (2, 3, 17, 200):
    pairs = document_order._Pairs(m)
    i, j = np.triu_indices(m, k=1)
    assert pairs.count == len(i)
    k = np.random.default_rng(m).permutation(len(i))
    got = pairs[k]
    np.testing.assert_array_equal(got[0], i[k])
    np.testing.assert_array_equal(got[1], j[k])


def test_a_row_of_100k_documents_in_o_n_memory_and_time():
  """100k documents (1-63 tokens) at cp=4: a few seconds at most (about
  0.4 s on 2 CPU cores), host memory far below the N^2 = 10 GB of all
  pairs, and the busiest rank within 0.2 % of the mean after it."""
  rng = np.random.default_rng(0)
  n, cp = 100_000, 4
  plens = rng.integers(1, 64, n)
  plens[-1] += (-plens.sum()) % cp
  lens = np.maximum(plens - rng.integers(0, 3, n), 0)
  cu = np.concatenate([[0], np.cumsum(lens)])
  cuP = np.concatenate([[0], np.cumsum(plens)])
  tracemalloc.start()
  try:
    t0 = time.perf_counter()
    order = balance_document_order(cu, cuP, _nlb(cp))
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert seconds < 5.0, seconds
  assert peak < 2000 * n, peak           # 200 MB; all pairs: 16 * n^2
  assert sorted(order) == list(range(n))
  est = lambda a, b: estimate_cp_imbalance(a, b, _nlb(cp)).imbalance
  cu2, cuP2 = permute_documents(order, cu, cuP)
  before, after = est(cu, cuP), est(cu2, cuP2)
  assert before > 1.0015 and after < 1.002


def test_identity_where_order_cannot_matter():
  rng = np.random.default_rng(5)
  cu, cuP = _row(rng, 10, 64, 4)
  n = len(cu) - 1
  for layout, kw in ((CPLayout(cp_size=4, strategy="dual_chunk_swap"), {}),
                     (_nlb(1), {}), (_nlb(4), dict(max_rounds=0))):
    np.testing.assert_array_equal(
        balance_document_order(cu, cuP, layout, **kw), np.arange(n))


def test_batched_rows():
  rng = np.random.default_rng(11)
  rows = [_row(rng, 12, 96, 4, empty_tail=2) for _ in range(3)]
  cu, cuP = (np.stack(x) for x in zip(*rows))
  layout = _nlb(4)
  order = balance_document_order(cu, cuP, layout)
  assert order.shape == (3, cu.shape[1] - 1)
  for r in range(3):
    np.testing.assert_array_equal(
        order[r], balance_document_order(cu[r], cuP[r], layout))
  # Deterministic.
  np.testing.assert_array_equal(
      order, balance_document_order(cu, cuP, layout))


def test_permute_documents_moves_whole_documents():
  rng = np.random.default_rng(2)
  rows = [_row(rng, 9, 64, 2, empty_tail=1) for _ in range(2)]
  cu, cuP = (np.stack(x) for x in zip(*rows))
  tokens = rng.integers(0, 1000, (2, 64))
  feats = rng.standard_normal((2, 64, 3))
  pos = np.asarray(jax_cp.data.get_position_ids(cuP))
  order = np.stack([rng.permutation(cu.shape[1] - 1) for _ in range(2)])
  cu2, cuP2, tok2, feat2, pos2 = permute_documents(
      order, cu, cuP, tokens, feats, pos, seq_dim=1)
  assert cu2.dtype == cu.dtype and tok2.shape == tokens.shape
  assert feat2.shape == feats.shape
  np.testing.assert_array_equal(pos2, jax_cp.data.get_position_ids(cuP2))
  for r in range(2):
    for slot, d in enumerate(order[r]):
      old = slice(cuP[r, d], cuP[r, d + 1])
      new = slice(cuP2[r, slot], cuP2[r, slot + 1])
      np.testing.assert_array_equal(tok2[r, new], tokens[r, old])
      np.testing.assert_array_equal(feat2[r, new], feats[r, old])
      assert cu2[r, slot + 1] - cu2[r, slot] == cu[r, d + 1] - cu[r, d]


def test_cp_attention_on_a_reordered_row():
  """NO_LOAD_BALANCE at cp=4 on the balanced row, restored and put back in
  the original document order, equals the reference on the original row
  (output and gradients)."""
  cp, t, h, d = 4, 128, 2, 8
  rng = np.random.default_rng(9)
  cu, cuP = _row(rng, 11, t, cp)
  order = balance_document_order(cu, cuP, _nlb(cp))
  assert (order != np.arange(len(order))).any()
  q, k, v, w = (rng.standard_normal((t, h, d)).astype(np.float32)
                for _ in range(4))
  cu2, cuP2, q2, k2, v2, w2 = permute_documents(
      order, cu, cuP, q, k, v, w, seq_dim=0)
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = CPLayout(mesh=mesh, strategy="no_load_balance", backend="xla")

  def loss(q, k, v):
    out = jax_cp.cp_attention(q[None], k[None], v[None],
                              (cu2[None], cuP2[None]), layout=layout)[0]
    return jnp.sum(out * w2), out

  (_, out2), grads2 = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(q2, k2, v2)
  # Back to the original order: the inverse permutation of documents.
  inverse = np.argsort(order)
  back = lambda x: permute_documents(inverse, cu2, cuP2, np.asarray(x),
                                     seq_dim=0)[2]
  f = lambda q, k, v: ref.attention(q, k, v, cu, cuP)
  want = f(q, k, v)
  want_grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
      q, k, v)
  valid = ref.valid_token_mask(cu, cuP)
  assert ref.rel_err(back(out2)[valid], np.asarray(want)[valid]) < 1e-4
  for g, wg in zip(grads2, want_grads):
    assert ref.rel_err(back(g)[valid], np.asarray(wg)[valid]) < 1e-4


@pytest.mark.parametrize("strategy, kwargs, match", [
    ("no_load_balance", dict(max_rounds=-1), "max_rounds"),
    ("no_load_balance", dict(max_rounds=1.5), "max_rounds"),
    ("no_load_balance", dict(tolerance=-0.1), "tolerance"),
    ("no_load_balance", dict(window_size=(-2, 0)), "window"),
    ("no_load_balance", dict(window_size=(4, 1)), "window"),
    ("ring", {}, "strategy"),
])
def test_bad_arguments_raise(strategy, kwargs, match):
  cu = np.array([0, 10, 30, 64])
  with pytest.raises(ValueError, match=match):
    balance_document_order(cu, cu, CPLayout(cp_size=4, strategy=strategy),
                           **kwargs)


def test_numpy_scalars_are_accepted():
  cu = np.array([0, 10, 30, 64])
  want = balance_document_order(cu, cu, _nlb(4))
  got = balance_document_order(cu, cu, _nlb(np.int64(4)),
                               max_rounds=np.int32(64),
                               tolerance=np.int64(0))
  assert sorted(got) == [0, 1, 2]
  busiest = lambda order: max(estimate_cp_imbalance(
      *permute_documents(order, cu, cu), _nlb(4)).pairs_per_rank)
  assert busiest(got) <= busiest(want)


def test_bad_metadata_and_orders_raise():
  cu = np.array([0, 10, 30, 64])
  with pytest.raises(ValueError, match="cp_size|divisible"):
    balance_document_order(cu, cu, _nlb(5))
  with pytest.raises(ValueError, match="concrete"):
    jax.jit(lambda c: balance_document_order(c, c, _nlb(2)))(
        jnp.asarray(cu))
  with pytest.raises(ValueError, match="permutation"):
    permute_documents(np.array([0, 0, 1]), cu, cu)
  with pytest.raises(ValueError, match="shape"):
    permute_documents(np.array([0, 1]), cu, cu)
  with pytest.raises(ValueError, match="tokens on axis"):
    permute_documents(np.array([2, 0, 1]), cu, cu, np.zeros(63))
  with pytest.raises(ValueError, match="batch"):
    permute_documents(np.array([[2, 0, 1]]), cu[None], cu[None],
                      np.zeros((2, 64)), seq_dim=1)


def test_recommend_strategy_on_reordered_rows():
  """reorder_documents=True estimates NO_LOAD_BALANCE on the balanced row:
  the same as estimating the reordered metadata directly, and never
  heavier than the row as given."""
  rng = np.random.default_rng(4)
  lens = np.sort(rng.integers(1024, 8193, 12))[::-1]
  lens[-1] += (-lens.sum()) % 2
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  kw = dict(window_size=(255, 0), num_heads_q=32, num_heads_kv=8)
  given = recommend_strategy(cu, cu, 2, **kw)
  rec = recommend_strategy(cu, cu, 2, reorder_documents=True, **kw)
  order = balance_document_order(cu, cu, _nlb(2), window_size=(255, 0))
  cu2, cuP2 = permute_documents(order, cu, cu)
  want = estimate_cp_imbalance(cu2, cuP2, _nlb(2), **kw)
  got = rec.estimates["no_load_balance"]
  assert got.pairs_per_rank == want.pairs_per_rank
  assert got.imbalance < given.estimates["no_load_balance"].imbalance
  assert rec.estimates["dual_chunk_swap"] == \
      given.estimates["dual_chunk_swap"]
  assert "reordered" in rec.reason
