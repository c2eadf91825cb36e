"""Every validation rule raises a ValueError naming the offending setting,
before any kernel runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPBatch, CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import get_batch_on_this_cp_rank, get_partition_indices
from tests._devices import devices

CP = 2
T = 16
CU = np.array([0, 6, 10, 14], np.int32)
CUP = np.array([0, 8, 12, 16], np.int32)


def mesh(cp=CP):
  return jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))


def qkv(t=T, hq=4, hkv=2, d=8, dtype=jnp.float32, tkv=None, dk=None):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
  k = jnp.asarray(rng.standard_normal((tkv or t, hkv, dk or d)), dtype)
  v = jnp.asarray(rng.standard_normal((tkv or t, hkv, dk or d)), dtype)
  return q, k, v


def nlb(**changes):
  """The tests' layout (NO_LOAD_BALANCE on the xla backend over a cp mesh
  of CP devices), with ``changes``."""
  fields = dict(mesh=mesh(), backend="xla", strategy=S.NO_LOAD_BALANCE)
  return CPLayout(**{**fields, **changes})


def nlb_size(cp):
  """A NO_LOAD_BALANCE layout of ``cp`` ranks, for the data functions."""
  return CPLayout(cp_size=cp, strategy=S.NO_LOAD_BALANCE)


def call(q, k, v, cu=CU, cuP=CUP, *, layout=None, **kw):
  """cp_attention on ``layout`` (default :func:`nlb`), compiled once (the
  metadata stay what they are: constants when given as values, so their
  checks by value run as in an eager call; eagerly every op of the
  ``shard_map`` would dispatch on its own)."""
  return jax.jit(lambda q, k, v: jax_cp.cp_attention(
      q, k, v, (cu, cuP), layout=layout or nlb(), **kw))(q, k, v)


@pytest.mark.parametrize("kwargs, match", [
    (dict(attn_mask_type="no_mask"), "needs causal attention"),
    (dict(window_size=(4, 2)), "window_size"),
    (dict(window_size=(-3, 0)), "window_size"),
    (dict(attn_mask_type="padding_causal_bottom_right"), "attn_mask_type"),
])
def test_no_load_balance_config_rules(kwargs, match):
  with pytest.raises(ValueError, match=match):
    call(*qkv(), **kwargs)


def test_cross_attention_rejected():
  with pytest.raises(ValueError, match="cross-attention"):
    call(*qkv(tkv=32), cuP=CUP)


def test_fp8_rejected():
  with pytest.raises(ValueError, match="FP8"):
    call(*qkv(dtype=jnp.float8_e4m3fn))


def test_dual_chunk_divisibility_concrete():
  # cp=4: padded lengths 8, 4, 4 must be multiples of 8.
  with pytest.raises(ValueError, match=r"divisible by 2\*cp_size=8.*document 1"
                     r" \(row 0\) has padded length 4"):
    call(*qkv(), layout=nlb(mesh=mesh(4), strategy=S.DUAL_CHUNK_SWAP))
  with pytest.raises(ValueError, match="2\\*cp_size=8"):
    get_partition_indices(CUP, CPLayout(cp_size=4), 0)
  with pytest.raises(ValueError, match="2\\*cp_size=8"):
    get_batch_on_this_cp_rank(CUP, np.arange(T), layout=CPLayout(cp_size=4),
                              cp_rank=0)


def test_tokens_not_divisible_by_cp():
  cuP = np.array([0, 15], np.int32)
  with pytest.raises(ValueError, match="divisible by cp_size=2"):
    call(*qkv(t=15), cu=np.array([0, 15]), cuP=cuP)
  with pytest.raises(ValueError, match="divisible by cp_size=4"):
    get_partition_indices(np.array([0, 18]), nlb_size(4), 0)


def test_non_monotonic_cu_seqlens_padded():
  cuP = np.array([0, 10, 8, 16], np.int32)
  with pytest.raises(ValueError, match="non-decreasing"):
    call(*qkv(), cu=np.array([0, 4, 6, 10]), cuP=cuP)
  with pytest.raises(ValueError, match="non-decreasing"):
    get_partition_indices(cuP, nlb_size(2), 0)
  with pytest.raises(ValueError, match="must start at 0"):
    get_partition_indices(np.array([2, 16]), nlb_size(2), 0)


def test_valid_length_above_padded():
  with pytest.raises(ValueError, match="valid length 9 above its padded "
                     "length 8"):
    call(*qkv(), cu=np.array([0, 9, 12, 16]))


def test_token_count_must_match_metadata():
  with pytest.raises(ValueError, match=r"cu_seqlens_padded\[-1\]=16 must "
                     "equal the token count T=32"):
    call(*qkv(t=32))
  with pytest.raises(ValueError, match="tensors\\[0\\] has 20 tokens"):
    get_batch_on_this_cp_rank(CUP, np.arange(20), layout=nlb_size(2),
                              cp_rank=0)


def test_heads_rules():
  with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple "
                     r"of the number of key/value heads \(3\)"):
    call(*qkv(hkv=3))
  with pytest.raises(ValueError, match="head dims differ: q has 8, k/v have "
                     "16"):
    call(*qkv(dk=16))


def test_mesh_without_axis():
  with pytest.raises(ValueError, match="cp_axis='seq' is not an axis of the "
                     "mesh"):
    call(*qkv(), layout=nlb(cp_axis="seq"))
  with pytest.raises(ValueError, match="batch_axis='data'"):
    q, k, v = qkv()
    call(q[None], k[None], v[None], cu=CU[None], cuP=CUP[None],
         layout=nlb(batch_axis="data"))
  with pytest.raises(ValueError, match="needs a mesh"):
    call(*qkv(), layout=nlb(mesh=None))


def test_unknown_strategy_and_backend():
  with pytest.raises(ValueError, match="strategy='ring' is not a "
                     "CPLoadBalancingStrategy"):
    call(*qkv(), layout=nlb(strategy="ring"))
  with pytest.raises(ValueError, match="backend='triton' is not available"):
    call(*qkv(), layout=nlb(backend="triton"))


def test_max_seqlen_below_longest_document():
  # NO_LOAD_BALANCE counts valid lengths (the longest is 6, in a slot of 8).
  call(*qkv(), layout=nlb(max_seqlen=6))
  with pytest.raises(ValueError, match="max_seqlen=5 is smaller than the "
                     "longest padded document \\(8 tokens\\).*valid "
                     "length 6"):
    call(*qkv(), layout=nlb(max_seqlen=5))


def test_traced_metadata_still_checks_shapes_and_config():
  """Under jit the values are unknown, but configuration errors still come
  at trace time."""
  q, k, v = qkv()
  f = jax.jit(lambda cu, cuP: call(q, k, v, cu, cuP, attn_mask_type="no_mask"))
  with pytest.raises(ValueError, match="needs causal attention"):
    f(CU, CUP)
  g = jax.jit(lambda cu, cuP: call(q, k, v, cu, cuP))
  with pytest.raises(ValueError, match="cu_seqlens must be \\[N\\+1\\]"):
    g(CU[None], CUP[None])


def test_metadata_needs_a_layout_or_a_batch():
  """Raw metadata arrays carry no layout: cp_attention without one raises,
  naming it; metadata that are neither a CPBatch nor the pair of arrays
  raise, naming what they are; so does a pair with a missing array."""
  q, k, v = qkv()
  with pytest.raises(ValueError, match="cp_attention needs a layout: pass "
                     "layout=jax_cp.CPLayout"):
    jax_cp.cp_attention(q, k, v, (CU, CUP))
  for metadata, name in ((CU, "ndarray"), ((CU, CUP, CUP), "tuple"),
                         ({"cu": CU}, "dict")):
    with pytest.raises(ValueError, match="metadata must be a "
                       "jax_cp.CPBatch or the pair \\(cu_seqlens, "
                       f"cu_seqlens_padded\\), got {name}"):
      jax_cp.cp_attention(q, k, v, metadata, layout=nlb())
  with pytest.raises(ValueError, match="needs both cu_seqlens and "
                     "cu_seqlens_padded"):
    jax_cp.cp_attention(q, k, v, (CU, None), layout=nlb())
  with pytest.raises(ValueError, match="layout must be a jax_cp.CPLayout"):
    jax_cp.cp_attention(q, k, v, (CU, CUP), layout="no_load_balance")


@pytest.mark.parametrize("field", ["strategy", "cp_axis", "cp_size"])
def test_batch_with_another_token_placement_raises(field):
  """A CPBatch given with a layout that places its tokens elsewhere
  (another strategy, cp axis or cp size) raises, naming the field; a
  layout that differs in what does not move tokens (here the bound) is
  accepted."""
  q, k, v = qkv()
  batch = CPBatch(None, CUP, CU, layout=nlb())
  other = {
      "strategy": lambda: nlb(strategy=S.DUAL_CHUNK_SWAP),
      "cp_axis": lambda: nlb(mesh=jax.make_mesh(
          (CP,), ("tokens",), devices=devices(CP)), cp_axis="tokens"),
      "cp_size": lambda: nlb(mesh=mesh(4)),
  }[field]()
  with pytest.raises(ValueError, match="laid out with another CPLayout "
                     f"\\({field}: "):
    jax_cp.cp_attention(q, k, v, batch, layout=other)
  out = jax.jit(lambda q, k, v: jax_cp.cp_attention(
      q, k, v, batch, layout=nlb(max_seqlen=8)))(q, k, v)
  assert out.shape == q.shape


def test_fused_attention_rules():
  q, k, v = qkv()
  lens = jnp.array([6, 10], jnp.int32)
  offs = jnp.array([0, 6], jnp.int32)
  with pytest.raises(ValueError, match="attn_mask_type='sliding'"):
    jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                           attn_mask_type="sliding")
  with pytest.raises(ValueError, match="segment metadata"):
    jax_cp.fused_attention(q, k, v, lens, lens[:1], offs, offs)
  with pytest.raises(ValueError, match="q_seqlens holds a segment of length "
                     "10 above its bound 8"):
    jax_cp.fused_attention(q, k, v, lens, lens, offs, offs, max_seqlen_q=8)
  with pytest.raises(ValueError, match="softmax_scale"):
    jax_cp.fused_attention(q, k, v, lens, lens, offs, offs,
                           softmax_scale=-1.0)
