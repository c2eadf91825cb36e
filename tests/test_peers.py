"""The peers of ``bench_fused`` (benchmarks/peers.py): the document
metadata they are given, their loading (an absent peer comes back with
its error), and, where tokamax is installed, its mask against the
float32 reference on CPU (tokamax's XLA op takes the same mask as its
GPU kernels)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import peers
from tests import reference as ref

T, D = 96, 16
CU = np.array([0, 17, 40, 41, 90, T], np.int32)


def test_doc_starts_and_segment_ids_from_traced_offsets():
  offs = jnp.asarray(CU[:-1])
  starts = jax.jit(lambda o: peers.doc_starts(o, T))(offs)
  ids = jax.jit(lambda o: peers.segment_ids(o, T))(offs)
  doc = np.repeat(np.arange(len(CU) - 1), np.diff(CU))
  np.testing.assert_array_equal(ids, doc)
  np.testing.assert_array_equal(starts, CU[doc])


def test_an_unknown_or_absent_peer_comes_back_with_its_error():
  bad = peers.load("nope", tokens=T, head_dim=D)
  assert bad.fn is None and "unknown peer" in bad.error
  if importlib.util.find_spec("kvax") is None:
    kvax = peers.load("kvax", tokens=T, head_dim=D)
    assert kvax.fn is None and "ModuleNotFoundError" in kvax.error


@pytest.mark.parametrize("window", [None, 9])
def test_tokamax_document_mask_matches_the_reference(window):
  if importlib.util.find_spec("tokamax") is None:
    pytest.skip("tokamax is not installed (the peers extra)")
  fn, _ = peers._tokamax("xla", T, 1 / np.sqrt(D), window)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((T, h, D)), jnp.float32)
             for h in (4, 2, 2))
  offs = jnp.asarray(CU[:-1])
  got = jax.jit(fn)(q, k, v, jnp.diff(jnp.asarray(CU)), offs)
  want = ref.attention(q, k, v, CU, CU, window=-1 if window is None
                       else window)
  assert ref.rel_err(got, want) < 1e-5
