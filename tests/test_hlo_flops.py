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


# A GPU program as XLA prints it after the autotuner handed matmuls to
# cuBLAS: a tuple-shaped __cublas$gemm in a loop of 5 trips (operand shapes
# printed inline), a __cublas$lt$matmul with a batch dimension whose lhs
# shape is looked up by name, and the cuDNN attention, which counts nothing.
_GEMM_CONFIG = (
    '"gemm_backend_config":{"alpha_real":1,"beta":0,'
    '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
    '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}')
_BATCHED_CONFIG = (
    '"gemm_backend_config":{"dot_dimension_numbers":{'
    '"lhs_contracting_dimensions":[2],"rhs_contracting_dimensions":[1],'
    '"lhs_batch_dimensions":[0],"rhs_batch_dimensions":[0]}}')
_STATE = "(s32[], bf16[64,128]{1,0})"
_CUBLAS_PROGRAM = "\n".join([
    "HloModule jit_step",
    "",
    f"%body (p: {_STATE}) -> {_STATE} {{",
    f"  %p = {_STATE} parameter(0)",
    f"  %x = bf16[64,128]{{1,0}} get-tuple-element({_STATE} %p), index=1",
    "  %w = bf16[128,128]{1,0} constant({...})",
    "  %g = (bf16[64,128]{1,0}, s8[4194304]{0}) custom-call("
    "bf16[64,128]{1,0} %x, bf16[128,128]{1,0} %w), "
    'custom_call_target="__cublas$gemm", '
    f'backend_config={{"operation_queue_id":"0",{_GEMM_CONFIG}}}',
    f"  %i = s32[] get-tuple-element({_STATE} %p), index=0",
    f"  ROOT %t = {_STATE} tuple(s32[] %i, bf16[64,128]{{1,0}} %x)",
    "}",
    "",
    f"%cond (p: {_STATE}) -> pred[] {{",
    f"  %p = {_STATE} parameter(0)",
    "  ROOT %c = pred[] constant(true)",
    "}",
    "",
    "ENTRY %main (a: bf16[64,128], b: bf16[3,64,32], c: bf16[3,32,16]) "
    "-> bf16[3,64,16] {",
    "  %a = bf16[64,128]{1,0} parameter(0)",
    "  %b = bf16[3,64,32]{2,1,0} parameter(1)",
    "  %c = bf16[3,32,16]{2,1,0} parameter(2)",
    "  %z = s32[] constant(0)",
    f"  %init = {_STATE} tuple(s32[] %z, bf16[64,128]{{1,0}} %a)",
    f"  %loop = {_STATE} while({_STATE} %init), condition=%cond, "
    'body=%body, backend_config={"known_trip_count":{"n":"5"}}',
    "  %att = (bf16[64,128]{1,0}, u8[0]{0}) custom-call("
    'bf16[64,128]{1,0} %a), custom_call_target="jax_cp_cudnn_sdpa_fwd"',
    "  ROOT %m = bf16[3,64,16]{2,1,0} custom-call(%b, %c), "
    'custom_call_target="__cublas$lt$matmul", '
    f"backend_config={{{_BATCHED_CONFIG}}}",
    "}",
    ""])


def test_cublas_gemm_custom_calls_count_like_the_dots_they_replace():
  loop = 5 * 2 * 64 * 128 * 128
  batched = 2 * 3 * 64 * 16 * 32
  assert hlo_flops.dot_flops(_CUBLAS_PROGRAM) == (loop + batched, 0)
