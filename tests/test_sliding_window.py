"""Causal sliding windows ``window_size=(left, 0)``: fused_attention,
cp_attention (both strategies, cp 1-8, forward and gradients), the
NO_LOAD_BALANCE halo bounded by the window, the cost model and the input
rules, against the windowed reference built from token positions
(tests/reference.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention.validation import check_window_size
from jax_cp.cp.exchange import choose_exchange
from jax_cp.data import get_position_ids, reorder_for_cp, restore_from_cp
from jax_cp.planning import estimate_cp_imbalance, recommend_strategy
from tests import reference as ref
from tests._devices import devices

T = 64           # tokens per row: cp=8 -> 8 local tokens
D = 8
HQ, HKV = 4, 2   # GQA everywhere
TOL = 1e-4       # float32


def rows(seed, cp, strategy):
  """Two packed rows: documents of every size (many shorter than the
  windows below) and one long document; DUAL_CHUNK_SWAP documents padded
  to multiples of 2*cp."""
  rng = np.random.default_rng(seed)
  dcs = strategy is S.DUAL_CHUNK_SWAP
  cus, cuPs = zip(*[ref.random_layout(rng, T, cp, kind, dual_chunk=dcs,
                                      max_docs=T)
                    for kind in ("many_short", "one_long")])
  return np.stack(cus), np.stack(cuPs), rng


def qkv(rng, batch=2):
  shapes = ((batch, T, HQ, D), (batch, T, HKV, D), (batch, T, HKV, D))
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in shapes)


def reference(q, k, v, cu, cuP, w, left):
  f = functools.partial(ref.batched_attention, cu=cu, cuP=cuP, window=left)
  out = f(q, k, v)
  grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)
  return out, grads


def run_cp(q, k, v, cu, cuP, w, *, cp, strategy, left, max_seqlen=None,
           backend="xla"):
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = CPLayout(mesh=mesh, cp_axis="cp", strategy=strategy,
                    backend=backend, max_seqlen=max_seqlen)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: restore_from_cp(x, cuP, layout, seq_dim=1)

  def loss(q, k, v, w):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout,
                              window_size=(left, 0))
    return jnp.sum(out * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(re(q), re(k), re(v), re(w))
  return back(out), tuple(back(g) for g in grads)


def check(got, want, valid, what):
  got, want = np.asarray(got), np.asarray(want)
  assert np.all(np.isfinite(got)), what
  np.testing.assert_array_equal(got[~valid], 0.0, err_msg=what)
  got, want = got[valid], want[valid]
  # Relative to the reference, or to O(1) entries where the reference is
  # ~0 (dq with window 0: a query that sees only itself has no dq).
  err = float(np.linalg.norm(got - want) / max(
      np.linalg.norm(want), 1e-2 * np.sqrt(want.size)))
  assert err < TOL, f"{what}: relative error {err:.2e}"


def check_cp(cp, strategy, left, seed=0, **kw):
  cu, cuP, rng = rows(seed, cp, strategy)
  q, k, v = qkv(rng)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  out, grads = run_cp(q, k, v, cu, cuP, w, cp=cp, strategy=strategy,
                      left=left, **kw)
  want, want_grads = reference(q, k, v, cu, cuP, w, left)
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  check(out, want, valid, "out")
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check(g, gw, valid, name)


# (cp, window): NO_LOAD_BALANCE chunks are T/cp = 64, 32, 16, 8 tokens;
# windows 0 and 1, below, equal to and above a chunk, and above many
# documents; the one-long-document row has DUAL_CHUNK_SWAP chunks of
# T/(2cp) = 32, 16, 8, 4 tokens.
CASES = [(1, 5), (2, 1), (4, 16), (8, 20)]
DCS_CASES = [(1, 0), (2, 16), (4, 3), (8, 0)]


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("cp,left", CASES)
def test_no_load_balance_matches_reference(cp, left):
  check_cp(cp, S.NO_LOAD_BALANCE, left)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("cp,left", DCS_CASES)
def test_dual_chunk_swap_matches_reference(cp, left):
  check_cp(cp, S.DUAL_CHUNK_SWAP, left)


def test_no_load_balance_window_and_max_seqlen():
  """The halo is min(left, max_seqlen - 1): here the window (a chunk and
  a half) is the tighter bound, over two hops."""
  cu, cuP, _ = rows(3, 4, S.NO_LOAD_BALANCE)
  longest = int(np.diff(cuP, axis=-1).max())
  check_cp(4, S.NO_LOAD_BALANCE, 24, seed=3, max_seqlen=longest)


# Two rows of padded documents [20, 30, 14] (valid [20, 27, 14]) and
# [5, 50, 9] (valid [5, 50, 7]): at cp = 2 (chunks of 32) and cp = 4 (16)
# documents straddle chunk boundaries from 11 to 43 tokens before them,
# shorter and longer than the windows below.
STRADDLE_CU = np.array([[0, 20, 47, 61], [0, 5, 55, 62]], np.int32)
STRADDLE_CU_P = np.array([[0, 20, 50, 64], [0, 5, 55, 64]], np.int32)


def check_straddle(cp, left, seed=0, **kw):
  """cp_attention on the straddle rows against the reference."""
  cu, cuP = STRADDLE_CU, STRADDLE_CU_P
  rng = np.random.default_rng(seed)
  q, k, v = qkv(rng)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  out, grads = run_cp(q, k, v, cu, cuP, w, cp=cp,
                      strategy=S.NO_LOAD_BALANCE, left=left, **kw)
  want, want_grads = reference(q, k, v, cu, cuP, w, left)
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  check(out, want, valid, "out")
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check(g, gw, valid, name)


# (cp, window): windows below and above a chunk (32 at cp 2, 16 at cp 4),
# shorter and longer than the straddling documents; a halo of 3, 5, 12 or
# 20 tokens, three hops (cp 4, window 40), or the all-gather (cp 2,
# window 40).
STRADDLE_CASES = [(2, 3), (2, 12), (2, 40), (4, 5), (4, 20), (4, 40)]


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("cp,left", STRADDLE_CASES)
def test_no_load_balance_straddle_with_window(cp, left):
  """NO_LOAD_BALANCE's straddle call with a window: in both directions a
  local call plus a halo call (reversed when not every row sees the whole
  halo), merged by log-sum-exp in the forward
  (jax_cp/cp/strategies/call_plan.py, _split_straddle)."""
  check_straddle(cp, left, seed=cp + left)


def test_no_load_balance_straddle_with_window_and_bound():
  """A max_seqlen bound next to the window: the halo is min(W - 1, left) =
  9 tokens, and the kernels' bounds are W's."""
  check_straddle(4, 9, seed=7, max_seqlen=50)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_load_balance_window_wider_than_chunk_and_bound(seed):
  """A window (30) wider than a chunk (16) plus the halo (11 = W - 1 for
  W = 12): every local row sees all the halo rows of its document, and the
  backward's halo call runs unmasked (call_plan.rows_before_chunk)."""
  rng = np.random.default_rng(seed)
  cu, cuP = ref.rows_with_longest(rng, T, 12, 2, T)
  q, k, v = qkv(rng)
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  out, grads = run_cp(q, k, v, cu, cuP, w, cp=4, strategy=S.NO_LOAD_BALANCE,
                      left=30, max_seqlen=12)
  want, want_grads = reference(q, k, v, cu, cuP, w, 30)
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  check(out, want, valid, "out")
  for name, g, gw in zip(("dq", "dk", "dv"), grads, want_grads):
    check(g, gw, valid, name)


