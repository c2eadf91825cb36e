"""The cuDNN SDPA backward's frontend workspace formula
(:mod:`jax_cp.attention.cudnn.workspace`) against the shapes: the 12.95 GB
asked for at T = 1M (Hq 16, Hkv 4, D 64), and how each buffer scales."""

import pytest

from jax_cp.attention.cudnn.workspace import (
  DEFAULT_BACKWARD_SCRATCH_LIMIT,
  SCRATCH_LIMIT_ENV,
  backward_head_groups,
  backward_scratch_limit,
  backward_workspace,
  backward_workspace_bytes,
)

MIB = 1 << 20


def test_one_million_tokens_asks_for_12_95_gb():
  """At T = 2**20, Hq 16, Hkv 4, D 64: dQ 4 GiB, dK + dV at 16 heads 8 GiB,
  sums 64 MiB; 12.95 GB in all, the size the failed allocation named."""
  t = 1 << 20
  ws = backward_workspace(t, t, 16, 4, 64)
  assert ws.dq_accum == 4096 * MIB
  assert ws.dk_full_heads == ws.dv_full_heads == 4096 * MIB
  assert ws.softmax_sum == 64 * MIB
  assert ws.total == backward_workspace_bytes(t, t, 16, 4, 64)
  assert round(ws.total / 1e9, 2) == 12.95


def test_scaling():
  """Linear in the tokens (Q-side and KV-side buffers apart), no full-head
  dK/dV without GQA, and V's head dim sizes dV only."""
  base = backward_workspace(4096, 8192, 32, 8, 64)
  assert base.dq_accum == 4096 * 32 * 64 * 4
  assert base.dk_full_heads == 8192 * 32 * 64 * 4
  assert base.softmax_sum == 4096 * 32 * 4
  double_q = backward_workspace(8192, 8192, 32, 8, 64)
  assert double_q.dq_accum == 2 * base.dq_accum
  assert double_q.dk_full_heads == base.dk_full_heads
  mha = backward_workspace(4096, 8192, 32, 32, 64)
  assert mha.dk_full_heads == mha.dv_full_heads == 0
  assert mha.total == base.dq_accum + base.softmax_sum
  wide_v = backward_workspace(4096, 8192, 32, 8, 64, head_dim_v=128)
  assert wide_v.dv_full_heads == 2 * base.dv_full_heads
  assert wide_v.dk_full_heads == base.dk_full_heads


def test_without_packed_totals():
  """A head dim that is not a multiple of 16: the frontend sizes dQ and the
  sums by segments * max_seqlen_q and leaves dK/dV to cuDNN."""
  ws = backward_workspace(4096, 4096, 8, 2, 72, segments=10,
                          max_seqlen_q=1024)
  assert ws.dq_accum == 10 * 1024 * 8 * 72 * 4
  assert ws.softmax_sum == 10 * 1024 * 8 * 4
  assert ws.dk_full_heads == ws.dv_full_heads == 0
  with pytest.raises(ValueError, match="segments \\* max_seqlen_q"):
    backward_workspace(4096, 4096, 8, 2, 72)


def test_bad_arguments():
  with pytest.raises(ValueError, match="heads_kv=3 must be positive and "
                     "divide heads_q=16"):
    backward_workspace(16, 16, 16, 3, 64)
  with pytest.raises(ValueError, match="tokens_q must be a non-negative int"):
    backward_workspace(-1, 16, 16, 4, 64)


def test_scratch_limit_from_the_environment():
  assert backward_scratch_limit({}) == DEFAULT_BACKWARD_SCRATCH_LIMIT == 2**32
  assert backward_scratch_limit({SCRATCH_LIMIT_ENV: " 1.5 "}) == 1.5 * 2**30
  assert backward_scratch_limit({SCRATCH_LIMIT_ENV: "inf"}) == float("inf")
  for bad in ("0", "-2", "four", "nan"):
    with pytest.raises(ValueError, match=f"{SCRATCH_LIMIT_ENV}='{bad}' must "
                       "be a positive number of GiB or 'inf'"):
      backward_scratch_limit({SCRATCH_LIMIT_ENV: bad})


def test_head_groups_bound_the_workspace():
  """The fewest whole GQA head groups whose workspace each fits the limit
  (4 GiB by default): 25.9 GB at 1M tokens of 32/8/64 heads in 8 calls of
  3.2 GB; 6.5 GB at 128k of 32/8/128 in 2; a CP-shaped call with 2M tokens
  of K/V (73 GB in one call) at one KV head per call, the finest split."""
  limit = DEFAULT_BACKWARD_SCRATCH_LIMIT
  t = 1 << 20
  assert round(backward_workspace_bytes(t, t, 32, 8, 64) / 1e9, 1) == 25.9
  assert backward_head_groups(t, t, 32, 8, 64, limit=limit) == 8
  assert backward_workspace_bytes(t, t, 4, 1, 64) <= limit
  assert backward_head_groups(t, t, 16, 4, 64, limit=limit) == 4
  assert backward_head_groups(131072, 131072, 32, 8, 128, limit=limit) == 2
  assert backward_head_groups(32768, 32768, 32, 8, 128, limit=limit) == 1
  assert backward_head_groups(262334, 2 * t, 32, 8, 128, limit=limit) == 8
  assert backward_workspace_bytes(262334, 2 * t, 4, 1, 128) > limit
  assert backward_head_groups(t, t, 32, 8, 64, limit=float("inf")) == 1
  # MHA: only the dQ side, split as finely as the heads allow.
  assert backward_head_groups(t, t, 8, 8, 128, limit=2**30) == 8
  # Slot-sized buffers (head dim not a multiple of 16) count as sized.
  assert backward_head_groups(4096, 4096, 8, 2, 72, segments=4096,
                              max_seqlen_q=4096, limit=limit) == 2
  with pytest.raises(ValueError, match="heads_kv=3"):
    backward_head_groups(16, 16, 16, 3, 64, limit=limit)
