"""A violated ``max_seqlen`` with raw traced metadata: the step falls back
to the unbounded program (right results and gradients), and the bounded
program keeps its K/V all-gather only inside the fallback branch; a batch
checked on the host runs the bounded program alone."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPBatch, CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.cp import guard
from jax_cp.cp.config import make_config
from jax_cp.cp.vjp import cp_attention_vjp
from jax_cp.data import longest_padded_document, reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import cp_mesh

T, D = 64, 8
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP


def metadata(plens, lens):
  """[B, N+1] cu_seqlens and cu_seqlens_padded from per-row lengths."""
  cum = lambda rows: np.array([np.concatenate([[0], np.cumsum(r)])
                               for r in rows], np.int32)
  return cum(lens), cum(plens)


# Two rows of 9 document slots, padded lengths multiples of 4 (as
# DUAL_CHUNK_SWAP at cp=2 needs): every document within the smallest bound
# used (8), or one of 40 tokens (empty slots at the end).
WITHIN = metadata([[8, 4, 8, 8, 4, 8, 8, 8, 8], [4, 8, 8, 8, 8, 8, 8, 8, 4]],
                  [[7, 4, 8, 1, 4, 8, 5, 8, 6], [4, 8, 3, 8, 8, 2, 8, 7, 4]])
BEYOND = metadata([[8, 40, 4, 4, 8, 0, 0, 0, 0], [8] * 8 + [0]],
                  [[8, 37, 1, 4, 6, 0, 0, 0, 0], [8, 5, 8, 8, 3, 8, 8, 8, 0]])


def qkv(seed):
  rng = np.random.default_rng(seed)
  mk = lambda h: jnp.asarray(rng.standard_normal((2, T, h, D)), jnp.float32)
  return mk(4), mk(2), mk(2), mk(4)


def reference(q, k, v, w, cu, cuP):
  out = ref.batched_attention(q, k, v, cu, cuP)
  grads = jax.grad(lambda q, k, v: jnp.sum(
      ref.batched_attention(q, k, v, cu, cuP) * w), argnums=(0, 1, 2))(
          q, k, v)
  return out, grads


def step(strategy, cp, bound, window=None):
  """jit(value and grads) of CP attention, metadata as (traced) arguments;
  inputs and outputs in physical order."""
  layout = CPLayout(mesh=cp_mesh(cp), strategy=strategy, backend="xla",
                    max_seqlen=bound)

  def f(q, k, v, w, cu, cuP):
    re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=1)
    out = jax_cp.cp_attention(re(q), re(k), re(v), (cu, cuP), layout=layout,
                              window_size=window)
    return restore_from_cp(out, cuP, layout, seq_dim=1), out

  def loss(q, k, v, w, cu, cuP):
    out, _ = f(q, k, v, w, cu, cuP)
    return jnp.sum(out * w), out

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def shapes(hq=4, hkv=2):
  """q, k, v of the tests as ``jax.ShapeDtypeStruct``."""
  sds = lambda h: jax.ShapeDtypeStruct((1, T, h, D), jnp.float32)
  return sds(hq), sds(hkv), sds(hkv)


def traced_config(strategy, cp, bound, trusted=False):
  """The CPConfig of a call whose metadata is traced (``trusted``: a batch
  checked on the host)."""
  got = []

  def build(cuP):
    got.append(make_config(
        CPLayout(strategy=strategy, backend="xla", max_seqlen=bound),
        *shapes(), cuP, cuP, cp_size=cp, total_tokens=T,
        attn_mask_type="causal", softmax_scale=None, window_size=None,
        trusted=trusted))
    return cuP

  jax.eval_shape(build, jax.ShapeDtypeStruct((1, 10), jnp.int32))
  return got[0]


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy, cp, bound, guarded", [
    (NLB, 2, 8, True),     # halo of 7 <= Tl/2: kept from the forward
    (NLB, 4, 12, True),    # halo of 11 > Tl/2: exchanged again
    # With the xla backend (exact past the kernels' bounds) these bounded
    # programs are exact for longer documents: no fallback, same results.
    (NLB, 2, 33, False),   # all-gather, the halo call reads all rows
    (NLB, 1, 16, False),   # no exchange, bounds only
    (DCS, 2, 16, False),   # all-gather, bounds only
])
def test_fallback_gives_reference_results_and_gradients(strategy, cp, bound,
                                                        guarded):
  cfg = traced_config(strategy, cp, bound)
  assert (cfg.bound_check == "fallback") == guarded
  assert (cfg.unbounded is not None) == guarded
  q, k, v, w = qkv(cp * 100 + bound)
  run = step(strategy, cp, bound)
  for cu, cuP in (BEYOND, WITHIN):
    grads, out = run(q, k, v, w, jnp.asarray(cu), jnp.asarray(cuP))
    want_out, want_grads = reference(q, k, v, w, cu, cuP)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
    for name, g, g_ref in zip("qkv", grads, want_grads):
      np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-5,
                                 err_msg=f"d{name}")


def test_fallback_in_a_callers_shard_map_with_type_checks():
  """The local view inside the caller's shard_map (check_vma on, the
  default): both branches of the guard have the same varying types, also
  where the bounded forward keeps its halo (bound 8 at cp=2)."""
  q, k, v, w = qkv(4)
  x_spec = jax.sharding.PartitionSpec(None, "cp")
  m_spec = jax.sharding.PartitionSpec()
  layout = CPLayout(strategy=NLB, backend="xla", max_seqlen=8, view="local")

  def body(q, k, v, cu, cuP):
    return jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)

  attn = jax.shard_map(body, mesh=cp_mesh(2),
                       in_specs=(x_spec,) * 3 + (m_spec,) * 2,
                       out_specs=x_spec)
  loss = lambda q, k, v, cu, cuP: jnp.sum(attn(q, k, v, cu, cuP) * w)
  run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  for cu, cuP in (BEYOND, WITHIN):
    _, grads = run(q, k, v, jnp.asarray(cu), jnp.asarray(cuP))
    _, want = reference(q, k, v, w, cu, cuP)
    for name, g, g_ref in zip("qkv", grads, want):
      np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-5,
                                 err_msg=f"d{name}")


def test_without_the_guard_the_violating_batch_is_wrong():
  """The violating batch through the bounded program alone (the guard
  taken out of the config) loses keys: the tests above do exercise the
  fallback."""
  q, k, v, _ = qkv(0)

  def body(q, k, v, cu, cuP):
    cfg = make_config(CPLayout(strategy=NLB, backend="xla", max_seqlen=8),
                      q, k, v, cu, cuP, cp_size=2, total_tokens=T,
                      attn_mask_type="causal", softmax_scale=None,
                      window_size=None, trusted=False)
    assert cfg.bound_check == "fallback" and cfg.unbounded is not None
    cfg = dataclasses.replace(cfg, bound_check=None, unbounded=None)
    return cp_attention_vjp(q, k, v, cu, cuP, cfg)

  x_spec = jax.sharding.PartitionSpec(None, "cp")
  m_spec = jax.sharding.PartitionSpec()
  out = jax.jit(jax.shard_map(body, mesh=cp_mesh(2),
                              in_specs=(x_spec,) * 3 + (m_spec,) * 2,
                              out_specs=x_spec, check_vma=False))(
                                  q, k, v, *map(jnp.asarray, BEYOND))
  want = ref.batched_attention(q, k, v, *BEYOND)
  assert np.abs(np.asarray(out) - np.asarray(want)).max() > 1e-2


@pytest.mark.parametrize("left", [3, 12])
def test_fallback_with_a_sliding_window(left):
  """NO_LOAD_BALANCE with a window: the bounded and the unbounded program
  exchange the same halo of min(left, W-1) = left tokens (kept from the
  forward by both), but only the unbounded halo call reads every row;
  the fallback drops its own halo for the bounded residual's shape."""
  cp, bound = 2, 16
  q, k, v, w = qkv(left)
  cu, cuP = BEYOND
  run = step(NLB, cp, bound, window=(left, 0))
  grads, out = run(q, k, v, w, jnp.asarray(cu), jnp.asarray(cuP))
  want = ref.batched_attention(q, k, v, cu, cuP, window=left)
  want_grads = jax.grad(lambda q, k, v: jnp.sum(ref.batched_attention(
      q, k, v, cu, cuP, window=left) * w), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  for name, g, g_ref in zip("qkv", grads, want_grads):
    np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-5,
                               err_msg=f"d{name}")


