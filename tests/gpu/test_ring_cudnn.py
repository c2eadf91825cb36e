"""GPU test: the ring exchange on cuDNN (marker gpu), its cp ranks run
as a ``jax.vmap`` on one GPU (``tests.test_ring.ranks_on_one_device``):
every hop, step call, merge and accumulator of the ring, forward and
backward, against plain masked attention in float32 on the unpartitioned
row. Both strategies at cp = 4 and 8, unmasked, and NO_LOAD_BALANCE with
a bound (fewer steps)."""

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax  # noqa: E402

from jax_cp import CPLoadBalancingStrategy as S  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.test_ring import ranks_on_one_device  # noqa: E402

T, HQ, HKV, D = 2048, 8, 2, 64
TOL = 2e-2


def _check(q, k, v, w, cu, cuP, causal=True, **kw):
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  out, grads = ranks_on_one_device(*bf, w, cu, cuP, backend="cudnn", **kw)
  f = lambda q, k, v: ref.attention(q, k, v, cu, cuP, causal)
  want_out = f(*bf)
  want = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(*bf)
  valid = ref.valid_token_mask(cu, cuP)
  for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads,
                        (want_out,) + want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), name
    assert ref.rel_err(a[valid], b[valid]) < TOL, (name, ref.rel_err(
        a[valid], b[valid]))
    np.testing.assert_array_equal(a[~valid], 0.0, err_msg=name)


def _inputs(seed, cp, dual_chunk, kind="mixed"):
  rng = np.random.default_rng(seed)
  cu, cuP = ref.random_layout(rng, T, cp, kind, dual_chunk=dual_chunk)
  mk = lambda h: rng.standard_normal((T, h, D)).astype(np.float32)
  return mk(HQ), mk(HKV), mk(HKV), jnp.asarray(mk(HQ)), cu, cuP


@pytest.mark.parametrize("kind", ["mixed", "one_long", "many_short"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [4, 8])
def test_ring_on_cudnn(cp, strategy, kind):
  q, k, v, w, cu, cuP = _inputs(cp, cp, strategy == S.DUAL_CHUNK_SWAP, kind)
  _check(q, k, v, w, cu, cuP, cp=cp, strategy=strategy)


def test_ring_unmasked_on_cudnn():
  q, k, v, w, cu, cuP = _inputs(3, 4, True)
  _check(q, k, v, w, cu, cuP, causal=False, cp=4,
         strategy=S.DUAL_CHUNK_SWAP, attn_mask_type="no_mask")


def test_ring_with_a_bound_on_cudnn():
  """NO_LOAD_BALANCE with max_seqlen 700 at cp = 8: 1 + ceil(699/256) =
  4 steps of 8."""
  rng = np.random.default_rng(5)
  cu, cuP = ref.rows_with_longest(rng, T, 700, 1, max_docs=40)
  q, k, v, w, _, _ = _inputs(5, 8, False)
  _check(q, k, v, w, cu[0], cuP[0], cp=8, strategy=S.NO_LOAD_BALANCE,
         max_seqlen=700)
