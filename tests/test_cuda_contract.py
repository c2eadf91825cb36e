"""The C++/Python contract of the cuDNN extension, on a CPU-only machine.

The extension exports its FFI target names and attribute codes
(csrc/ffi_targets.h); the Python wrapper reads them from there. These tests
check that every custom call the wrapper emits names a target the extension
registers, that the codes cover the mask types of the registry, and that the
shipped stub (jax_cp/_jax_cp_cuda.pyi) describes the module. Skipped when the
extension is not built.
"""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  # A missing extension raises ModuleNotFoundError here (``from jax_cp
  # import _jax_cp_cuda`` would raise a plain ImportError).
  from jax_cp.attention.cudnn import backend as cudnn
except ModuleNotFoundError:  # a present but broken extension fails
  pytest.skip("jax_cp's cuDNN extension is not built", allow_module_level=True)

from jax_cp import _jax_cp_cuda
from jax_cp.attention.backend import MASK_TYPES, Segments
from jax_cp.attention.mask import AttentionMask

STUB = (pathlib.Path(__file__).resolve().parents[1] / "jax_cp" /
        "_jax_cp_cuda.pyi")


def _lowered_targets(fn, *args) -> set:
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"stablehlo\.custom_call @(\w+)\(", text))


def _rand(rng, shape, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _segments():
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return Segments(i32([10, 30]), i32([20, 40]), i32([0, 24]), i32([0, 40]),
                  32, 40, rows_see_keys=True)


def test_registered_names_are_the_exported_targets():
  registered = set(_jax_cp_cuda.registrations())
  assert registered == set(_jax_cp_cuda.FFI_TARGETS.values())
  assert len(_jax_cp_cuda.FFI_TARGETS) == len(registered) == 6
  assert cudnn.FFI_TARGETS == _jax_cp_cuda.FFI_TARGETS
  assert {cudnn.FWD_TARGET, cudnn.FWD_OUT_TARGET, cudnn.BWD_TARGET,
          cudnn.FWD_INTO_TARGET, cudnn.BWD_INTO_TARGET,
          cudnn.MERGE_TARGET} == registered


def test_codes_match_the_registry_and_the_wrapper():
  assert set(_jax_cp_cuda.MASK_CODES) == set(MASK_TYPES)
  assert sorted(_jax_cp_cuda.MASK_CODES.values()) == [0, 1, 2]
  assert cudnn.MASK_CODES == _jax_cp_cuda.MASK_CODES
  assert cudnn.MERGE_OP_CODES == _jax_cp_cuda.MERGE_OP_CODES == {"add": 0,
                                                                 "max": 1}
  assert cudnn.MAX_HEAD_DIM == _jax_cp_cuda.MAX_HEAD_DIM == 256
  assert _jax_cp_cuda.SEGMENT_META_ROWS == 4


def test_the_mask_enum_has_the_extension_codes():
  """jax_cp.attention.mask.AttentionMask: the names of MASK_TYPES, each
  member's code the C++ SdpaMask value the extension exports."""
  assert tuple(AttentionMask) == MASK_TYPES
  assert {m.value: m.code for m in AttentionMask} == _jax_cp_cuda.MASK_CODES


def test_every_emitted_custom_call_is_registered():
  """Lower each wrapper for CUDA; the custom-call targets it emits must be
  exactly the names the extension registers with XLA."""
  rng = np.random.default_rng(0)
  q = _rand(rng, (64, 8, 64))
  k, v = _rand(rng, (80, 2, 64)), _rand(rng, (80, 2, 64))
  seg = _segments()
  lse = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)

  def fwd(q, k, v):
    return cudnn.forward(q, k, v, seg, mask="causal_bottom_right", scale=None)

  def fwd_out(q, k, v):
    return cudnn.forward_out(q, k, v, seg, mask="causal_top_left",
                             scale=None)

  def fwd_into(q, k, v, o, l):
    return cudnn.forward(q, k, v, seg, mask="no_mask", scale=0.1, into=(o, l))

  def bwd(q, k, v, o, l):
    return cudnn.backward(q, k, v, o, l, o, seg, mask="causal_top_left",
                          scale=None)

  def bwd_into(q, k, v, o, l):
    return cudnn.backward(q, k, v, o, l, o, seg, mask="causal_top_left",
                          scale=None, dq_into=q)

  def merge(dst, src):
    return cudnn.merge_rows(dst, src, 2, "max")

  emitted = set()
  emitted |= _lowered_targets(fwd, q, k, v)
  emitted |= _lowered_targets(fwd_out, q, k, v)
  emitted |= _lowered_targets(fwd_into, q, k, v, q, lse)
  emitted |= _lowered_targets(bwd, q, k, v, q, lse)
  emitted |= _lowered_targets(bwd_into, q, k, v, q, lse)
  emitted |= _lowered_targets(merge, _rand(rng, (2, 16, 4), jnp.float32),
                              _rand(rng, (2, 4, 4), jnp.float32))
  assert emitted == set(_jax_cp_cuda.registrations())


def test_stub_describes_the_module():
  """Every public name of the module is in the stub and vice versa."""
  tree = ast.parse(STUB.read_text())
  stub_names = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef):
      stub_names.add(node.name)
    elif isinstance(node, ast.AnnAssign):
      stub_names.add(node.target.id)
  public = {n for n in dir(_jax_cp_cuda) if not n.startswith("_")}
  assert stub_names == public
