"""The windowed DUAL_CHUNK_SWAP metadata
(jax_cp.cp.strategies.dual_chunk_window.window_compaction) finds each
row's document and segment by binary search: the same numbers as a
broadcast comparison (the reference here) on random rows, and no
intermediate that grows as tokens x documents (the jaxpr's shapes and the
compiled temp bytes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from jax_cp.cp.strategies import dual_chunk_swap as dcs
from jax_cp.cp.strategies import dual_chunk_window as dcw


def _count_le_reference(sorted_rows, i):
  """``[B, n]``: entries of each row ``<= i``, by a ``[B, n, S]``
  comparison."""
  return jnp.sum(sorted_rows[:, None, :] <= i[None, :, None], axis=-1,
                 dtype=jnp.int32)


def _rows(rng, b, t, n, cp, empty=False):
  """``[B, N+1]`` metadata: ``n`` documents per row of ``t`` tokens, padded
  to multiples of ``2 cp``, valid lengths random (some slots empty)."""
  unit, cu, cuP = 2 * cp, [], []
  for _ in range(b):
    slots = t // unit
    cuts = np.sort(rng.choice(np.arange(1, slots), n - 1, replace=False))
    plens = np.diff(np.concatenate([[0], cuts, [slots]])) * unit
    if empty:   # empty slots and a zero-length document in the middle
      plens[n // 2 + 1] += plens[n // 2]
      plens[n // 2] = 0
    lens = np.maximum(plens - rng.integers(0, unit + 3, n), 0)
    cuP.append(np.concatenate([[0], np.cumsum(plens)]))
    cu.append(np.concatenate([[0], np.cumsum(lens)]))
  return np.asarray(cu, np.int32), np.asarray(cuP, np.int32)


def _compaction(cu, cuP, cp, rank, left, static=None):
  """``window_compaction`` of both steps of rank ``rank``; ``static``:
  the numpy ``cuP`` that sizes it (default ``cuP``)."""
  static = cuP if static is None else static
  t = int(static[0, -1])
  tl, n = t // cp, static.shape[-1] - 1
  c = int(np.max(np.diff(static, axis=-1))) // (2 * cp)
  sq, skv = dcw.window_compaction_sizes(n, cp, left, c, tl, t)
  steps = tuple(dcs.dual_chunk_swap_step(cu, cuP, cp, rank, s)
                for s in (0, 1))
  return dcw.window_compaction(steps, cuP, cp, left, tl, t, sq, skv)


@pytest.mark.parametrize("cp, left, n, empty", [
    (2, 5, 7, False), (4, 17, 12, True), (8, 3, 5, False),
    (4, 200, 9, True)])
def test_window_compaction_equals_the_broadcast_formula(monkeypatch, cp,
                                                        left, n, empty):
  rng = np.random.default_rng(cp * 100 + left)
  cu, cuP = _rows(rng, 3, 64 * cp, n, cp, empty)
  for rank in range(cp):
    got = jax.tree.leaves(_compaction(cu, cuP, cp, rank, left))
    with monkeypatch.context() as m:
      m.setattr(dcw, "_count_le", _count_le_reference)
      want = jax.tree.leaves(_compaction(cu, cuP, cp, rank, left))
    assert len(got) == len(want) == 16
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # The reference sees what it should: a plan with work in it.
  near, far, rows = _compaction(cu, cuP, cp, 1, left)
  assert int(np.asarray(rows.q_valid).sum()) > 0
  assert int(np.asarray(near.q_lens).sum() + np.asarray(far.q_lens).sum())


def _shapes(jaxpr):
  """Every value's shape in ``jaxpr`` and the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield tuple(v.aval.shape)
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _shapes(sub)


def test_no_tokens_by_documents_intermediate():
  cp, left, t, n, b = 4, 64, 8192, 512, 2
  cu, cuP = _rows(np.random.default_rng(0), b, t, n, cp)
  def fn(cu_, cuP_, r):
    return _compaction(cu_, cuP_, cp, r, left, cuP)

  def biggest():   # a fresh function each time: no trace cache is reused
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(cu, cuP, jnp.int32(1)).jaxpr
    return max(np.prod(s, dtype=np.int64) for s in _shapes(jaxpr))

  assert biggest() <= 2 * b * t     # the [2, B, T] index maps at most
  with pytest.MonkeyPatch.context() as m:
    m.setattr(dcw, "_count_le", _count_le_reference)
    assert biggest() >= b * t * n   # the reference's [B, T, N] comparison
  compiled = jax.jit(fn).lower(cu, cuP, jnp.int32(1)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 4 * b * t * 2 * n / 32, temp
