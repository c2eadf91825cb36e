"""GPU test (marker gpu): the deterministic mode on cuDNN
(docs/determinism.md).

* The example's gradient step (examples/packed_lm, bfloat16, cuDNN) on one
  GPU, both strategies, one long document per row and short documents,
  each in a process of its own started with XLA's
  ``--xla_gpu_exclude_nondeterministic_ops`` and the layout's
  ``deterministic=None`` (so the flag turns the mode on, for jax_cp's
  kernels and XLA's alike): the loss and every gradient are bitwise equal
  over two runs. Without the flag and with the mode off, the run-to-run
  difference is measured and reported (the run's summary, "run-to-run
  differences").
* The ring's ranks emulated on one GPU (``jax.vmap``), both strategies,
  and one long ``fused_attention`` call split over head groups and K/V
  slices by a small scratch bound, with ``deterministic=True`` alone (no
  XLA flag: these programs hold no XLA op that the flag changes):
  bitwise equal over two runs, and equal to the default mode's results up
  to bfloat16 rounding.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_cp  # noqa: E402
from jax_cp import CPLoadBalancingStrategy as S  # noqa: E402
from jax_cp.attention.cudnn import workspace as cudnn_workspace  # noqa: E402
from tests import determinism_step  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.test_ring import ranks_on_one_device  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
FLAG = "--xla_gpu_exclude_nondeterministic_ops=true"

#: The example model on one GPU: 2 layers, 8 query and 2 KV heads of 64,
#: 8k tokens per row, bfloat16 on cuDNN.
MODEL = dict(layers=2, d_model=512, heads=8, kv_heads=2, dtype="bfloat16",
             backend="cudnn", seq_len=8192)
#: Documents: one per row (cut at the row length; the seed is the first
#: whose row holds one), or short ones.
DOCS = {"one_doc": dict(max_doc_len=8192), "short_docs": dict(max_doc_len=512)}
STRATEGIES = {"dual_chunk_swap": "dcs_all_gather",
              "no_load_balance": "nlb_all_gather"}


def _overrides(strategy: str, docs: str) -> dict:
  """The example's config fields of a case; one document: the first seed
  whose row holds a single document."""
  base = dict(MODEL, **DOCS[docs])
  if docs != "one_doc":
    return base
  for seed in range(64):
    if determinism_step.documents(STRATEGIES[strategy], 1, 1, seed=seed,
                                  **base) == 1:
      return dict(base, seed=seed)
  pytest.fail("no seed below 64 gives a row of one document")


def _step_twice(strategy: str, docs: str, deterministic: str,
                flag: bool) -> dict:
  """tests/determinism_step.py in a process of its own (XLA reads its
  flags once per process), with or without XLA's determinism flag."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "deterministic" not in f]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_FLAGS=" ".join(flags + ([FLAG] if flag else [])))
  cmd = [sys.executable, "-m", "tests.determinism_step", "--exchange",
         STRATEGIES[strategy], "--deterministic", deterministic,
         "--platform", "gpu", "--dp", "1", "--cp", "1", "--overrides",
         json.dumps(_overrides(strategy, docs))]
  proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True,
                        text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("docs", sorted(DOCS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_example_step_is_bitwise_reproducible_under_the_xla_flag(
    strategy, docs, record_run_to_run):
  got = _step_twice(strategy, docs, "none", flag=True)
  record_run_to_run(got)
  assert got["xla_flag"], got
  assert (got["documents"] == 1) == (docs == "one_doc"), got
  assert np.isfinite(got["loss"]), got
  assert got["bitwise_equal"], got


@pytest.mark.parametrize("docs", sorted(DOCS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_example_step_run_to_run_difference_without_the_mode(
    strategy, docs, record_run_to_run):
  """The size of the nondeterminism the mode removes: the two runs'
  largest loss and gradient differences, reported. They are bounded by
  bfloat16 rounding of the gradients (a difference past that is a bug,
  not an order of sums)."""
  got = _step_twice(strategy, docs, "false", flag=False)
  record_run_to_run(got)
  assert not got["xla_flag"], got
  assert np.isfinite(got["loss"]) and got["loss_diff"] < 1e-2, got
  assert np.isfinite(got["grad_max_diff"]), got


T_RING, HQ, HKV, D = 2048, 8, 2, 64


def _bits(arrays) -> list[bytes]:
  return [np.asarray(a).tobytes() for a in arrays]


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float32)
                                 - np.asarray(y, np.float32))))
             for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_ring_on_one_gpu_is_bitwise_reproducible(strategy, record_run_to_run):
  """The ring's ranks on one GPU (cp = 4): with ``deterministic=True`` two
  runs give the same bits in out, dq, dk, dv; the results match the
  default mode's up to bfloat16 rounding; the default mode's run-to-run
  difference is reported."""
  cp = 4
  rng = np.random.default_rng(7)
  cu, cuP = ref.random_layout(rng, T_RING, cp, "mixed",
                              dual_chunk=strategy == S.DUAL_CHUNK_SWAP)
  mk = lambda h: jnp.asarray(rng.standard_normal((T_RING, h, D)),
                             jnp.bfloat16)
  q, k, v = mk(HQ), mk(HKV), mk(HKV)
  w = jnp.asarray(rng.standard_normal((T_RING, HQ, D)), jnp.float32)
  run = lambda det: (lambda r: (r[0],) + r[1])(ranks_on_one_device(
      q, k, v, w, cu, cuP, cp=cp, strategy=strategy, backend="cudnn",
      deterministic=det))
  first, second = run(True), run(True)
  off_a, off_b = run(False), run(False)
  record_run_to_run(dict(deterministic_diff=_max_diff(first, second),
                         default_diff=_max_diff(off_a, off_b)))
  assert _bits(first) == _bits(second)
  valid = ref.valid_token_mask(cu, cuP)
  for name, a, b in zip(("out", "dq", "dk", "dv"), first, off_a):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), name
    assert ref.rel_err(a[valid], b[valid]) < 2e-2, name


def test_split_fused_attention_is_bitwise_reproducible(monkeypatch,
                                                       record_run_to_run):
  """One document of 16k tokens, Hq=8, Hkv=2, D=128, under a 1 GiB scratch
  bound: the deterministic backward runs per KV head over K/V slices (its
  dP buffer is 2 GiB per KV head whole). Two runs give the same bits, and
  the gradients match the default mode's up to bfloat16 rounding."""
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1")
  t, d = 16384, 128
  groups, slices = cudnn_workspace.backward_split(
      t, t, HQ, HKV, d, segments=1, max_seqlen_q=t, max_seqlen_kv=t,
      deterministic=True)
  assert groups == HKV and slices > 1
  rng = np.random.default_rng(3)
  mk = lambda h: jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  q, k, v = mk(HQ), mk(HKV), mk(HKV)
  w = jnp.asarray(rng.standard_normal((t, HQ, d)), jnp.float32)
  lens = jnp.array([t], jnp.int32)

  def grads(det):
    def loss(q, k, v):
      out = jax_cp.fused_attention(q, k, v, lens, lens, backend="cudnn",
                                   attn_mask_type="causal_top_left",
                                   deterministic=det)
      return jnp.sum(out.astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  first, second = grads(True), grads(True)
  off_a, off_b = grads(False), grads(False)
  record_run_to_run(dict(deterministic_diff=_max_diff(first, second),
                         default_diff=_max_diff(off_a, off_b)))
  assert _bits(first) == _bits(second)
  for name, a, b in zip(("dq", "dk", "dv"), first, off_a):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), name
    assert ref.rel_err(a, b) < 2e-2, name
