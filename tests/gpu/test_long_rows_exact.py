"""GPU tests: every output of a cuDNN call is exact at the sizes long rows
reach, below, at and past 2^30 elements per tensor, where cuDNN's ragged
backward with 32-bit offsets returns wrong dK/dV and dQ.

Each test runs its calls in a subprocess (tests/gpu/exact_call.py) that
holds a file lock: the calls need tens of GB, and a process of their own
gives them back to the device when it ends, whatever the other test workers
sharing the GPU hold. The references are exact float32 results for an
output cotangent on 128 random query rows
(benchmarks/exactness.py), so each check covers out, lse, dq
(its rows and zero elsewhere), dk and dv over the whole row.

The size tests run each backward as one cuDNN call (the head-group split
off: ``JAX_CP_CUDNN_BWD_SCRATCH_GIB=inf``), so that they test its
addressing at the full size; :func:`test_head_group_split_past_the_limit`
runs the default, where a backward with more than 4 GiB of cuDNN workspace
is split over GQA head groups (jax_cp.attention.head_groups) and, past it
still, over K/V slices (jax_cp.attention.cudnn.kv_slices).
"""

import fcntl
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

from jax_cp.attention.cudnn.workspace import SCRATCH_LIMIT_ENV
from tests.gpu._requires import cudnn_backend_or_skip, gpu_memory_or_skip

cudnn_backend_or_skip()

#: Relative error bound for bfloat16/float16 results (the rounding of the
#: outputs alone gives about 2e-3 to 4e-3; the broken path gave 0.6-1.3).
TOL = 5e-3

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_LOCK = os.path.join("/tmp", "jax_cp_gpu_exact_call.lock")
#: GPU memory the MHA calls of 2^31 and 2^32 elements need (one call with
#: its cuDNN workspace, and the reference's errors beside it): they run on
#: an H200 (141 GB) and run out on an 80 GB H100.
MHA_GIB = 120


def _run(cases, scratch_gib="inf"):
  """{id: errors dict or error string} of cases run in one subprocess, with
  ``JAX_CP_CUDNN_BWD_SCRATCH_GIB=scratch_gib`` (None: the default)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_PYTHON_CLIENT_MEM_FRACTION="0.85")
  env.pop(SCRATCH_LIMIT_ENV, None)
  if scratch_gib is not None:
    env[SCRATCH_LIMIT_ENV] = scratch_gib
  with open(_LOCK, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.exact_call", json.dumps(cases)],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=1200)
  got = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      r = json.loads(line)
      got[r["id"]] = r.get("errors", r.get("error"))
  missing = [c["id"] for c in cases if c["id"] not in got]
  assert not missing, (f"no result for {missing} (exit {proc.returncode}):"
                       f"\n{proc.stderr[-4000:]}")
  return got


def _assert_exact(cases, got, outputs=("out", "lse", "dq", "dk", "dv")):
  bad = []
  for c in cases:
    r = got[c["id"]]
    if not isinstance(r, dict):
      bad.append(f"{c['id']}: {r}")
      continue
    worst = {n: r[n] for n in outputs if n in r and not r[n] <= TOL}
    if worst:
      bad.append(f"{c['id']}: {worst}")
  table = "\n".join(f"{c['id']}: {got[c['id']]}" for c in cases)
  bad_lines = "\n".join(bad)
  assert not bad, f"relative errors above {TOL:g}:\n{bad_lines}\nall:\n{table}"


def _case(id_, layout, tokens, hq, hkv, d, **kw):
  return dict(id=id_, kind="call", layout=layout, tokens=tokens, hq=hq,
              hkv=hkv, d=d, **kw)


def test_sizes_around_the_limit():
  """25 random documents (the ragged graph), GQA 32/8: just below 2^30
  elements (2^29), at it, 1.4x past it, and 2^31 elements of Q."""
  cases = [
      _case("below 2^29", "mixed", 131072, 32, 8, 128),
      _case("at 2^30", "mixed", 262144, 32, 8, 128),
      _case("1.4x 2^30", "mixed", 368640, 32, 8, 128),
      _case("2^31 of Q", "mixed", 1048576, 32, 8, 64),
  ]
  _assert_exact(cases, _run(cases))


def test_layouts_and_dtypes_past_the_limit():
  """One document (the tiled graph) at 2^31, documents of 1k-8k tokens at
  2^30, float16."""
  cases = [
      _case("one doc 2^31", "one_doc", 1048576, 32, 8, 64),
      _case("1k-8k docs 2^30", "short", 262144, 32, 8, 128),
      _case("float16 2^30", "mixed", 262144, 32, 8, 128, dtype="float16"),
  ]
  _assert_exact(cases, _run(cases))


def test_mha_past_the_limit():
  """MHA (no full-head buffers) at 2^31 elements, and as a CP rank runs
  it with K/V of 2^32 elements (4M tokens; Q the last 1/8 of each
  document, bottom-right causal)."""
  gpu_memory_or_skip(MHA_GIB)
  cases = [
      _case("MHA 2^31", "mixed", 2097152, 8, 8, 128),
      _case("cp K/V 2^32 MHA", "cp", 4194304, 8, 8, 128),
  ]
  _assert_exact(cases, _run(cases))


def test_cp_shaped_calls_past_the_limit():
  """Tq != Tkv as a CP rank runs: Q holds the last 1/8 of each document,
  K/V the whole row, bottom-right causal, K/V of 2^30 elements with GQA
  (2^32 at the query heads)."""
  cases = [_case("cp K/V 2^30 GQA", "cp", 1048576, 32, 8, 128)]
  _assert_exact(cases, _run(cases))


def test_cp_attention_past_the_limit():
  """jax_cp.cp_attention at cp=1, both strategies, with and without a
  sliding window, on a row of 2^30 query elements (25 documents)."""
  cases = [dict(id=f"{s} window={w}", kind="cp", layout="mixed",
                tokens=262144, hq=32, hkv=8, d=128, strategy=s, window=w)
           for s in ("dual_chunk_swap", "no_load_balance")
           for w in (-1, 4096)]
  _assert_exact(cases, _run(cases), outputs=("out", "dq", "dk", "dv"))


def test_32_bit_offsets_break_past_the_limit():
  """The mutation: the same call at 2^30 with 32-bit offsets forced gives
  wrong gradients, so the tests above would catch a lost fix."""
  cases = [_case("at 2^30, int32", "mixed", 262144, 32, 8, 128,
                 offset_bits=32)]
  got = _run(cases)
  r = got[cases[0]["id"]]
  assert isinstance(r, dict), r
  assert max(r["dk"], r["dv"]) > 10 * TOL, r


def test_head_group_split_past_the_limit():
  """The default scratch limit: backwards past 4 GiB of cuDNN workspace
  run as sub-calls over GQA head groups (2 to 8 here). Both graphs, Tq !=
  Tkv, and a CP-shaped call with 2M tokens of K/V, 2^31 elements (73 GB of
  workspace in one call, which does not fit beside its inputs; 9.1 GB in
  each of 8 head groups, still past the limit, so each runs over 3 K/V
  slices, jax_cp.attention.cudnn.kv_slices: a bottom-right and an unmasked call
  per slice)."""
  cases = [
      _case("split mixed 2^30", "mixed", 262144, 32, 8, 128),
      _case("split one doc 2^31", "one_doc", 1048576, 32, 8, 64),
      _case("split cp K/V 2^30 GQA", "cp", 1048576, 32, 8, 128),
      _case("split cp K/V 2^31 GQA", "cp", 2097152, 32, 8, 128),
  ]
  _assert_exact(cases, _run(cases, scratch_gib=None))
