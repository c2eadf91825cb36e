"""cp_attention with backend="cudnn" over 2, 4 (and 8) GPUs: forward and
gradients against plain float32 attention on one GPU (marker gpu)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import longest_padded_document, reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

pytestmark = pytest.mark.gpu

T, HQ, HKV, D = 4096, 8, 2, 128


def _rows(rng, cp, strategy, kind):
  cu, cuP = ref.random_layout(rng, T, cp, kind,
                              dual_chunk=strategy == S.DUAL_CHUNK_SWAP,
                              max_docs=96)
  return cu[None], cuP[None]


@pytest.mark.parametrize("kind", ["one_long", "mixed", "many_short"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_attention_cudnn_matches_reference(cp, strategy, kind,
                                              record_error):
  gpus = devices(cp, "gpu")
  pytest.importorskip("jax_cp.attention.cudnn.backend")
  rng = np.random.default_rng(cp * 10 + len(kind))
  cu, cuP = _rows(rng, cp, strategy, kind)
  q = jnp.asarray(rng.standard_normal((1, T, HQ, D)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((1, T, HKV, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((1, T, HKV, D)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((1, T, HQ, D)), jnp.float32)
  mesh = jax.make_mesh((cp,), ("cp",), devices=gpus,
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, backend="cudnn", strategy=strategy,
                    max_seqlen=longest_padded_document(cuP))
  attn = functools.partial(jax_cp.cp_attention, layout=layout)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  back = lambda x: np.asarray(restore_from_cp(
      jax.device_get(x), cuP, layout, seq_dim=1), np.float32)
  out = jax.jit(lambda q, k, v: attn(q, k, v, (cu, cuP)))(re(q), re(k),
                                                          re(v))
  grads = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(
      attn(q, k, v, (cu, cuP)).astype(jnp.float32) * w),
      argnums=(0, 1, 2)))(
          re(q), re(k), re(v), re(w))
  with jax.default_device(gpus[0]):
    f = lambda q, k, v: ref.batched_attention(q, k, v, cu, cuP)
    want = f(q, k, v)
    want_grads = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
        q, k, v)
  valid = ref.valid_token_mask(cu[0], cuP[0])[None]
  for name, got, exp in zip(("out", "dq", "dk", "dv"),
                            (out,) + tuple(grads), (want,) + tuple(want_grads)):
    got = back(got)
    exp = np.asarray(exp, np.float32)
    assert np.isfinite(got).all(), name
    err = ref.rel_err(got[valid], exp[valid])
    record_error(jnp.bfloat16, f"cp{cp}-{name}", err)
    assert err < 2e-2, (name, err)
    np.testing.assert_array_equal(got[~valid], 0.0, err_msg=name)