@pytest.mark.sweep(fast=2)
@pytest.mark.parametrize("strategy, cp, bound", [
    (DCS, 2, 16), (DCS, 4, 32), (NLB, 1, 16), (NLB, 2, 33), (NLB, 2, 8),
    (NLB, 4, 12)])
def test_a_backend_sized_by_its_bounds_always_falls_back(strategy, cp,
                                                         bound):
  """With a backend whose kernels are sized by the bounds (cudnn), every
  bounded config has the fallback; a batch checked on the host never
  needs it."""
  cfg = traced_config(strategy, cp, bound)
  unbounded = traced_config(strategy, cp, None)
  assert unbounded.bound_check is None and unbounded.max_seqlen == T
  sized = lambda c: dataclasses.replace(c, backend=dataclasses.replace(
      c.backend, exact_past_bounds=False))
  assert not guard.bounded_program_is_exact(sized(cfg), sized(unbounded))
  trusted = traced_config(strategy, cp, bound, trusted=True)
  assert trusted.bound_check != "fallback" and trusted.unbounded is None


def test_concrete_metadata_is_checked_by_value_not_in_graph():
  q, k, v, _ = qkv(1)
  cu, cuP = BEYOND
  with pytest.raises(ValueError, match="max_seqlen=8 is smaller than the "
                     "longest padded document \\(40 tokens\\)"):
    jax_cp.cp_attention(q, k, v, (cu, cuP), layout=CPLayout(
        mesh=cp_mesh(2), strategy=NLB, backend="xla", max_seqlen=8))


