"""GPU test: the all-to-all exchange (``comm_type="all_to_all"``) on
cuDNN (marker gpu), its cp ranks run as a ``jax.vmap`` on one GPU
(``tests.test_ring.ranks_on_one_device``): the heads' all-to-all, the
reordering of the strategy's placement and the whole-row call, forward
and backward, against plain masked attention in float32 on the
unpartitioned row. Both strategies at cp = 4 and 8, GQA 4:1 (at cp = 8
each K/V head goes to two ranks) and MQA, three layouts."""

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

T, D = 2048, 64
TOL = 2e-2


@pytest.mark.parametrize("kind", ["mixed", "one_long", "many_short"])
@pytest.mark.parametrize("heads", [(16, 4), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp", [4, 8])
def test_all_to_all_on_cudnn(cp, strategy, heads, kind):
  rng = np.random.default_rng(cp)
  cu, cuP = ref.random_layout(rng, T, cp, kind,
                              dual_chunk=strategy == S.DUAL_CHUNK_SWAP)
  mk = lambda h: rng.standard_normal((T, h, D)).astype(np.float32)
  q, k, v = (jnp.asarray(mk(h), jnp.bfloat16) for h in
             (heads[0], heads[1], heads[1]))
  w = jnp.asarray(mk(heads[0]))
  out, grads = ranks_on_one_device(q, k, v, w, cu, cuP, cp=cp,
                                   strategy=strategy, backend="cudnn",
                                   comm_type="all_to_all")
  f = lambda q, k, v: ref.attention(q, k, v, cu, cuP)
  want = (f(q, k, v),) + jax.grad(lambda *a: jnp.sum(f(*a) * w),
                                  argnums=(0, 1, 2))(q, k, v)
  valid = ref.valid_token_mask(cu, cuP)
  for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), name
    err = ref.rel_err(a[valid], b[valid])
    assert err < TOL, (name, err)
    np.testing.assert_array_equal(a[~valid], 0.0, err_msg=name)
