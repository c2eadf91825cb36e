"""The deterministic mode in the CUDA program, lowered on CPU: with the
mode on every backward custom call carries ``deterministic = 1`` (the
frontend's deterministic algorithm; none runs the nondeterministic
kernel), off every one carries 0; the all-gather's gradients go back by
an all-to-all, not a reduce-scatter; a tiled call too large for the bound
leaves the dense graph so it can be cut into K/V slices. Skipped when the
extension is not built."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from jax_cp.attention.cudnn import backend as cudnn_backend
except ModuleNotFoundError:  # a present but broken extension fails
  pytest.skip("jax_cp's cuDNN extension is not built", allow_module_level=True)

import jax_cp
from jax_cp.attention.cudnn import workspace as cudnn_workspace
from tests import determinism_step
from tests._devices import devices
from tests._lowering import custom_calls, lower_for_cuda

TARGETS = cudnn_backend.FFI_TARGETS
BWD_NAMES = (TARGETS["sdpa_bwd"], TARGETS["sdpa_bwd_into"])
D, HQ, HKV = 64, 4, 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def backward_flags(text: str) -> list[str]:
  """The ``deterministic`` attribute of every backward custom call."""
  return [attrs.get("deterministic") for name in BWD_NAMES
          for attrs, _, _ in custom_calls(text, name)]


def forward_calls(text: str) -> list[dict]:
  return [attrs for name in (TARGETS["sdpa_fwd"], TARGETS["sdpa_fwd_into"],
                             TARGETS["sdpa_fwd_out"])
          for attrs, _, _ in custom_calls(text, name)]


def cp_grad_text(strategy, comm_type, max_seqlen, deterministic):
  """The gradient program of cp_attention at cp = 4 lowered for CUDA."""
  mesh = jax.make_mesh((4,), ("cp",), devices=devices(4, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  cu = np.array([0, 20, 66, 96, 118], np.int32)
  cu_p = np.array([0, 24, 72, 104, 128], np.int32)
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy=strategy, comm_type=comm_type,
                           max_seqlen=max_seqlen, deterministic=deterministic)

  def loss(q, k, v):
    out = jax_cp.cp_attention(q, k, v, (cu, cu_p), layout=layout)
    return jnp.sum(out.astype(jnp.float32))

  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cp"))
  args = [jax.ShapeDtypeStruct((128, h, D), jnp.bfloat16, sharding=sh)
          for h in (HQ, HKV, HKV)]
  return lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args)


# (strategy, comm_type, max_seqlen): the all-gather, the halo (a bound)
# and the ring, both strategies.
EXCHANGES = [("dual_chunk_swap", "all_gather", None),
             ("dual_chunk_swap", "ring", None),
             ("no_load_balance", "all_gather", None),
             ("no_load_balance", "all_gather", 48),
             ("no_load_balance", "ring", 64)]


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy,comm_type,max_seqlen", EXCHANGES)
def test_every_backward_call_of_a_cp_layer_is_deterministic(
    strategy, comm_type, max_seqlen):
  """Mode on: ``deterministic = 1`` on every backward call of the layer's
  gradient program (none without the attribute), and no reduce-scatter;
  mode off: 0 on every one. The forward calls carry no such attribute."""
  on = cp_grad_text(strategy, comm_type, max_seqlen, True)
  flags = backward_flags(on)
  assert flags and set(flags) == {"1 : i64"}, flags
  assert all("deterministic" not in a for a in forward_calls(on))
  assert "reduce_scatter" not in on
  if comm_type == "all_gather" and max_seqlen is None:
    assert "all_to_all" in on
  off = cp_grad_text(strategy, comm_type, max_seqlen, False)
  assert set(backward_flags(off)) == {"0 : i64"}
  assert len(backward_flags(off)) == len(flags)


def _fused_grad_text(deterministic, lens=(40, 24), window=None, t=64):
  q = jnp.zeros((t, HQ, D), jnp.bfloat16)
  k = jnp.zeros((t, HKV, D), jnp.bfloat16)
  lens = jnp.array(lens, jnp.int32)

  def loss(q, k, v):
    return jax_cp.fused_attention(
        q, k, v, lens, lens, backend="cudnn", deterministic=deterministic,
        window_size=window).astype(jnp.float32).sum()

  return lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)


def test_split_backward_calls_are_all_deterministic(monkeypatch):
  """A tiny scratch bound: the deterministic backward runs per KV head and
  over K/V slices; every one of those calls carries the attribute."""
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-4")
  text = _fused_grad_text(True)
  flags = backward_flags(text)
  assert len(flags) > 2 and set(flags) == {"1 : i64"}
  assert "stablehlo.while" in text
  monkeypatch.delenv(cudnn_workspace.SCRATCH_LIMIT_ENV)
  # Traced lengths: a ragged and a tiled call (the device chooses), both
  # carrying the mode.
  assert set(backward_flags(_fused_grad_text(True))) == {"1 : i64"}
  assert set(backward_flags(_fused_grad_text(False))) == {"0 : i64"}


def test_a_tiled_call_too_large_for_the_bound_runs_ragged(monkeypatch):
  """One document per row (a tiled call, the dense graph): under the
  bound the deterministic backward stays tiled; past what head groups
  alone can fit it runs the ragged graph, cut into K/V slices."""
  t = 256
  text = _fused_grad_text(True, lens=(t,), t=t)
  (attrs, _, _), = custom_calls(text, TARGETS["sdpa_bwd"])
  assert attrs["tiled"] == "1 : i64" and attrs["deterministic"] == "1 : i64"
  # 214 KB: one KV head's whole call needs 2 * 256 * 256 * 2 bytes of dP
  # alone; four K/V slices of 64 rows fit.
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "2e-4")
  calls = custom_calls(_fused_grad_text(True, lens=(t,), t=t),
                       TARGETS["sdpa_bwd"])
  assert len(calls) > 1
  assert {a["tiled"] for a, _, _ in calls} == {"0 : i64"}
  assert {a["deterministic"] for a, _, _ in calls} == {"1 : i64"}


def test_no_split_fits_raises_naming_the_sizes(monkeypatch):
  """A sliding window is never cut into K/V slices: a deterministic
  backward whose dP buffer exceeds the bound per KV head raises, before
  any kernel, naming the sizes; the default mode lowers."""
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-5")
  with pytest.raises(ValueError, match=r"dP buffer .* no split fits"):
    _fused_grad_text(True, window=(8, 0))
  assert set(backward_flags(_fused_grad_text(False, window=(8, 0)))) == {
      "0 : i64"}


_UNDER_FLAG = """
import jax, jax.numpy as jnp, jax_cp
from tests._lowering import custom_calls, lower_for_cuda
from jax_cp.attention.cudnn import backend as cudnn
q = jnp.zeros((64, 4, 64), jnp.bfloat16)
k = jnp.zeros((64, 2, 64), jnp.bfloat16)
lens = jnp.array([40, 24], jnp.int32)
for det in (None, False):
  loss = lambda q, k, v: jax_cp.fused_attention(
      q, k, v, lens, lens, backend="cudnn", deterministic=det).astype(
          jnp.float32).sum()
  text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
  for attrs, _, _ in custom_calls(text, cudnn.BWD_TARGET):
    print(det, attrs["deterministic"])
