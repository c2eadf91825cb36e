"""Rotary embeddings (jax_cp.modules.rotary) are exact at any position:
the float32 angles against float64 numpy up to position 16M and past it,
under jit with traced positions, and the rotation itself against a float64
rotation; the float32 product they replace misses by radians there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cp.modules import rotary


def _frequencies64(d, theta):
  return theta ** (-2.0 * np.arange(d // 2, dtype=np.float64) / d)


def _wrapped_error(angles, pos, d, theta):
  """Largest distance on the circle between ``angles`` and the float64
  ``pos * f``."""
  want = pos[..., None].astype(np.float64) * _frequencies64(d, theta)
  diff = np.asarray(angles, np.float64) - want
  return float(np.abs((diff + np.pi) % (2 * np.pi) - np.pi).max())


def _positions(top, n=4096, seed=0):
  pos = np.random.default_rng(seed).integers(0, top, n)
  pos[:4] = [top - 1, top - 2, 0, 1]
  return pos.reshape(2, -1)


@pytest.mark.parametrize("top", [1 << 12, 1 << 20, 1 << 24, 1 << 31])
@pytest.mark.parametrize("d, theta", [(128, 10000.0), (64, 500000.0)])
def test_angles_are_exact_at_any_position(top, d, theta):
  pos = _positions(top)
  angles = jax.jit(lambda p: rotary.rotary_angles(p, d, theta))(
      jnp.asarray(pos, jnp.int32))
  assert angles.dtype == jnp.float32 and angles.shape == pos.shape + (d // 2,)
  assert float(jnp.abs(angles).max()) <= np.pi
  assert _wrapped_error(angles, pos, d, theta) <= 1e-5


def test_the_float32_product_is_not():
  """The test above fails the plain float32 angle at 16M by far."""
  pos = _positions(1 << 24)
  f32 = (jnp.asarray(pos, jnp.float32)[..., None]
         * rotary.rotary_frequencies(128))
  assert _wrapped_error(f32, pos, 128, 10000.0) > 0.1


def test_negative_positions_and_other_int_dtypes():
  pos = np.array([[-1, -5, -(1 << 23) - 7, 3]])
  for dtype in (jnp.int32, jnp.int16):
    p = np.clip(pos, -(1 << 15), None) if dtype == jnp.int16 else pos
    got = rotary.rotary_angles(jnp.asarray(p, dtype), 16)
    assert _wrapped_error(got, p, 16, 10000.0) <= 1e-5


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5),
                                        (jnp.bfloat16, 2e-2)])
def test_apply_rotary_against_float64(dtype, tol):
  rng = np.random.default_rng(1)
  d, h = 32, 3
  pos = _positions(1 << 24, n=512, seed=2)                      # [2, 256]
  x = rng.standard_normal(pos.shape + (h, d))
  xd = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  got = jax.jit(rotary.apply_rotary)(jnp.asarray(x, dtype),
                                     jnp.asarray(pos, jnp.int32))
  assert got.dtype == dtype
  a = pos[..., None].astype(np.float64) * _frequencies64(d, 10000.0)
  cos, sin = np.cos(a)[..., None, :], np.sin(a)[..., None, :]
  x1, x2 = xd[..., :d // 2], xd[..., d // 2:]
  want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want)
  assert err.max() <= tol * np.abs(want).max()


def test_odd_head_dim_is_rejected():
  with pytest.raises(ValueError, match="even head_dim, got 7"):
    rotary.apply_rotary(jnp.ones((4, 1, 7)), jnp.arange(4))
