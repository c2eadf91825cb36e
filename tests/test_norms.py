"""``RMSNorm`` with the lean gradient (jax_cp.modules.norms, the Linen and
NNX modules): Flax's numbers and parameters, gradients against a float64
reference, inside a shard_map with vma checks, and the float32 copies of
the input its gradient no longer keeps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_cp.flax.norm import RMSNorm as LinenRMSNorm
from jax_cp.modules.norms import rms_norm
from jax_cp.nnx.norm import RMSNorm as NnxRMSNorm

E = 48


def _inputs(dtype, shape=(3, 40, E), seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(shape) * 3 + 0.5, dtype)
  scale = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
  return x, scale


def _reference(x, scale, epsilon):
  """float64 RMS norm, the plain formula."""
  x = np.asarray(x, np.float64)
  r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon)
  return x * r * np.asarray(scale, np.float64)


@pytest.mark.parametrize("dtype,out_dtype", [
    (jnp.float32, None), (jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, None), (jnp.float16, jnp.float32)])
def test_same_numbers_as_flax(dtype, out_dtype):
  """Forward as Flax's RMSNorm (Linen and NNX): bit for bit into float32,
  within one rounding of a bfloat16 output (the float32 sums may round
  differently as XLA fuses them), same output dtype, same parameter."""
  x, scale = _inputs(dtype)
  flax_linen = nn.RMSNorm(epsilon=1e-5, dtype=out_dtype)
  ours_linen = LinenRMSNorm(epsilon=1e-5, dtype=out_dtype)
  params = {"params": {"scale": scale}}
  assert jax.tree.map(jnp.shape, ours_linen.init(jax.random.key(0), x)) == \
      jax.tree.map(jnp.shape, flax_linen.init(jax.random.key(0), x))
  want = flax_linen.apply(params, x)
  got = ours_linen.apply(params, x)
  assert got.dtype == want.dtype
  rtol = float(jnp.finfo(got.dtype).eps) if got.dtype != jnp.float32 else 0
  same = lambda a, b: np.testing.assert_allclose(
      np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=0)
  same(got, want)
  flax_nnx = nnx.RMSNorm(E, epsilon=1e-5, dtype=out_dtype, rngs=nnx.Rngs(0))
  ours_nnx = NnxRMSNorm(E, epsilon=1e-5, dtype=out_dtype, rngs=nnx.Rngs(0))
  assert jax.tree.map(jnp.shape, nnx.state(ours_nnx)) == \
      jax.tree.map(jnp.shape, nnx.state(flax_nnx))
  flax_nnx.scale[...] = scale
  ours_nnx.scale[...] = scale
  same(ours_nnx(x), flax_nnx(x))


def test_gradients_against_float64():
  x, scale = _inputs(jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape),
                  jnp.float32)
  eps = 1e-6
  dx, dscale = jax.grad(lambda x, s: jnp.sum(jnp.sin(rms_norm(
      x, s, epsilon=eps)) * w), argnums=(0, 1))(x, scale)
  with jax.enable_x64():
    f64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)
    ref = jax.grad(lambda x, s: jnp.sum(jnp.sin(
        x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * s)
        * f64(w)), argnums=(0, 1))(f64(x), f64(scale))
    ref = [np.asarray(r) for r in ref]
  for got, want in ((dx, ref[0]), (dscale, ref[1])):
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(
        want).max()
    assert err < 1e-5, err
  np.testing.assert_allclose(np.asarray(rms_norm(x, scale, epsilon=eps)),
                             _reference(x, scale, eps), rtol=1e-5, atol=1e-6)


def test_bf16_gradients_match_flax():
  """In bfloat16 the gradients are Flax's to its rounding."""
  x, scale = _inputs(jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(2).standard_normal(x.shape),
                  jnp.float32)
  params = {"params": {"scale": scale}}
  grads = [jax.grad(lambda p, x, m=m: jnp.sum(
      m.apply(p, x).astype(jnp.float32) * w), argnums=(0, 1))(params, x)
      for m in (nn.RMSNorm(dtype=jnp.bfloat16),
                LinenRMSNorm(dtype=jnp.bfloat16))]
  (pf, xf), (po, xo) = grads
  sf, so = pf["params"]["scale"], po["params"]["scale"]
  assert xo.dtype == jnp.bfloat16 and so.dtype == jnp.float32
  for got, want in ((xo, xf), (so, sf)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_gradient_in_a_shard_map_with_vma_checks():
  """Tokens over 4 ranks, the scale on all of them: the scale's gradient
  is summed over the ranks (as for plain JAX code), x's stays per rank."""
  mesh = jax.make_mesh((4,), ("cp",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  x, scale = _inputs(jnp.float32, shape=(64, E))

  def per_rank(x, s):
    return jax.lax.psum(jnp.sum(jnp.sin(rms_norm(x, s))), "cp")

  with jax.set_mesh(mesh):
    xs = jax.device_put(x, jax.P("cp"))
    ss = jax.device_put(scale, jax.P())
    got = jax.jit(jax.grad(jax.shard_map(
        per_rank, in_specs=(jax.P("cp"), jax.P()), out_specs=jax.P(),
        check_vma=True), argnums=(0, 1)))(xs, ss)
  want = jax.grad(lambda x, s: jnp.sum(jnp.sin(rms_norm(x, s))),
                  argnums=(0, 1))(x, scale)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-5)


def test_gradient_keeps_no_float32_copy_of_the_input():
  """The compiled gradient of Flax's RMSNorm on bf16 [T, E] plans float32
  [T, E] buffers for its residuals; this one at least one fewer."""
  t = 8192
  x = jax.ShapeDtypeStruct((t, 512), jnp.bfloat16)

  def temp(module):
    p = jax.eval_shape(module.init, jax.random.key(0), x)
    f = lambda p, x: jnp.sum(jnp.sin(module.apply(p, x).astype(jnp.float32)))
    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(p, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  flax_temp = temp(nn.RMSNorm(dtype=jnp.bfloat16))
  ours = temp(LinenRMSNorm(dtype=jnp.bfloat16))
  assert ours <= flax_temp - t * 512 * 4, (ours, flax_temp)


def test_rejects_a_scale_of_another_size():
  x, _ = _inputs(jnp.float32)
  with pytest.raises(ValueError, match=r"scale must have shape \(48,\) "
                     r"\(the last axis of x\), got \(47,\)"):
    rms_norm(x, jnp.ones((47,)))
