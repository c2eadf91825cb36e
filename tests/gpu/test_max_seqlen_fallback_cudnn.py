"""cp_attention with backend="cudnn" and traced metadata holding a document
longer than ``max_seqlen``: the in-graph fallback (all-gather, bounds of the
row length) gives the reference results and gradients, where the bounded
kernels alone would be wrong (marker gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

pytestmark = pytest.mark.gpu

T, HQ, HKV, D, BOUND = 2048, 8, 2, 64, 256


def _metadata(plens, lens):
  cum = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)[None]
  return cum(lens), cum(plens)


# Padded lengths multiples of 8 (DUAL_CHUNK_SWAP up to cp=4); 9 slots.
WITHIN = _metadata([256, 128, 128, 256, 256, 256, 256, 256, 256],
                   [250, 100, 128, 7, 256, 200, 256, 256, 1])
BEYOND = _metadata([128, 1280, 256, 256, 128, 0, 0, 0, 0],
                   [128, 1111, 200, 256, 120, 0, 0, 0, 0])


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_fallback_on_cudnn_matches_reference(cp, strategy, record_error):
  gpus = devices(cp, "gpu")
  pytest.importorskip("jax_cp.attention.cudnn.backend")
  assert np.diff(WITHIN[1]).max() <= BOUND < np.diff(BEYOND[1]).max()
  rng = np.random.default_rng(cp)
  mk = lambda h, dt=jnp.bfloat16: jnp.asarray(
      rng.standard_normal((1, T, h, D)), dt)
  q, k, v, w = mk(HQ), mk(HKV), mk(HKV), mk(HQ, jnp.float32)
  mesh = jax.make_mesh((cp,), ("cp",), devices=gpus,
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, backend="cudnn", max_seqlen=BOUND,
                    strategy=strategy)

  def loss(q, k, v, cu, cuP):
    re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
    out = jax_cp.cp_attention(re(q), re(k), re(v), (cu, cuP), layout=layout)
    out = restore_from_cp(out, cuP, layout, seq_dim=1)
    return jnp.sum(out.astype(jnp.float32) * w), out

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  for cu, cuP in (BEYOND, WITHIN):
    grads, out = step(q, k, v, jnp.asarray(cu), jnp.asarray(cuP))
    f32 = lambda x: x.astype(jnp.float32)
    want = ref.batched_attention(f32(q), f32(k), f32(v), cu, cuP)
    want_grads = jax.grad(lambda q, k, v, cu=cu, cuP=cuP: jnp.sum(
        ref.batched_attention(q, k, v, cu, cuP) * w), argnums=(0, 1, 2))(
            f32(q), f32(k), f32(v))
    for name, g, r in [("out", out, want)] + list(zip(
        ("dq", "dk", "dv"), grads, want_grads)):
      g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
      assert np.isfinite(g).all(), name
      err = float(np.linalg.norm(g - r) / np.linalg.norm(r))
      record_error(jnp.bfloat16, name if name == "out" else "grad", err)
      assert err < 2e-2, (name, err)