@pytest.mark.slow
@pytest.mark.parametrize("left", [0, 1, 7, 8, 9, 33])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_window_grid(cp, strategy, left):
  check_cp(cp, strategy, left, seed=cp + left)


def test_cp_attention_local_view_with_window():
  """The local view inside a caller's shard_map, one row [T, H, D]."""
  cp, left = 4, 6
  cu, cuP, rng = rows(5, cp, S.NO_LOAD_BALANCE)
  cu, cuP = cu[0], cuP[0]
  q, k, v = (x[0] for x in qkv(rng))
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  spec = jax.sharding.PartitionSpec("cp")
  layout = CPLayout(cp_axis="cp", strategy=S.NO_LOAD_BALANCE, backend="xla",
                    view="local")
  local = functools.partial(jax_cp.cp_attention, layout=layout,
                            window_size=(left, 0))
  f = jax.shard_map(lambda q, k, v: local(q, k, v, (cu, cuP)), mesh=mesh,
                    in_specs=(spec,) * 3, out_specs=spec)
  got = jax.jit(f)(q, k, v)
  want = ref.attention(q, k, v, cu, cuP, window=left)
  check(got, want, ref.valid_token_mask(cu, cuP), "out")


# ------------------------------------------------------------------ exchange


def _lowered_text(cp, left, max_seqlen=None):
  cu, cuP, rng = rows(0, cp, S.NO_LOAD_BALANCE)
  q, k, v = qkv(rng)
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = CPLayout(mesh=mesh, strategy=S.NO_LOAD_BALANCE, backend="xla",
                    max_seqlen=max_seqlen)

  def loss(q, k, v):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout,
                              window_size=(left, 0))
    return jnp.sum(out)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()


