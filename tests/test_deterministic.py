"""The deterministic mode (docs/determinism.md), on CPU: how XLA's flag is
read, where the choice lives, the exchange's fixed-order gradient sum, the
cuDNN backward's dP scratch and its split, and the example's gradient step
run twice with identical bits for both strategies and every exchange."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp.attention import determinism, registry
from jax_cp.attention.backend import Backend, in_deterministic_mode
from jax_cp.attention.cudnn import workspace as ws
from jax_cp.cp.exchange import AllGather
from tests import determinism_step
from tests._devices import devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, xla_flags: str) -> str:
  """``code``'s stdout in a fresh interpreter with ``XLA_FLAGS`` set."""
  env = dict(os.environ, XLA_FLAGS=xla_flags, PYTHONPATH=REPO,
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                        capture_output=True, text=True, check=True,
                        timeout=300).stdout


_PROBE = """
import json, jax, jax_cp
from jax_cp.attention import determinism, registry
layout = jax_cp.CPLayout(cp_axis=None, backend="xla")
print(json.dumps(dict(
    xla=determinism.xla_requests_determinism(),
    none=registry.resolve_backend("xla", deterministic=None).deterministic,
    false=registry.resolve_backend("xla", deterministic=False).deterministic,
    layout=determinism.resolve_deterministic(layout.deterministic))))
"""


@pytest.mark.parametrize("flags,on", [
    ("", False),
    ("--xla_gpu_exclude_nondeterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false",
     False),
    ("--xla_gpu_exclude_nondeterministic_ops=false", False)])
def test_none_follows_the_xla_flag_as_xla_parsed_it(flags, on):
  """``deterministic=None`` is XLA's flag, in either spelling, as XLA's
  own flag parser left it (the last occurrence wins); False is off
  whatever the flag."""
  got = json.loads(_python(_PROBE, flags).strip().splitlines()[-1])
  assert got == dict(xla=on, none=on, false=False, layout=on)


def test_flags_are_read_from_the_compile_options_proto():
  """The reader walks CompileOptionsProto -> executable_build_options ->
  debug_options and finds the two booleans by field number."""
  def varint(n):
    out = b""
    while True:
      byte, n = n & 0x7F, n >> 7
      out += bytes([byte | (0x80 if n else 0)])
      if not n:
        return out
  field = lambda num, wire, payload: varint(num << 3 | wire) + payload
  nested = lambda num, body: field(num, 2, varint(len(body)) + body)
  debug = (field(1, 0, varint(5)) + nested(7, b"/x") +
           field(297, 0, varint(1)) + field(148, 0, varint(0)) +
           field(9, 5, b"\0\0\0\0"))
  proto = field(1, 0, varint(2)) + nested(3, field(1, 0, varint(2**64 - 1))
                                          + nested(3, debug))
  assert determinism.determinism_flags(proto) == {
      "xla_gpu_deterministic_ops": False,
      "xla_gpu_exclude_nondeterministic_ops": True}
  assert not any(determinism.determinism_flags(b"").values())
  with pytest.raises(ValueError, match="truncated"):
    determinism.proto_fields(b"\x08")