"""


def test_xla_flag_turns_the_mode_on():
  """Under ``--xla_gpu_exclude_nondeterministic_ops`` the default
  (``deterministic=None``) lowers the deterministic backward; an explicit
  False keeps the fast one."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_gpu_exclude_nondeterministic_ops=true")
  out = subprocess.run([sys.executable, "-c", _UNDER_FLAG], env=env,
                       cwd=REPO, capture_output=True, text=True, check=True,
                       timeout=300).stdout
  found = re.findall(r"^(\w+) (\d) : i64$", out, re.M)
  assert found and set(found) == {("None", "1"), ("False", "0")}, out


@pytest.mark.parametrize("exchange", ["dcs_all_gather", "nlb_halo"])
def test_example_step_lowers_only_deterministic_backward_calls(exchange):
  """The example's gradient step (bfloat16 on cuDNN, cp = 4, the mode on)
  lowered for CUDA: every backward custom call of the whole program
  carries ``deterministic = 1``; with the mode off every one carries 0."""
  devices(4, "cpu")
  sizes = dict(layers=2, d_model=64, heads=4, kv_heads=2, dtype="bfloat16",
               backend="cudnn", seq_len=256, max_doc_len=128)
  flags = {}
  for det in (True, False):
    grads, state, batch, mesh, _ = determinism_step.build_step(
        exchange, det, dp=1, cp=4, platform="cpu", **sizes)
    with jax.set_mesh(mesh):
      text = grads.trace(state, batch).lower(
          lowering_platforms=("cuda",)).as_text()
    flags[det] = backward_flags(text)
  assert len(flags[True]) >= 2 and set(flags[True]) == {"1 : i64"}
  assert set(flags[False]) == {"0 : i64"}
  assert len(flags[False]) == len(flags[True])
