"""GPU tests: a TransformerLayer run in layer chunks (``layer_chunk_size``)
on the cuDNN backend in bfloat16 is as exact as the whole-row layer on
cuDNN: both are compared with the whole-row layer in float32 on the xla
backend (the same parameters), output and every gradient, on rows of
packed documents whose chunk boundaries cut documents, with and without a
sliding window, in Linen and NNX. The rows are short enough for the
reference's dense scores (the xla backend's, over both rows' tokens) to
stay near 1 GB each: the suite's workers share the GPU, and a worker keeps
what its allocator grew to."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.gpu

from jax_cp import CPLayout
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

T, E, BOUND = 4096, 256, 1024
LAYER = dict(num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=512,
             mlp_activation="swiglu", remat="full")


def _rows():
  """Two rows of documents of 1 to 1024 padded tokens, some with padding."""
  rng = np.random.default_rng(0)
  cus, cups = [], []
  for _ in range(2):
    lens = []
    while sum(lens) < T:
      lens.append(int(min(rng.integers(1, BOUND + 1), T - sum(lens))))
    lens += [0] * (48 - len(lens))
    pad = [int(rng.integers(0, min(8, n))) if n > 1 else 0 for n in lens]
    cups.append(np.concatenate([[0], np.cumsum(lens)]))
    cus.append(np.concatenate([[0], np.cumsum(np.subtract(lens, pad))]))
  return np.array(cus, np.int32), np.array(cups, np.int32)


def _errors(got, want):
  """The largest relative max error of the layer's output and of each
  gradient: ``got``/``want`` are ``((loss, output), grads)``. The loss
  itself is left out: it sums 2M products of either sign, so its rounding
  is relative to those, not to its value (the output it sums is
  compared element by element)."""
  (_, out_g), grads_g = got
  (_, out_w), grads_w = want
  return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) /
             float(jnp.max(jnp.abs(w)))
             for g, w in zip(jax.tree.leaves((out_g, grads_g)),
                             jax.tree.leaves((out_w, grads_w))))


def _loss(y, w):
  """The loss and, as the auxiliary value, the layer's output."""
  y = y.astype(jnp.float32)
  return jnp.sum(y * w), y


def _linen_step(chunk, backend, dtype, window):
  m = cp_linen.TransformerLayer(
      **LAYER, dtype=dtype, window_size=window, layer_chunk_size=chunk,
      layout=CPLayout(cp_axis=None, backend=backend, max_seqlen=BOUND))
  return m, lambda p, x, w, cu, cuP: _loss(m.apply(p, x, cu, cuP), w)


@pytest.mark.parametrize("window, chunk", [(None, 1024), (None, 1500),
                                           ((100, 0), 256)])
def test_linen_layer_chunks_on_cudnn(window, chunk):
  cu, cuP = _rows()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, T, E)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, T, E)), jnp.float32)
  ref_m, ref = _linen_step(None, "xla", jnp.float32, window)
  params = ref_m.init(jax.random.key(0), x, cu, cuP)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1),
                                              has_aux=True))
  with jax.default_matmul_precision("highest"):
    want = grad(ref)(params, x, w, cu, cuP)
  whole = grad(_linen_step(None, "cudnn", jnp.bfloat16, window)[1])(
      params, x, w, cu, cuP)
  got = grad(_linen_step(chunk, "cudnn", jnp.bfloat16, window)[1])(
      params, x, w, cu, cuP)
  err_whole, err_chunked = _errors(whole, want), _errors(got, want)
  print(f"window={window} chunk={chunk}: whole-row {err_whole:.2e}, "
        f"chunked {err_chunked:.2e}")
  assert err_whole < 0.05
  assert err_chunked <= 1.5 * err_whole + 1e-3, (err_chunked, err_whole)


def test_nnx_layer_chunks_on_cudnn():
  cu, cuP = _rows()
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((2, T, E)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, T, E)), jnp.float32)

  def step(chunk, backend, dtype):
    m = cp_nnx.TransformerLayer(
        in_features=E, **LAYER, dtype=dtype, layer_chunk_size=chunk,
        layout=CPLayout(cp_axis=None, backend=backend, max_seqlen=BOUND),
        rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    f = lambda s, x: _loss(nnx.merge(graphdef, s)(x, cu, cuP), w)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True)), \
        state

  ref, state = step(None, "xla", jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = ref(state, x)
  err_whole = _errors(step(None, "cudnn", jnp.bfloat16)[0](state, x), want)
  err_chunked = _errors(step(1100, "cudnn", jnp.bfloat16)[0](state, x), want)
  print(f"nnx: whole-row {err_whole:.2e}, chunked {err_chunked:.2e}")
  assert err_whole < 0.05
  assert err_chunked <= 1.5 * err_whole + 1e-3, (err_chunked, err_whole)