@pytest.mark.parametrize("bad", [1, 0, "yes", np.bool_(True)])
def test_the_choice_is_checked(bad):
  with pytest.raises(ValueError, match="deterministic must be None"):
    jax_cp.CPLayout(cp_axis=None, deterministic=bad)
  with pytest.raises(ValueError, match="deterministic must be None"):
    registry.resolve_backend("xla", deterministic=bad)
  q = jnp.ones((8, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match="deterministic must be None"):
    jax_cp.fused_attention(q, q, q, jnp.array([8]), jnp.array([8]),
                           backend="xla", deterministic=bad)


def test_a_backend_without_a_deterministic_backward_raises():
  """Never a silent nondeterministic backward: the mode on a backend that
  has none raises, naming it; off, the backend is used as registered."""
  xla = registry.resolve_backend("xla")
  plain = Backend(name="plain_test", forward=xla.forward,
                  backward=xla.backward, is_available=xla.is_available)
  assert in_deterministic_mode(plain, False) is plain
  with pytest.raises(ValueError, match="'plain_test' has no deterministic"):
    in_deterministic_mode(plain, True)
  det = in_deterministic_mode(xla, True)
  assert det.deterministic and det.backward is xla.deterministic_backward
  assert det == in_deterministic_mode(xla, True)
  assert hash(det) == hash(in_deterministic_mode(xla, True))
  assert in_deterministic_mode(det, True) is det


def _scatter(exchange, x):
  """``exchange._reduce_scatter`` of the per-rank ``x[r]`` over 4 CPU
  devices, and the lowered text."""
  mesh = jax.make_mesh((4,), ("cp",), devices=devices(4, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.jit(jax.shard_map(
      lambda x: exchange._reduce_scatter(x[0])[None], mesh=mesh,
      in_specs=jax.P("cp"), out_specs=jax.P("cp")))
  return np.asarray(f(x)), f.lower(x).as_text()


def test_the_all_gathers_gradients_are_summed_rank_by_rank():
  """In the mode the reduce-scatter is an all-to-all and adds, rank 0
  first, in float32: equal, bit for bit, to that sum formed with numpy;
  off, it is the collective's psum_scatter. Both agree to rounding."""
  cp, tl = 4, 6
  rng = np.random.default_rng(0)
  x = rng.standard_normal((cp, 2, cp * tl, 3, 5)).astype(np.float32)
  x = (x * 10.0 ** rng.integers(-4, 4, size=x.shape)).astype(np.float32)
  det = AllGather("cp", cp, cp * tl, deterministic=True)
  got, text = _scatter(det, x)
  assert "all_to_all" in text and "reduce_scatter" not in text
  for r in range(cp):
    want = x[0, :, r * tl:(r + 1) * tl]
    for j in range(1, cp):
      want = want + x[j, :, r * tl:(r + 1) * tl]
    np.testing.assert_array_equal(got[r], want)
  plain, text = _scatter(AllGather("cp", cp, cp * tl), x)
  assert "reduce_scatter" in text
  np.testing.assert_allclose(plain, got, rtol=1e-6, atol=1e-6 * np.abs(
      x).max())


def test_dp_buffer_formula_and_split():
  """The deterministic workspace: the dP buffer ``S * Hq * ceil64(s_q) *
  ceil128(s_kv) * 2`` in place of the dQ accumulator; past the bound it is
  split over head groups, then K/V slices (each slice's s_kv shrinks);
  where nothing fits, ValueError naming the sizes."""
  dp = ws.deterministic_dp_bytes(3, 8, 100, 130)
  assert dp == 3 * 8 * 128 * 256 * 2
  b = ws.backward_workspace(1000, 2000, 8, 2, 64, segments=3,
                            max_seqlen_q=100, max_seqlen_kv=130,
                            deterministic=True)
  assert b.dq_accum == 0 and b.dp == dp
  assert b.dk_full_heads == 2000 * 8 * 64 * 4
  assert b.total == dp + 2 * 2000 * 8 * 64 * 4 + 1000 * 8 * 4
  off = ws.backward_workspace(1000, 2000, 8, 2, 64)
  assert off.dp == 0 and off.dq_accum == 1000 * 8 * 64 * 4
  with pytest.raises(ValueError, match="pass all three"):
    ws.backward_workspace(1000, 2000, 8, 2, 64, deterministic=True)
  # One document of 64k tokens, Hq=32, Hkv=8, D=128 at the 4 GiB bound:
  # one KV head's dP alone is 4 * 64k * 64k * 2 = 32 GiB, so 8 groups,
  # each over the fewest K/V slices whose worst call fits.
  t = 65536
  kw = dict(segments=1, max_seqlen_q=t, max_seqlen_kv=t, deterministic=True)
  groups, slices = ws.backward_split(t, t, 32, 8, 128, limit=4 * 2**30,
                                     **kw)
  assert groups == 8 and slices > 8
  rows = -(-t // slices)
  assert ws.backward_workspace(t, rows, 4, 1, 128, segments=1,
                               max_seqlen_q=t, max_seqlen_kv=rows,
                               deterministic=True).total <= 4 * 2**30
  prev = -(-t // (slices - 1))
  assert ws.backward_workspace(t, prev, 4, 1, 128, segments=1,
                               max_seqlen_q=t, max_seqlen_kv=prev,
                               deterministic=True).total > 4 * 2**30
  # Off, the same call needs no K/V slices.
  assert ws.backward_split(t, t, 32, 8, 128, limit=4 * 2**30, segments=1,
                           max_seqlen_q=t)[1] == 1
  with pytest.raises(ValueError, match=r"S=1 segments of up to s_q=65536"):
    ws.backward_split(t, t, 32, 8, 128, limit=2**20, **kw)
  with pytest.raises(ValueError, match="sliding window or a tiled graph"):
    ws.backward_split(t, t, 32, 8, 128, limit=4 * 2**30, kv_slices=False,
                      **kw)


# One layer, small: the step compiles in seconds per exchange on CPU.
SMALL = dict(layers=1, d_model=32, heads=4, kv_heads=2, dtype="float32",
             backend="xla", seq_len=160, max_doc_len=80)


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("exchange", sorted(determinism_step.EXCHANGES))
def test_example_step_twice_gives_identical_bits(exchange):
  """The example's jitted gradient step with the mode on, run twice on
  4 CPU devices (cp = 4): the loss and every gradient are bitwise equal,
  for both strategies and every exchange (all-gather, halo, ring). The
  mode's results agree with the default's to float32 rounding (the
  exchange's all-to-all sum is the same sum)."""
  devices(4, "cpu")
  a, b, kind = determinism_step.step_twice(exchange, True, dp=1, cp=4,
                                           platform="cpu", **SMALL)
  assert kind == determinism_step.EXPECTED_KIND[exchange]
  diff = determinism_step.differences(a, b)
  assert diff["bitwise_equal"], diff
  assert np.isfinite(a["loss"]) and all(np.isfinite(g).all()
                                        for g in a["grads"])
  assert any(np.abs(g).max() > 0 for g in a["grads"])
  c, _, _ = determinism_step.step_twice(exchange, False, dp=1, cp=4,
                                        platform="cpu", **SMALL)
  np.testing.assert_allclose(a["loss"], c["loss"], rtol=1e-6)
  for x, y in zip(a["grads"], c["grads"]):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6 * np.abs(y).max())
