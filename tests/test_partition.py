"""Partitioning: published cases, properties over random layouts, numpy vs
jnp paths, reorder/restore, position ids."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.cp.strategies import no_load_balance
from jax_cp.data import (
  get_batch_on_this_cp_rank,
  get_partition_indices,
  get_position_ids,
  reorder_for_cp,
  restore_from_cp,
)
from tests.reference import random_layout

KINDS = ("one_long", "many_short", "mixed")


def _layout(cp, strategy=S.DUAL_CHUNK_SWAP):
  return CPLayout(cp_size=cp, strategy=strategy)


def brute_indices(cuP, cp, r, strategy):
  """Independent per-rank indices, written from the layout definitions."""
  t = int(cuP[-1])
  if strategy == S.NO_LOAD_BALANCE:
    return list(range(r * t // cp, (r + 1) * t // cp))
  out = []
  for b in range(len(cuP) - 1):
    c = (cuP[b + 1] - cuP[b]) // (2 * cp)
    for chunk in (r, 2 * cp - 1 - r):
      out.extend(range(cuP[b] + chunk * c, cuP[b] + (chunk + 1) * c))
  return out


def test_published_cases():
  np.testing.assert_array_equal(
      get_partition_indices(np.array([0, 8, 16]), _layout(2), 0),
      [0, 1, 6, 7, 8, 9, 14, 15])
  np.testing.assert_array_equal(
      get_partition_indices(np.array([0, 12]),
                            _layout(4, S.NO_LOAD_BALANCE), 2), [6, 7, 8])
  m = no_load_balance.no_load_balance_step(jnp.array([0, 6, 10]),
                                    jnp.array([0, 8, 12]), 2, 1, 12)
  # The same metadata in cumulative form.
  np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(m.q_lens)]),
                                [0, 0, 4])
  np.testing.assert_array_equal(np.append(m.q_offsets, 6), [0, 2, 6])
  np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(m.kv_lens)]),
                                [0, 6, 10])


def test_strategy_enum():
  assert S("no_load_balance") is S.NO_LOAD_BALANCE
  assert S("DUAL_CHUNK_SWAP") is S.DUAL_CHUNK_SWAP
  assert S.DUAL_CHUNK_SWAP == "dual_chunk_swap"
  assert hash(S.NO_LOAD_BALANCE) == hash(S("no_load_balance"))
  assert str(S.NO_LOAD_BALANCE) == "no_load_balance"
  f = jax.jit(lambda x, s: x + (1 if s is S.NO_LOAD_BALANCE else 2),
              static_argnums=1)
  assert int(f(0, S.NO_LOAD_BALANCE)) == 1 and int(f(0, S.DUAL_CHUNK_SWAP)) == 2
  with pytest.raises(ValueError, match="strategy='ring'"):
    _layout(2, "ring")


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("strategy", list(S))
@pytest.mark.parametrize("kind", KINDS)
def test_partition_properties(cp, strategy, kind):
  rng = np.random.default_rng(hash((cp, strategy.value, kind)) % 2**32)
  for trial in range(3):
    total = 2 * cp * int(rng.integers(4, 40))
    _, cuP = random_layout(rng, total, cp, kind,
                           dual_chunk=strategy == S.DUAL_CHUNK_SWAP,
                           max_docs=None if trial == 0 else 64)
    layout = _layout(cp, strategy)
    parts = [get_partition_indices(cuP, layout, r) for r in range(cp)]
    for r, p in enumerate(parts):
      assert p.dtype == np.int32 and p.shape == (total // cp,)
      np.testing.assert_array_equal(p, brute_indices(cuP, cp, r, strategy))
    # Every token exactly once.
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)),
                                  np.arange(total))
    # The jnp path, traced rank and traced metadata, gives the same.
    f = jax.jit(lambda c, r, layout=layout, total=total:
                get_partition_indices(c, layout, r, total_tokens=total))
    for r in range(cp):
      np.testing.assert_array_equal(f(jnp.asarray(cuP), jnp.int32(r)),
                                    parts[r])
    # Reorder / restore: inverses; contiguous split = partition indices.
    x = rng.standard_normal((total, 3)).astype(np.float32)
    xr = reorder_for_cp(x, cuP, layout)
    for r in range(cp):
      chunk = xr[r * total // cp:(r + 1) * total // cp]
      np.testing.assert_array_equal(chunk, x[parts[r]])
    np.testing.assert_array_equal(restore_from_cp(xr, cuP, layout), x)
    xj = jax.jit(lambda a, cuP=cuP, layout=layout: restore_from_cp(
        reorder_for_cp(a, cuP, layout), cuP, layout))(x)
    np.testing.assert_array_equal(xj, x)


def test_get_batch_on_this_cp_rank_and_position_ids():
  rng = np.random.default_rng(1)
  cp = 4
  cu, cuP = random_layout(rng, 96, cp, "mixed", max_docs=12)
  tokens = rng.integers(0, 256, size=96)
  labels = np.roll(tokens, -1)
  pos = get_position_ids(cuP)
  for b in range(12):
    np.testing.assert_array_equal(pos[cuP[b]:cuP[b + 1]],
                                  np.arange(cuP[b + 1] - cuP[b]))
  for strategy in S:
    layout = _layout(cp, strategy)
    for r in range(cp):
      got = get_batch_on_this_cp_rank(cuP, tokens, labels, pos,
                                      layout=layout, cp_rank=r)
      idx = get_partition_indices(cuP, layout, r)
      for g, full in zip(got, (tokens, labels, pos)):
        np.testing.assert_array_equal(g, full[idx])
      # The jnp path with a traced rank.
      got_j = jax.jit(lambda t, r_, layout=layout: get_batch_on_this_cp_rank(
          jnp.asarray(cuP), t, layout=layout, cp_rank=r_))(
              jnp.asarray(tokens), jnp.int32(r))
      np.testing.assert_array_equal(got_j[0], tokens[idx])
  np.testing.assert_array_equal(
      jax.jit(lambda c: get_position_ids(c, total_tokens=96))(
          jnp.asarray(cuP)), pos)


def test_batched_metadata_rows():
  rng = np.random.default_rng(2)
  cp = 2
  rows = [random_layout(rng, 64, cp, k, max_docs=40)[1]
          for k in ("one_long", "many_short", "mixed")]
  cuP = np.stack(rows)
  x = rng.standard_normal((3, 64, 2)).astype(np.float32)
  for strategy, r in itertools.product(S, range(cp)):
    layout = _layout(cp, strategy)
    (got,) = get_batch_on_this_cp_rank(cuP, x, layout=layout, cp_rank=r,
                                       seq_dim=1)
    for i in range(3):
      idx = get_partition_indices(cuP[i], layout, r)
      np.testing.assert_array_equal(got[i], x[i, idx])
    xr = reorder_for_cp(x, cuP, layout, seq_dim=1)
    np.testing.assert_array_equal(
        restore_from_cp(xr, cuP, layout, seq_dim=1), x)


def test_cp_size_one_is_identity_for_any_lengths():
  """At cp=1 nothing is chunked, so odd padded lengths are fine."""
  cuP = np.array([0, 5, 12], np.int32)
  for strategy in S:
    layout = _layout(1, strategy)
    np.testing.assert_array_equal(
        get_partition_indices(cuP, layout, 0), np.arange(12))
    x = np.arange(12)
    np.testing.assert_array_equal(reorder_for_cp(x, cuP, layout), x)
