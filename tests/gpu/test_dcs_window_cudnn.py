"""GPU tests of DUAL_CHUNK_SWAP with a sliding window on the ``"cudnn"``
backend at cp = 2 (marker gpu): the plan without bottom-right calls
(top-left bands, unmasked near rectangles, mirrored far triangles) against
the windowed float32 reference on the unpartitioned rows, forward and
gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax_cp
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

HQ, HKV, D, CP, T = 8, 2, 128, 2, 8192
TOL = 2e-2    # bf16 inputs, float32 reference
DCS = S.DUAL_CHUNK_SWAP


def _rows(seed):
  """Two rows: one document of T tokens (chunks of T / 4 = 2048) and a
  mix of documents shorter and longer than the windows below."""
  rng = np.random.default_rng(seed)
  rows = [ref.random_layout(rng, T, CP, kind, max_docs=64)
          for kind in ("one_long", "mixed")]
  return tuple(np.stack(x) for x in zip(*rows)), rng


# Windows 0 and 1, below, equal to and above a chunk of the long document,
# and above every document (plain causal).
@pytest.mark.parametrize("left", [0, 1, 700, 2048, 3000, T])
def test_windowed_dual_chunk_swap_matches_reference(left):
  gpus = devices(CP, "gpu")
  (cu, cuP), rng = _rows(left)
  q, k, v = (jnp.asarray(rng.standard_normal((2, T, h, D)), jnp.bfloat16)
             for h in (HQ, HKV, HKV))
  w = jnp.asarray(rng.standard_normal((2, T, HQ, D)), jnp.float32)
  layout = jax_cp.CPLayout(
      mesh=jax.sharding.Mesh(np.array(gpus[:CP]), ("cp",)), cp_axis="cp",
      strategy=DCS, backend="cudnn")

  def loss(q, k, v, w):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout,
                              window_size=(left, 0))
    return jnp.sum(out.astype(jnp.float32) * w), out

  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(re(q), re(k), re(v), re(w))
  got = [restore_from_cp(jax.device_get(x), cuP, layout, seq_dim=1)
         for x in (out, *grads)]
  with jax.default_device(gpus[0]):
    f = functools.partial(ref.batched_attention, cu=cu, cuP=cuP,
                          window=left)
    want = [f(q, k, v), *jax.grad(lambda *a: jnp.sum(f(*a) * w),
                                  argnums=(0, 1, 2))(q, k, v)]
  valid = np.stack([ref.valid_token_mask(a, b) for a, b in zip(cu, cuP)])
  for name, g, e in zip(("out", "dq", "dk", "dv"), got, want):
    g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
    assert np.isfinite(g).all(), name
    np.testing.assert_array_equal(g[~valid], 0.0, err_msg=name)
    g, e = g[valid], e[valid]
    err = float(np.linalg.norm(g - e) / max(np.linalg.norm(e),
                                            1e-2 * np.sqrt(e.size)))
    assert err < TOL, (name, left, err)