# --------------------------------------------------------------- lowering

_CALLEE_RE = re.compile(
    r"(calls|to_apply|body|condition|branch_computations|true_computation|"
    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")


def hlo_computations(text):
  """{name: [instruction lines]} and the entry's name, from HLO text."""
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      words = line.split()
      is_entry = words[0] == "ENTRY"
      name = words[1 if is_entry else 0].lstrip("%")
      comps[name] = []
      entry = name if is_entry else entry
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def _callees(line, branches: bool):
  """Computations an instruction calls: its conditional branches (in
  order) when ``branches``, else the others."""
  out = []
  for kind, callee in _CALLEE_RE.findall(line):
    if (kind in ("branch_computations", "true_computation",
                 "false_computation")) == branches:
      out += [x.strip().lstrip("%") for x in callee.strip("{}").split(",")]
  return out


def reachable(comps, roots):
  """Computations reachable from ``roots`` without entering a conditional's
  branch, and the conditionals' branch lists met on the way."""
  seen, todo, conds = set(), list(roots), []
  while todo:
    c = todo.pop()
    if c in seen:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += _callees(line, branches=False)
      if " conditional(" in line:
        conds.append(_callees(line, branches=True))
  return seen, conds


def lines_of(comps, names, word):
  return [line for c in names for line in comps[c] if word in line]


def check_gathers_only_in_fallback(text, attention_call=None):
  """Outside every conditional: no all-gather, no reduce-scatter. Each
  conditional (forward, backward) is the guard's: branch 0 (the bounded
  step) moves K/V by permutes only, branch 1 (the fallback) all-gathers;
  both hold the ``attention_call`` custom calls (when given)."""
  comps, entry = hlo_computations(text)
  outside, conds = reachable(comps, [entry])
  assert not lines_of(comps, outside, "all-gather")
  assert not lines_of(comps, outside, "reduce-scatter")
  assert len(conds) == 2, conds
  for bounded, fallback in conds:
    inside_bounded, more = reachable(comps, [bounded])
    inside_fallback, more2 = reachable(comps, [fallback])
    # Nested conditionals are a call's choice of its cuDNN graph on the
    # device (docs/internals.md, Tiled calls): attention calls alone.
    for nested in more + more2:
      for branch in nested:
        inner, deeper = reachable(comps, [branch])
        assert not deeper
        for op in ("all-gather", "reduce-scatter", "collective-permute"):
          assert not lines_of(comps, inner, op), (branch, op)
        assert attention_call and lines_of(comps, inner, attention_call)
    assert not lines_of(comps, inside_bounded, "all-gather")
    assert lines_of(comps, inside_bounded, "collective-permute")
    assert lines_of(comps, inside_fallback, "all-gather")
    if attention_call is not None:
      assert lines_of(comps, inside_bounded, attention_call)
      assert lines_of(comps, inside_fallback, attention_call)


@pytest.mark.parametrize("compiled", [False, True])
def test_all_gather_only_inside_the_fallback_branch(compiled):
  """NO_LOAD_BALANCE with a halo exchange and traced metadata, forward and
  backward, in the HLO handed to XLA and after XLA's passes."""
  q, k, v, w = qkv(3)
  lowered = step(NLB, 4, 12).lower(q, k, v, w, *map(jnp.asarray, WITHIN))
  check_gathers_only_in_fallback(
      lowered.compile().as_text() if compiled else
      lowered.compiler_ir("hlo").as_hlo_text())


def test_cuda_lowering_gathers_only_inside_the_fallback_branch():
  """The same with the cudnn backend, lowered for CUDA (skipped without
  the extension)."""
  try:
    import jax_cp.attention.cudnn.backend  # noqa: F401
  except ModuleNotFoundError:
    pytest.skip("jax_cp's cuDNN extension is not built")
  cp, tl, w = 2, 2048, 1600
  # Only lowered: CPU devices on a GPU too.
  layout = CPLayout(mesh=cp_mesh(cp, "cpu"), strategy=NLB, backend="cudnn",
                    max_seqlen=w)

  def loss(q, k, v, dout, cu, cuP):
    out = jax_cp.cp_attention(q, k, v, (cu, cuP), layout=layout)
    return jnp.sum(out.astype(jnp.float32) * dout)

  sds = lambda h, dt=jnp.bfloat16: jax.ShapeDtypeStruct((cp * tl, h, 64), dt)
  meta = jax.ShapeDtypeStruct((6,), jnp.int32)
  check_gathers_only_in_fallback(
      jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(
          sds(8), sds(2), sds(2), sds(8, jnp.float32), meta, meta).lower(
              lowering_platforms=("cuda",)).compiler_ir("hlo").as_hlo_text(),
      attention_call="jax_cp_cudnn_sdpa_")


def test_predicate():
  cuP = jnp.asarray([[0, 8, 40, 48, 64], [0, 16, 32, 48, 64]], jnp.int32)
  assert int(guard.longest_padded(cuP)) == 32
  assert bool(guard.exceeds_bound(cuP, 31))
  assert not bool(guard.exceeds_bound(cuP, 32))


def test_host_checked_batch_has_no_guard():
  """A batch checked on the host vouches for the bound, so the step carries
  no check and no conditional (only the NaN poison of a broken promise),
  and a batch within the bound gives the reference results."""
  cfg = traced_config(NLB, 4, 12, trusted=True)
  assert cfg.bound_check == "trusted" and cfg.unbounded is None
  assert cfg.exchange.kind == "halo"
  q, k, v, w = qkv(5)
  cu, cuP = WITHIN
  layout = CPLayout(mesh=cp_mesh(4), strategy=NLB, backend="xla",
                    max_seqlen=12)
  batch = CPBatch(None, jnp.asarray(cuP), jnp.asarray(cu),
                  layout=layout).check_on_host()
  assert longest_padded_document(cuP) <= 12     # the host check

  def loss(q, k, v, w, batch):
    out = jax_cp.cp_attention(q, k, v, batch)
    return jnp.sum(out * w), out

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  text = fn.lower(q, k, v, w, batch).compiler_ir("hlo").as_hlo_text()
  assert " conditional(" not in text and "all-gather" not in text
  # NO_LOAD_BALANCE keeps the physical order: no reorder needed.
  grads, out = fn(q, k, v, w, batch)
  want, want_grads = reference(q, k, v, w, cu, cuP)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  for g, gw in zip(grads, want_grads):
    np.testing.assert_allclose(g, gw, atol=5e-5, rtol=5e-5)
