"""The portable K/V assembly (``jax_cp.attention.assemble``) and its checks;
the cudnn kernel is compared against it in tests/gpu/test_kv_assemble.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.attention.assemble import assemble_kv_jnp, check_assemble_kv
from jax_cp.kv_exchange import KVExchange


def _inputs(b=2, h0=5, tl=7, hkv=2, d=4):
  rng = np.random.default_rng(0)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return mk(b, h0, 2 * hkv, d), mk(b, tl, hkv, d), mk(b, tl, hkv, d)


@pytest.mark.parametrize("rows", [None, 12, 9, 5, 3, 0])
def test_assemble_kv_jnp_is_halo_then_local(rows):
  halo, k, v = _inputs()
  kx, vx = assemble_kv_jnp(halo, k, v, rows)
  n = 12 if rows is None else rows
  full_k = np.concatenate([np.asarray(halo[:, :, :2]), np.asarray(k)], 1)
  full_v = np.concatenate([np.asarray(halo[:, :, 2:]), np.asarray(v)], 1)
  np.testing.assert_array_equal(kx, full_k[:, :n])
  np.testing.assert_array_equal(vx, full_v[:, :n])


def test_exchange_assemble_hands_the_range_to_the_backend():
  halo, k, v = _inputs()
  exch = KVExchange("halo", "cp", 2, 14, halo_tokens=5)
  seen = {}

  def kernel(h, kk, vv, rows, first, count):
    seen.update(rows=rows, first=first, count=count)
    return assemble_kv_jnp(h, kk, vv, rows)

  first, count = jnp.asarray([1, 2]), jnp.asarray([3, 4])
  exch.assemble(halo, k, v, 9, first, count, assemble_kv=kernel)
  assert seen["rows"] == 9 and seen["first"] is first and \
      seen["count"] is count
  # Without a range the full concatenation is built, whatever the kernel.
  kx, _ = exch.assemble(halo, k, v, 9, assemble_kv=None)
  assert kx.shape == (2, 9, 2, 4)


@pytest.mark.parametrize("change,match", [
    (dict(halo=lambda h: h[:, :, :3]), "halo \\[B, H0, 2\\*Hkv, D\\]"),
    (dict(v=lambda v: v[:, :3]), "k = v"),
    (dict(halo=lambda h: h.astype(jnp.bfloat16)), "share a dtype"),
    (dict(rows=13), "rows must be a static int in \\[0, H0 \\+ Tl\\] = "
                    "\\[0, 12\\], got 13"),
    (dict(rows=jnp.int32(3)), "rows must be a static int"),
    (dict(first=jnp.zeros((3,), jnp.int32)), "first must be an integer "
                                             "\\[B\\] = \\[2\\]"),
    (dict(count=jnp.zeros((2,), jnp.float32)), "count must be an integer"),
])
def test_check_assemble_kv_names_the_argument(change, match):
  halo, k, v = _inputs()
  args = dict(halo=halo, k=k, v=v, rows=9, first=jnp.zeros((2,), jnp.int32),
              count=jnp.ones((2,), jnp.int32))
  for name, fix in change.items():
    args[name] = fix(args[name]) if callable(fix) else fix
  with pytest.raises(ValueError, match=match):
    check_assemble_kv(**args)


def test_cudnn_assemble_kv_needs_the_range():
  try:
    from jax_cp.attention import cudnn
  except ModuleNotFoundError:  # a present but broken extension fails
    pytest.skip("jax_cp's cuDNN extension is not built")
  halo, k, v = _inputs()
  with pytest.raises(ValueError, match="needs the row range first/count"):
    cudnn.assemble_kv(halo.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                      v.astype(jnp.bfloat16), 9)
