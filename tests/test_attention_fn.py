"""jax_cp.cp_attention_fn inside Flax's own attention modules
(flax.nnx.MultiHeadAttention, flax.linen.MultiHeadDotProductAttention): the
same output as jax_cp's modules on the same parameters and as Flax's default
attention with the documents' causal mask (on valid tokens), with and
without CP; missing or wrong metadata raise."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import jax_cp
from jax_cp import CPLayout
from jax_cp import nnx as cp_nnx
from tests import reference as ref
from tests._devices import devices

CP, DP = 4, 2
B, T, E, H = 2, 64, 16, 2
CU_P = np.array([[0, 16, 48, 64, 64], [0, 24, 32, 64, 64]], np.int32)
CU = np.array([[0, 13, 40, 50, 50], [0, 20, 25, 56, 56]], np.int32)
NO_CP = CPLayout(cp_axis=None, backend="xla")


def _dense_mask():
  """[B, 1, T, T]: causal within each document, valid tokens only (the
  reference's own construction)."""
  return np.stack([ref.doc_mask(CU[r], CU_P[r])[None] for r in range(B)])


def _valid():
  return np.stack([ref.valid_token_mask(CU[r], CU_P[r]) for r in range(B)])


@pytest.fixture(scope="module")
def x():
  return np.random.default_rng(0).standard_normal((B, T, E)).astype(
      np.float32)


def _flax_nnx_mha(attention_fn=None):
  kwargs = {} if attention_fn is None else dict(attention_fn=attention_fn)
  return nnx.MultiHeadAttention(H, E, qkv_features=E, use_bias=False,
                                decode=False, rngs=nnx.Rngs(0), **kwargs)


def test_nnx_attention_fn_matches_modules_and_reference(x):
  batch = jax_cp.CPBatch(tensors=None, cu_seqlens_padded=CU_P,
                         cu_seqlens=CU, layout=NO_CP)
  mha = _flax_nnx_mha(jax_cp.cp_attention_fn(NO_CP))
  got = np.asarray(mha(x, mask=batch))

  ours = cp_nnx.MultiHeadAttention(H, E, rope_theta=None, layout=NO_CP,
                                   rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(mha, nnx.Param))
  np.testing.assert_allclose(got, ours(x, batch), rtol=1e-6, atol=1e-6)

  dense = _flax_nnx_mha()
  nnx.update(dense, nnx.state(mha, nnx.Param))
  want = np.asarray(dense(x, mask=_dense_mask()))
  valid = _valid()
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[~valid], 0.0)   # padding rows see nothing


def test_linen_attention_fn_matches_reference(x):
  batch = jax_cp.CPBatch(tensors=None, cu_seqlens_padded=CU_P,
                         cu_seqlens=CU, layout=NO_CP)
  mha = nn.MultiHeadDotProductAttention(
      num_heads=H, qkv_features=E, use_bias=False,
      attention_fn=jax_cp.cp_attention_fn(NO_CP))
  variables = jax.jit(lambda x: mha.init(jax.random.key(0), x, mask=batch))(x)
  got = np.asarray(jax.jit(lambda v, x, b: mha.apply(v, x, mask=b))(
      variables, x, batch))
  dense = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=E,
                                          use_bias=False)
  want = np.asarray(dense.apply(variables, x, mask=_dense_mask()))
  valid = _valid()
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["dual_chunk_swap", "no_load_balance"])
def test_nnx_attention_fn_with_cp_matches_no_cp(x, strategy):
  """Global view, cp=4: the batch from make_global_batch carries the
  layout; the output, restored to physical order, is the output without
  CP."""
  mesh = jax.make_mesh((DP, CP), ("data", "cp"), devices=devices(DP * CP))
  layout = CPLayout(mesh=mesh, strategy=strategy, batch_axis="data",
                    backend="xla")
  mha = _flax_nnx_mha(jax_cp.cp_attention_fn(layout))
  batch = jax_cp.data.make_global_batch(dict(x=x), CU_P, layout,
                                        cu_seqlens=CU)
  with jax.set_mesh(mesh):
    out = nnx.jit(lambda m, b: m(b.tensors["x"], mask=b))(mha, batch)
  got = jax_cp.data.restore_from_cp(np.asarray(out), CU_P, layout,
                                    seq_dim=1)

  no_cp = _flax_nnx_mha(jax_cp.cp_attention_fn(NO_CP))
  nnx.update(no_cp, nnx.state(mha, nnx.Param))
  want = no_cp(x, mask=jax_cp.CPBatch(None, CU_P, CU, layout=NO_CP))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_fn_sliding_window_matches_reference(x):
  batch = jax_cp.CPBatch(None, CU_P, CU, layout=NO_CP)
  mha = _flax_nnx_mha(jax_cp.cp_attention_fn(NO_CP, window_size=(3, 0)))
  got = np.asarray(mha(x, mask=batch))
  dense = _flax_nnx_mha()
  nnx.update(dense, nnx.state(mha, nnx.Param))
  mask = np.stack([ref.doc_mask(CU[r], CU_P[r], window=3)[None]
                   for r in range(B)])
  want = np.asarray(dense(x, mask=mask))
  valid = _valid()
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="window_size"):
    jax_cp.cp_attention_fn(NO_CP, window_size=(3, 1))


def test_attention_fn_rejects_missing_or_wrong_metadata(x):
  mha = _flax_nnx_mha(jax_cp.cp_attention_fn(NO_CP))
  with pytest.raises(ValueError, match="needs the packing metadata"):
    mha(x)
  with pytest.raises(ValueError, match="got ndarray"):
    mha(x, mask=_dense_mask())
  with pytest.raises(ValueError, match="has no cu_seqlens"):
    mha(x, mask=jax_cp.CPBatch(None, CU_P, layout=NO_CP))
  other = CPLayout(cp_size=CP, backend="xla")
  with pytest.raises(ValueError, match="another CPLayout"):
    mha(x, mask=jax_cp.CPBatch(None, CU_P, CU, layout=other))
  with pytest.raises(ValueError, match="sow attention weights"):
    mha(x, mask=jax_cp.CPBatch(None, CU_P, CU, layout=NO_CP), sow_weights=True)
  linen = nn.MultiHeadDotProductAttention(
      num_heads=H, qkv_features=E, attention_fn=jax_cp.cp_attention_fn())
  with pytest.raises(ValueError, match="needs the packing metadata"):
    linen.init(jax.random.key(0), x)
  drop = nnx.MultiHeadAttention(H, E, dropout_rate=0.1, decode=False,
                                attention_fn=jax_cp.cp_attention_fn(NO_CP),
                                rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dropout"):
    drop(x, mask=jax_cp.CPBatch(None, CU_P, CU, layout=NO_CP),
         deterministic=False)
