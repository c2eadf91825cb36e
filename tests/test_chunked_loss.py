"""Chunked logits and loss (jax_cp.modules.chunked_loss, also
``jax_cp.chunked_cross_entropy``): the per-token cross entropy against a
float64 numpy reference at a 32k vocabulary, its gradients against the
whole-row computation, no ``[T, vocab]`` value in the gradient's program,
CP's global view, bad arguments; and the packed_lm example's loss_fn
against its logits' cross entropy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp.modules import chunked_loss
from tests._devices import devices

V, E = 32768, 16


def _inputs(t, seed=0, b=2):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, t, E)).astype(np.float32)
  w = (rng.standard_normal((E, V)) / np.sqrt(E)).astype(np.float32)
  labels = rng.integers(0, V, (b, t)).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(w), jnp.asarray(labels)


def _reference(x, w, labels):
  """float64 numpy cross entropy ``[B, T]``."""
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  m = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
  picked = np.take_along_axis(logits, np.asarray(labels)[..., None], -1)
  return lse - picked[..., 0]


def _ce(chunk, layout=None):
  def f(x, w, labels):
    head = lambda h: jnp.dot(h, w, precision="highest")
    return chunked_loss.chunked_cross_entropy(head, x, labels, vocab=V,
                                              chunk_size=chunk, layout=layout)
  return f


@pytest.mark.parametrize("chunk", [None, 40, 64, "auto"])
def test_cross_entropy_against_float64(chunk):
  x, w, labels = _inputs(300)            # 40: 7 chunks + 20; 64: 4 + 44
  got = jax.jit(_ce(chunk))(x, w, labels)
  want = _reference(x, w, labels)
  assert got.shape == labels.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-5)


def test_gradients_equal_the_whole_rows():
  x, w, labels = _inputs(300, seed=1)
  mask = jnp.asarray(np.random.default_rng(2).random((2, 300)) < 0.8,
                     jnp.float32)
  loss = lambda f: jax.jit(jax.value_and_grad(
      lambda x, w: jnp.sum(f(x, w, labels) * mask), argnums=(0, 1)))
  got, want = loss(_ce(64))(x, w), loss(_ce(None))(x, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(r)).max())
    assert float(np.abs(np.asarray(g) - np.asarray(r)).max()) <= 1e-5 * scale
  assert float(jnp.abs(got[1][0]).max()) > 0


def _sizes(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield int(np.prod(v.aval.shape, dtype=np.int64))
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _sizes(sub)


def test_no_value_holds_the_whole_logits():
  """1024 tokens at a 32k vocabulary in chunks of 128: no value in the
  gradient's program is larger than a chunk's logits (the whole row's
  would be 8x), and the compiled temp holds at most three chunks' float32
  logits (48 MiB; one copy of the whole row's is 128 MiB)."""
  x, w, labels = _inputs(1024, b=1)
  grad = lambda chunk: jax.grad(
      lambda x, w: jnp.sum(_ce(chunk)(x, w, labels)), argnums=(0, 1))
  biggest = lambda f: max(_sizes(jax.make_jaxpr(f)(x, w).jaxpr))
  assert biggest(grad(128)) <= 128 * V
  assert biggest(grad(None)) >= 1024 * V         # what the test looks for
  temp = jax.jit(grad(128)).lower(x, w).compile().memory_analysis()
  assert temp.temp_size_in_bytes < 3 * 128 * V * 4, temp.temp_size_in_bytes


def test_global_view_chunks_stay_on_their_ranks():
  mesh = jax.make_mesh((4,), ("cp",), devices=devices(4, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = jax_cp.CPLayout(mesh=mesh, backend="xla")
  x, w, labels = _inputs(256, seed=3)    # 64 per rank: 24 + 24 + 16
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "cp")))
    ls = jax.device_put(labels, NamedSharding(mesh, P(None, "cp")))
    fn = jax.jit(jax.value_and_grad(
        lambda x, w: jnp.sum(_ce(24, layout)(x, w, ls) ** 2),
        argnums=(0, 1)))
    text = fn.lower(xs, w).compile().as_text()
    got = fn(xs, w)
  want = jax.value_and_grad(lambda x, w: jnp.sum(_ce(None)(x, w, labels)
                                                 ** 2), argnums=(0, 1))(x, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(r)).max())
    assert float(np.abs(np.asarray(g) - np.asarray(r)).max()) <= 1e-5 * scale
  # Tokens never move: only w's gradient and the loss are reduced.
  assert not re.search(r"= \S+ (all-gather|all-to-all|collective-permute)",
                       text)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "x"])
