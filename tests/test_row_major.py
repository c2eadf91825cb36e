"""``jax_cp.modules.row_major``: the identity everywhere but in programs
lowered for GPUs (tests/test_deviceless.py checks what it does there), so
eager calls, ``jit`` on CPU, ``grad`` and ``vmap`` see ``x`` unchanged and
no array is committed to a device by it."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.modules.row_major import row_major


def test_eager_returns_the_array_itself():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 4)))
  assert row_major(x) is x


def test_jit_grad_and_vmap_pass_values_through():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
  f = lambda x: jnp.sum(jnp.tanh(row_major(x) @ w) ** 2)
  g = lambda x: jnp.sum(jnp.tanh(x @ w) ** 2)
  # The same programs but for the identity: equal to the bit.
  for t in (lambda h: h, jax.grad, lambda h: jax.grad(jax.checkpoint(h)),
            lambda h: jax.vmap(jax.grad(h))):
    a, b = jax.jit(t(f))(x), jax.jit(t(g))(x)
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
  assert "jax_cp_row_major" in str(jax.make_jaxpr(f)(x))
  # No trace of it in a CPU program.
  assert "layout" not in jax.jit(f).lower(x).as_text().lower()


def test_eager_grad_keeps_inputs_uncommitted():
  x = jnp.ones((4, 8))
  y = jax.grad(lambda x: jnp.sum(jax.checkpoint(row_major)(x) ** 2))(x)
  np.testing.assert_allclose(y, 2 * np.ones((4, 8)))
  assert not getattr(y, "committed", False)
