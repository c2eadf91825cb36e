"""jax_cp.planning's FLOP count, the one count: causal pairs against a mask
counted element by element, the MFU convention (attention backward 2x
forward, 6 FLOPs per matmul parameter per token), the hardware count with
the backward's recompute, and the cost model using it."""

import numpy as np
import pytest

from jax_cp import CPLayout, planning
from jax_cp.planning import cost_model, flops


def _mask_pairs(cu, left=None) -> int:
  """Query-key pairs of a causal (windowed) mask over each document,
  counted from the dense boolean mask."""
  total = 0
  for row in np.atleast_2d(cu):
    for n in np.diff(row):
      i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
      mask = j <= i
      if left is not None:
        mask &= i - j <= left
      total += int(mask.sum())
  return total


@pytest.mark.parametrize("left", [None, 0, 3, 40])
def test_causal_pairs_match_the_mask(left):
  rng = np.random.default_rng(left or 7)
  lens = rng.integers(0, 60, size=(3, 6))
  cu = np.concatenate([np.zeros((3, 1), int), np.cumsum(lens, 1)], 1)
  window = None if left is None else (left, 0)
  assert flops.causal_pairs(cu, window) == _mask_pairs(cu, left)
  assert flops.causal_pairs(cu[1], window) == _mask_pairs(cu[1], left)


def test_attention_flops_conventions():
  pairs, hq, d = 1234, 8, 64
  fwd = flops.attention_flops(pairs, num_heads=hq, head_dim=d,
                              backward=False)
  assert fwd == 4 * pairs * hq * d and isinstance(fwd, int)
  # MFU: backward 2x forward (no recompute); hardware: 2.5x.
  assert flops.attention_flops(pairs, num_heads=hq, head_dim=d) == 3 * fwd
  assert flops.attention_flops(pairs, num_heads=hq, head_dim=d,
                               recompute=True) == 3.5 * fwd
  per_rank = flops.attention_flops(np.array([1, 2]), num_heads=1,
                                   head_dim=1, backward=False)
  np.testing.assert_array_equal(per_rank, [4, 8])
  with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
    flops.attention_flops(1, num_heads=0, head_dim=8)
  with pytest.raises(ValueError, match="non-decreasing"):
    flops.causal_pairs([0, 5, 3])


def test_model_flops_of_a_step():
  cu = np.array([[0, 3, 10, 10]])         # documents of 3 and 7 tokens
  got = planning.model_flops(cu, tokens=16, matmul_params=100, num_layers=2,
                             num_heads=4, head_dim=8)
  pairs = 3 * 4 // 2 + 7 * 8 // 2
  assert got == 6 * 100 * 16 + 2 * 12 * pairs * 4 * 8
  hw = planning.model_flops(cu, tokens=16, matmul_params=100, num_layers=2,
                            num_heads=4, head_dim=8, recompute=True)
  assert hw == 6 * 100 * 16 + 2 * 14 * pairs * 4 * 8
  windowed = planning.model_flops(cu, tokens=16, matmul_params=0, num_layers=1,
                                  num_heads=1, head_dim=1, window_size=(1, 0))
  assert windowed == 12 * _mask_pairs(cu, 1)
  with pytest.raises(ValueError, match="tokens must be an int >= 0"):
    planning.model_flops(cu, tokens=-1, matmul_params=1, num_layers=1,
                         num_heads=1, head_dim=1)


def test_cost_model_counts_with_it():
  cu = np.array([0, 100, 356, 512])
  est = planning.estimate_cp_imbalance(
      cu, cu.copy(), CPLayout(cp_size=1, strategy="no_load_balance"),
      num_heads_q=8, head_dim=64)
  pairs = _mask_pairs(cu)
  assert est.total_flops == 4 * pairs * 8 * 64
  assert est.total_flops == flops.attention_flops(
      pairs, num_heads=8, head_dim=64, backward=False)
  assert cost_model.FWD_BWD_FLOP_FACTOR == 3.5


def test_attention_flops_do_not_wrap_at_int64():
  """Per-rank pairs as a numpy int64 array at 16M tokens and 128 heads of
  128: the FLOPs exceed int64 and stay exact Python ints."""
  from jax_cp.planning.flops import attention_flops
  t = 16 * 2**20
  pairs = np.array([t * (t + 1) // 2, t], np.int64)
  got = attention_flops(pairs, num_heads=128, head_dim=128, backward=False)
  want = [int(p) * 4 * 128 * 128 for p in pairs]
  assert [int(g) for g in got] == want and want[0] > 2**63
  assert attention_flops(np.int64(t), num_heads=128, head_dim=128,
                         backward=False) == t * 4 * 128 * 128
