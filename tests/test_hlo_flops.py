"""benchmarks.hlo_flops counts the matmul FLOPs of compiled programs:
loops times their trip counts, fusions and calls per call site, the larger
branch of a conditional, against FLOPs counted by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import hlo_flops


def _count(fn, *args):
  return hlo_flops.dot_flops(jax.jit(fn).lower(*args).compile().as_text())


def _mat(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def test_plain_dots():
  a, b, c = _mat(0, (24, 40)), _mat(1, (40, 56)), _mat(2, (56, 8))
  got = _count(lambda a, b, c: jnp.tanh(a @ b) @ c, a, b, c)
  assert got == (2 * 24 * 56 * 40 + 2 * 24 * 8 * 56, 0)


@pytest.mark.parametrize("trips", [3, 7])
def test_loops_count_their_trips_forward_and_backward(trips):
  """A fori_loop of matmuls and its gradient: ``trips`` forward dots and
  two per trip in the backward."""
  x, w = _mat(0, (16, 32)), _mat(1, (32, 32))

  def f(x, w):
    return jnp.sum(jax.lax.fori_loop(
        0, trips, lambda i, c: jnp.tanh(c @ w), x))
  one = 2 * 16 * 32 * 32
  assert _count(f, x, w) == (trips * one, 0)
  assert _count(jax.grad(f, argnums=(0, 1)), x, w) == (3 * trips * one, 0)


def test_loop_without_a_trip_count_is_counted_once_and_reported():
  x, w = _mat(0, (8, 16)), _mat(1, (16, 16))

  def f(x, w):
    return jax.lax.while_loop(lambda c: jnp.sum(c) < 1e6,
                              lambda c: jnp.abs(c @ w) + 1.0, x)
  assert _count(f, x, w) == (2 * 8 * 16 * 16, 1)


def test_conditional_counts_the_larger_branch():
  x, w = _mat(0, (8, 16)), _mat(1, (16, 16))

  def f(p, x, w):
    return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)
  assert _count(f, True, x, w) == (2 * 2 * 8 * 16 * 16, 0)


def test_rejects_text_without_an_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_flops.dot_flops("HloModule m\n")