@pytest.mark.parametrize("left", [5, 12])
def test_no_load_balance_window_exchanges_halo_only(left):
  """Forward and backward move K/V with collective permutes only (no
  all-gather, no reduce-scatter), without max_seqlen; a window above a
  chunk (12 > 8 tokens) takes two hops."""
  text = _lowered_text(8, left)
  assert "collective_permute" in text
  for op in ("all_gather", "reduce_scatter", "all_reduce"):
    assert op not in text, op
  hops = -(-left // 8)
  assert text.count("collective_permute") >= 2 * hops


def test_window_zero_exchanges_nothing():
  text = _lowered_text(4, 0)
  for op in ("collective_permute", "all_gather", "reduce_scatter"):
    assert op not in text, op


def test_choose_exchange_bounds_halo_by_window():
  ex = choose_exchange(True, "cp", 4, 64, 64, window_left=5)
  assert (ex.kind, ex.halo_tokens) == ("halo", 5)
  ex = choose_exchange(True, "cp", 4, 64, 4, window_left=5)
  assert (ex.kind, ex.halo_tokens) == ("halo", 3)
  assert choose_exchange(True, "cp", 4, 64, 64, window_left=0).kind == "none"
  # A halo reaching rank 0 anyway: the all-gather.
  assert choose_exchange(True, "cp", 4, 64, 64,
                         window_left=48).kind == "all_gather"
  assert choose_exchange(False, "cp", 4, 64, 64,
                         window_left=5).kind == "all_gather"


# ------------------------------------------------------------ fused_attention


@pytest.mark.parametrize("left", [0, 3, 40])
def test_fused_attention_window_top_left_and_bottom_right(left):
  """Whole documents (top-left == bottom-right) and a bottom-right call
  whose Q rows are the last rows of each document: both see the window in
  document positions."""
  rng = np.random.default_rng(left)
  cu = np.array([0, 9, 30, 31, 64])
  q, k, v = (x[0] for x in qkv(rng, 1))
  want = ref.attention(q, k, v, cu, cu, window=left)
  lens, starts = np.diff(cu), cu[:-1]
  for mask in ("causal_top_left", "causal_bottom_right"):
    got = jax_cp.fused_attention(q, k, v, lens, lens, starts, starts,
                                 attn_mask_type=mask, backend="xla",
                                 window_size=(left, 0))
    check(got, want, np.ones(T, bool), mask)
  # Q: the last half of each document, against the whole document.
  q_lens = lens - lens // 2
  q_starts = starts + lens // 2
  rows_ = np.concatenate([np.arange(s, s + n) for s, n in
                          zip(q_starts, q_lens)])
  qq = jnp.zeros_like(q).at[rows_].set(q[rows_])
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def ours(q, k, v):
    return jax_cp.fused_attention(q, k, v, q_lens, lens, q_starts, starts,
                                  attn_mask_type="causal_bottom_right",
                                  backend="xla", window_size=(left, 0))

  def theirs(q, k, v):
    return ref.attention(q, k, v, cu, cu, window=left)

  covered = np.zeros(T, bool)
  covered[rows_] = True
  got = ours(qq, k, v)
  check(got, jnp.where(covered[:, None, None], theirs(q, k, v), 0), covered,
        "bottom_right")
  g_ours = jax.grad(lambda *a: jnp.sum(ours(*a) * dout), (0, 1, 2))(qq, k, v)
  mask_out = lambda o: jnp.where(covered[:, None, None], o, 0)
  g_ref = jax.grad(lambda *a: jnp.sum(mask_out(theirs(*a)) * dout),
                   (0, 1, 2))(q, k, v)
  check(g_ours[0], g_ref[0], covered, "dq")
  for name, a, b in zip(("dk", "dv"), g_ours[1:], g_ref[1:]):
    check(a, b, np.ones(T, bool), name)


# ------------------------------------------------------------------ cost model


def _brute_pairs(cu, cuP, cp, left, strategy):
  """Per-rank windowed pairs from the reference mask and the layout."""
  m = ref.doc_mask(cu, cuP, True, left)
  idx = np.arange(len(m))
  perm = np.asarray(reorder_for_cp(idx, cuP, CPLayout(cp_size=cp,
                                                      strategy=strategy)))
  per_token = m.sum(axis=1)[perm]
  return per_token.reshape(cp, -1).sum(axis=1)


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("left", [-1, 0, 5, 17])
def test_cost_model_counts_window_pairs(strategy, left):
  cp = 4
  cu, cuP, _ = rows(7, cp, strategy)
  cu, cuP = cu[0], cuP[0]
  est = estimate_cp_imbalance(cu, cuP, CPLayout(cp_size=cp,
                                                strategy=strategy),
                              window_size=(left, 0))
  np.testing.assert_array_equal(est.pairs_per_rank,
                                _brute_pairs(cu, cuP, cp, left, strategy))
  if strategy is S.NO_LOAD_BALANCE and left >= 0:
    token = 2 * 1 * 128 * 2
    assert est.halo_bytes_per_rank == tuple(
        min(left, r * (T // cp)) * token for r in range(cp))


def test_recommend_strategy_prefers_no_load_balance_with_window():
  cu = np.array([0, 65536])
  rec = recommend_strategy(cu, cu, 2, num_heads_q=32, num_heads_kv=8,
                           window_size=(4095, 0))
  nlb = rec.estimates["no_load_balance"]
  assert rec.strategy is S.NO_LOAD_BALANCE
  assert nlb.imbalance < 1.04
  assert nlb.halo_bytes == 4095 * 8 * 128 * 2 * 2
  plain = estimate_cp_imbalance(cu, cu, CPLayout(cp_size=2,
                                                 strategy=S.NO_LOAD_BALANCE))
  assert plain.imbalance > 1.4


# ------------------------------------------------------------------ input rules


BAD_WINDOWS = [((-2, 0), "causal", ">= 0"),
               ((4, 2), "causal", "right window must be 0"),
               ((4, -1), "causal", "right window must be 0"),
               ((4, 0), "no_mask", "needs a causal mask"),
               ((4,), "causal", "pair"),
               ((4.0, 0), "causal", "static int")]


@pytest.mark.parametrize("window,mask,rule", BAD_WINDOWS)
def test_bad_window_raises_in_cp_attention(window, mask, rule):
  cu, cuP, rng = rows(0, 2, S.DUAL_CHUNK_SWAP)
  q, k, v = qkv(rng)
  layout = CPLayout(mesh=jax.sharding.Mesh(np.array(devices(2)), ("cp",)),
                    backend="xla")
  with pytest.raises(ValueError, match="window_size") as e:
    jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout,
                        attn_mask_type=mask, window_size=window)
  assert rule in str(e.value)


# The fused_attention masks of the CP masks above.
FUSED_MASKS = {"causal": "causal_bottom_right", "no_mask": "no_mask"}


@pytest.mark.parametrize("window,mask,rule", BAD_WINDOWS)
def test_bad_window_raises_in_fused_attention(window, mask, rule):
  q, k, v = (x[0] for x in qkv(np.random.default_rng(0), 1))
  lens, offs = np.array([T]), np.array([0])
  with pytest.raises(ValueError, match="window_size") as e:
    jax_cp.fused_attention(q, k, v, lens, lens, offs, offs, backend="xla",
                           attn_mask_type=FUSED_MASKS[mask],
                           window_size=window)
  assert rule in str(e.value)


def test_unbounded_windows_are_plain_attention():
  """(-1, 0) is plain causal and (-1, -1) no bound at all, with any mask."""
  assert check_window_size(None, "causal") == -1
  assert check_window_size((-1, 0), "causal") == -1
  assert check_window_size((-1, -1), "no_mask") == -1
  assert check_window_size((0, 0), "causal") == 0


# ------------------------------------------------------------------ Flax


def test_flax_layers_alternate_local_and_global():
  """One model, a windowed layer then a global one: with CP
  (NO_LOAD_BALANCE, cp=4, global view) it gives the output of the same
  model without CP; the window changes the result."""
  import flax.linen as nn

  from jax_cp.flax import TransformerLayer

  cp = 4
  cu, cuP, rng = rows(11, cp, S.NO_LOAD_BALANCE)
  x = jnp.asarray(rng.standard_normal((2, T, 16)), jnp.float32)
  pos = get_position_ids(cuP, total_tokens=T)

  class Model(nn.Module):
    windows: tuple
    layout: CPLayout

    @nn.compact
    def __call__(self, x, pos):
      for i, window in enumerate(self.windows):
        x = TransformerLayer(num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                             mlp_dim=32, window_size=window,
                             name=f"layer_{i}", layout=self.layout)(
                                 x, cu, cuP, pos)
      return x

  windows = ((5, 0), None)
  no_cp = CPLayout(cp_axis=None, backend="xla")
  plain = Model(windows, no_cp)
  params = jax.jit(lambda x: plain.init(jax.random.key(0), x, pos))(x)
  want = plain.apply(params, x, pos)
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = CPLayout(mesh=mesh, strategy="no_load_balance", backend="xla")
  model = Model(windows, layout)
  re = lambda a: reorder_for_cp(a, cuP, layout, seq_dim=1)
  got = jax.jit(model.apply)(params, re(x), re(pos))
  got = restore_from_cp(got, cuP, layout, seq_dim=1)
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid],
                             rtol=1e-4, atol=1e-4)
  global_only = Model((None, None), no_cp).apply(params, x, pos)
  assert not np.allclose(np.asarray(global_only)[valid],
                         np.asarray(want)[valid], atol=1e-3)


def test_flax_dot_product_attention_window_matches_reference():
  from jax_cp.flax import DotProductAttention

  cu, cuP, rng = rows(12, 1, S.NO_LOAD_BALANCE)
  q, k, v = qkv(rng)
  mod = DotProductAttention(window_size=(3, 0),
                            layout=CPLayout(cp_axis=None, backend="xla"))
  got = mod.apply({}, q, k, v, cu, cuP)
  want = ref.batched_attention(q, k, v, cu, cuP, window=3)
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  check(got, want, valid, "out")
  with pytest.raises(ValueError, match="window_size"):
    DotProductAttention(window_size=(3, 0), attn_mask_type="no_mask")
  with pytest.raises(ValueError, match="window_size"):
    from jax_cp.flax import TransformerLayer
    TransformerLayer(num_heads=2, window_size=(-3, 0))

