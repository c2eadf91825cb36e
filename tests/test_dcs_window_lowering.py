"""DUAL_CHUNK_SWAP with a sliding window lowered for CUDA (on CPU
devices): the gradient program's cuDNN calls by mask type and band, no
bottom-right banded call in the forward or the backward. Skipped when the
extension (``jax_cp._jax_cp_cuda``) is not built."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from jax_cp.attention.cudnn import backend as cudnn_backend
except ModuleNotFoundError:  # a present but broken extension fails
  pytest.skip("jax_cp's cuDNN extension is not built", allow_module_level=True)

import jax_cp
from tests._devices import devices
from tests._lowering import custom_calls, lower_for_cuda

HQ, HKV, D, T = 8, 2, 64, 64
# Three documents, one shorter than the windows' chunks, padded to 8.
CU = np.array([0, 20, 34, 58], np.int32)
CU_P = np.array([0, 24, 40, 64], np.int32)
CODES = cudnn_backend.MASK_CODES
TARGETS = cudnn_backend.FFI_TARGETS


def _calls(strategy, window, cp=2):
  """{"forward", "backward"} -> sorted [(mask, window_left)] of the cuDNN
  calls in the gradient program of cp_attention at ``cp``."""
  mesh = jax.sharding.Mesh(np.array(devices(cp, "cpu")), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy=strategy)
  attn = functools.partial(
      jax_cp.cp_attention, metadata=(CU, CU_P), layout=layout,
      window_size=None if window is None else (window, 0))
  loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp"))
  args = [jax.ShapeDtypeStruct((T, h, D), jnp.bfloat16, sharding=sh)
          for h in (HQ, HKV, HKV)]
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args)
  names = {"forward": (cudnn_backend.FWD_TARGET, TARGETS["sdpa_fwd_into"]),
           "backward": (cudnn_backend.BWD_TARGET, TARGETS["sdpa_bwd_into"])}
  return {kind: sorted((a["mask"], a["window_left"])
                       for name in targets
                       for a, _, _ in custom_calls(text, name))
          for kind, targets in names.items()}


def _code(mask, left):
  return (f"{CODES[mask]} : i64", f"{left} : i64")


@pytest.mark.parametrize("cp", [2, 4])
def test_windowed_dual_chunk_swap_runs_no_bottom_right_call(cp):
  """Each way: the banded top-left diagonals, the unmasked near
  rectangles and the top-left far triangles (no band), each over both
  steps."""
  calls = _calls("dual_chunk_swap", 5, cp)
  diag, near = _code("causal_top_left", 5), _code("no_mask", -1)
  far = _code("causal_top_left", -1)
  assert calls["forward"] == calls["backward"] == sorted([diag, near, far])


def test_unwindowed_and_no_load_balance_counts_stay():
  """Without a window DUAL_CHUNK_SWAP keeps one bottom-right forward call
  and three backward calls; windowed NO_LOAD_BALANCE two top-left calls
  each way (the local one banded, the reversed halo call not)."""
  calls = _calls("dual_chunk_swap", None)
  assert calls["forward"] == [_code("causal_bottom_right", -1)]
  assert calls["backward"] == sorted([_code("no_mask", -1)] * 2
                                     + [_code("causal_top_left", -1)])
  calls = _calls("no_load_balance", 5)
  # The local call has its dense (tiled) alternative, chosen on the device
  # (docs/internals.md, Tiled calls): the same mask and band.
  want = sorted([_code("causal_top_left", 5)] * 2
                + [_code("causal_top_left", -1)])
  assert calls == {"forward": want, "backward": want}