def test_bad_chunk_size_raises(bad):
  x, w, labels = _inputs(8)
  with pytest.raises(ValueError, match=rf"chunk_size={re.escape(repr(bad))}"
                     r" must be None, 'auto' or a positive int"):
    _ce(bad)(x, w, labels)
  with pytest.raises(ValueError, match="labels must have the shape of x"):
    _ce(4)(x, w, labels[:, :4])


def test_auto_chunk_size():
  assert chunked_loss.loss_chunk_tokens("auto", 256, 1 << 20) == 65536
  assert chunked_loss.loss_chunk_tokens("auto", 32768, 1 << 20) == 1024
  assert chunked_loss.loss_chunk_tokens("auto", 256, 65536) is None
  assert chunked_loss.loss_chunk_tokens(100, 256, 64) is None
  # The hidden states bound it too: 2^24 values of a 2048-wide x.
  assert chunked_loss.loss_chunk_tokens("auto", 256, 1 << 20, 2048) == 8192
  assert chunked_loss.loss_chunk_tokens("auto", 32768, 1 << 20, 2048) == 1024


def test_chunked_cross_entropy_is_at_the_top_level():
  assert jax_cp.chunked_cross_entropy is chunked_loss.chunked_cross_entropy
  assert "chunked_cross_entropy" in jax_cp.__all__


def test_example_loss_fn_is_the_cross_entropy_of_its_logits():
  from examples.packed_lm import config, lm_loss, model, train
  cfg = config.Config(layers=1, d_model=32, heads=2, kv_heads=1, seq_len=64,
                      batch=2)
  layout = model.make_layout(cfg)
  lm = model.PackedLM(cfg, layout, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(4)
  cu = np.array([[0, 20, 50, 64], [0, 64, 64, 64]], np.int32)
  tensors = {"tokens": rng.integers(0, 256, (2, 64)),
             "labels": rng.integers(0, 256, (2, 64)),
             "loss_mask": (rng.random((2, 64)) < 0.9).astype(np.float32),
             "position_ids": np.asarray(jax_cp.data.get_position_ids(cu))}
  batch = jax_cp.data.make_global_batch(tensors, cu, layout, cu_seqlens=cu)
  labels, mask = batch.tensors["labels"], batch.tensors["loss_mask"]
  ce = optax.softmax_cross_entropy_with_integer_labels(lm(batch), labels)
  want = jnp.sum(ce * mask) / jnp.sum(mask)
  np.testing.assert_allclose(float(train.loss_fn(lm, batch)), float(want),
                             rtol=1e-6)
  chunked = lm_loss.token_losses(lm, batch, chunk_size=24)   # 24 + 24 + 16
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(ce), rtol=1e-5,
                             atol=1e-6)


def test_backward_keeps_no_token_sized_buffer_of_its_own():
  """A small vocabulary and wide hidden states (16k tokens of 512, bf16,
  chunks of 1024): the compiled gradient of the chunked loss (the head
  normalizes in float32, as the example's does) plans less temp than one
  copy of ``x``: the backward writes each chunk's cotangent over that
  chunk of ``x``, with no zero-filled or stacked token-sized buffer, and
  the chunks' float32 intermediates are one chunk's."""
  t, e, vocab = 16384, 512, 256
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((e, vocab)) / np.sqrt(e), jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, (1, t)), jnp.int32)

  def loss(x, w):
    def head(h):
      h32 = h.astype(jnp.float32)
      h = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True))
      return h.astype(jnp.bfloat16) @ w
    return jnp.sum(chunked_loss.chunked_cross_entropy(
        head, x, labels, vocab=vocab, chunk_size=1024))

  x = jax.ShapeDtypeStruct((1, t, e), jnp.bfloat16)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
      x, jax.ShapeDtypeStruct(w.shape, w.dtype)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < t * e * 2, (temp, t * e * 2)
