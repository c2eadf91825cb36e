"""Property test of the public CP API: random layouts x random mutations.

Layouts: documents and padding drawn at random, cp in {1, 2, 4}, both
strategies, with and without a batch dim, GQA, with and without a
``max_seqlen`` bound (fixed families below, so few programs compile).
Each sample then gets one mutation: of the metadata (negative lengths,
unsorted offsets, lengths above the padded ones, a wrong last entry, wrong
shapes, a bound below the longest document...), of the shapes (heads, head
dims, token counts not divisible by cp) or of the dtypes (integer, mixed),
or a harmless one, or none.

The property: every call (reorder, ``cp_attention``, restore, with the
metadata as concrete host arrays) either raises ``ValueError``/``TypeError``
while tracing, so before any kernel runs (``jax.eval_shape`` runs no
kernel), or gives the float64 reference's output. Accepted samples are
computed by one jitted program per family (metadata as arguments), whose
result is the same as the eager call's.

Seeded and fast: most mutations raise before anything compiles.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import devices

T, D, SLOTS = 32, 8, 6
NLB, DCS = S.NO_LOAD_BALANCE, S.DUAL_CHUNK_SWAP

# (cp, strategy, batch rows or None, Hq, Hkv, max_seqlen)
FAMILIES = [
    (1, NLB, 2, 4, 2, None),
    (1, DCS, None, 2, 1, 16),
    (2, DCS, 2, 4, 2, None),
    (2, NLB, None, 2, 2, 16),
    (2, DCS, None, 4, 1, 16),
    (4, NLB, 2, 2, 1, 16),
    (4, DCS, 1, 4, 4, None),
    (4, NLB, None, 4, 2, None),
]
SAMPLES_PER_FAMILY = 16

MUTATIONS = (
    # harmless: the call must compute the reference
    "none", "none", "shorter_document", "empty_document",
    # metadata values
    "negative_length", "unsorted_padded", "length_above_padded",
    "wrong_last_padded", "first_not_zero", "dcs_indivisible",
    "bound_below_longest", "bound_zero",
    # metadata shapes and dtypes
    "extra_entry", "wrong_rank", "float_metadata", "batch_mismatch",
    # tensor shapes and dtypes
    "heads_not_multiple", "head_dims_differ", "k_v_differ",
    "tokens_differ", "tokens_not_divisible", "int_inputs", "mixed_dtypes",
    "rank_2_inputs",
)


def random_row(rng, unit, bound):
  """cu_seqlens, cu_seqlens_padded [SLOTS+1] of one row of T tokens:
  padded lengths multiples of ``unit`` up to ``bound``, valid lengths up to
  them, empty slots at the end."""
  plens = []
  while sum(plens) < T and len(plens) < SLOTS:
    most = min(bound, T - sum(plens)) // unit
    plens.append(unit * int(rng.integers(1, most + 1)))
  plens[-1] += T - sum(plens)
  if plens[-1] > bound:   # keep the bound: split the remainder
    return random_row(rng, unit, bound)
  lens = [int(rng.integers(0, p + 1)) if rng.random() < 0.5 else p
          for p in plens]
  pad = SLOTS - len(plens)
  cuP = np.cumsum([0] + plens + [0] * pad)
  cu = np.cumsum([0] + lens + [0] * pad)
  return cu.astype(np.int32), cuP.astype(np.int32)


def make_sample(rng, family):
  cp, strategy, batch, hq, hkv, bound = family
  unit = 2 * cp if strategy is DCS and cp > 1 else 1
  rows = [random_row(rng, unit, bound or T) for _ in range(batch or 1)]
  cu, cuP = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
  if batch is None:
    cu, cuP = cu[0], cuP[0]
  lead = () if batch is None else (batch,)
  return dict(cp=cp, strategy=strategy, max_seqlen=bound, cu=cu, cuP=cuP,
              seq=0 if batch is None else 1,
              q=(lead + (T, hq, D), np.float32),
              k=(lead + (T, hkv, D), np.float32),
              v=(lead + (T, hkv, D), np.float32))


def _row(x):
  """A view of the last row of the (possibly batched) metadata."""
  return x if x.ndim == 1 else x[-1]


def mutate(rng, s, name):
  """Applies mutation ``name`` to sample ``s`` in place; False when it does
  not apply to this sample (then the sample is used unchanged)."""
  cu, cuP = s["cu"], s["cuP"]
  r, rp = _row(cu), _row(cuP)
  lens, plens = np.diff(r), np.diff(rp)
  docs = np.nonzero(plens)[0]
  b = int(rng.choice(docs))
  shape = lambda key: s[key][0]
  retype = lambda key, dtype: s.__setitem__(key, (s[key][0], dtype))
  reshape = lambda key, new: s.__setitem__(key, (new, s[key][1]))
  if name == "shorter_document":     # one token of padding more
    if lens[b] == 0:
      return False
    r[b + 1:] -= 1
  elif name == "empty_document":
    r[b + 1:] -= lens[b]
  elif name == "negative_length":
    r[b + 1] = r[b] - 1 - int(rng.integers(0, 3))
  elif name == "unsorted_padded":
    if len(docs) < 2:
      return False
    rp[b + 1] = rp[-1] + 1 if b + 1 < len(rp) - 1 else rp[b] - 1
  elif name == "length_above_padded":
    r[b + 1:] += plens[b] - lens[b] + 1
  elif name == "wrong_last_padded":
    rp[-1] += int(rng.choice([-1, 1])) * (2 * s["cp"])
  elif name == "first_not_zero":
    (r if rng.random() < 0.5 else rp)[0] = 1
  elif name == "dcs_indivisible":
    if len(docs) < 2 or rp[docs[0] + 1] == rp[-1]:
      return False
    # One token moves from the first document to the second: still valid
    # for NO_LOAD_BALANCE and cp=1, which take any length.
    rp[docs[0] + 1] -= 1
    lens[docs[0]] = min(lens[docs[0]], plens[docs[0]] - 1)
    r[1:] = np.cumsum(lens)
  elif name == "bound_below_longest":
    longest = int(np.diff(cuP, axis=-1).max())
    if longest < 2:
      return False
    s["max_seqlen"] = int(rng.integers(1, longest))
  elif name == "bound_zero":
    s["max_seqlen"] = 0
  elif name == "extra_entry":
    s["cu"] = np.concatenate([cu, cu[..., -1:]], axis=-1)
  elif name == "wrong_rank":
    s["cu"], s["cuP"] = (cu[None], cuP[None]) if cu.ndim == 1 else (
        cu[0], cuP[0])
  elif name == "float_metadata":
    s["cu"] = cu.astype(np.float32)
  elif name == "batch_mismatch":
    if cu.ndim == 1:
      return False
    s["cu"], s["cuP"] = (np.concatenate([cu, cu]), np.concatenate([cuP,
                                                                   cuP]))
  elif name == "heads_not_multiple":
    hkv = shape("k")[-2]
    reshape("k", shape("k")[:-2] + (hkv + 1, D))
    reshape("v", shape("v")[:-2] + (hkv + 1, D))
    if shape("q")[-2] % (hkv + 1) == 0:
      return False
  elif name == "head_dims_differ":
    reshape("k", shape("k")[:-1] + (D // 2,))
    reshape("v", shape("v")[:-1] + (D // 2,))
  elif name == "k_v_differ":
    reshape("v", shape("v")[:-2] + (shape("q")[-2], D))
    if shape("v") == shape("k"):
      return False
  elif name == "tokens_differ":
    half = lambda sh: sh[:-3] + (T // 2,) + sh[-2:]
    reshape("k", half(shape("k")))
    reshape("v", half(shape("v")))
  elif name == "tokens_not_divisible":
    if s["cp"] == 1:
      return False
    t = T - 2 * s["cp"] + 1
    for key in ("q", "k", "v"):
      reshape(key, shape(key)[:-3] + (t,) + shape(key)[-2:])
    for row_p, row in zip(np.atleast_2d(cuP), np.atleast_2d(cu)):
      row_p[-1] = t
      np.minimum(row_p, t, out=row_p)
      np.minimum(row, row_p, out=row)
  elif name == "int_inputs":
    for key in ("q", "k", "v"):
      retype(key, np.int32)
  elif name == "mixed_dtypes":
    retype(rng.choice(["k", "v"]), jnp.bfloat16)
  elif name == "rank_2_inputs":
    reshape("q", shape("q")[:-2] + (shape("q")[-2] * D,))
  return True


def api(q, k, v, cu, cuP, *, cp, strategy, max_seqlen, seq):
  """The user's path: reorder, CP attention, restore (physical order);
  ``seq`` is the token axis of the user's layout."""
  mesh = jax.make_mesh((cp,), ("cp",), devices=devices(cp),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, strategy=strategy, backend="xla",
                    max_seqlen=max_seqlen)
  re = lambda x: reorder_for_cp(x, cuP, layout, seq_dim=seq)
  out = jax_cp.cp_attention(re(q), re(k), re(v), (cu, cuP), layout=layout)
  return restore_from_cp(out, cuP, layout, seq_dim=seq)


@functools.cache
def compiled(cp, strategy, max_seqlen, seq):
  """One jitted program per family (retraced per input shape by jit)."""
  return jax.jit(functools.partial(api, cp=cp, strategy=strategy,
                                   max_seqlen=max_seqlen, seq=seq))


def reference64(q, k, v, cu, cuP):
  """Masked softmax attention in float64 (numpy), rows that see nothing 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  if q.ndim == 3:
    return reference64(q[None], k[None], v[None], cu[None], cuP[None])[0]
  out = np.zeros_like(q)
  rep = q.shape[-2] // k.shape[-2]
  for i in range(q.shape[0]):
    mask = ref.doc_mask(cu[i], cuP[i])
    kk, vv = np.repeat(k[i], rep, axis=1), np.repeat(v[i], rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q[i], kk) / np.sqrt(q.shape[-1])
    s = np.where(mask[None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    den = p.sum(-1, keepdims=True)
    p = p / np.where(den > 0, den, 1)
    out[i] = np.einsum("hqk,khd->qhd", p, vv)
  return out


def run_sample(rng, s):
  """'raised' or 'computed'; fails on anything else or a wrong result."""
  kw = {key: s[key] for key in ("cp", "strategy", "max_seqlen", "seq")}
  cu, cuP = s["cu"], s["cuP"]
  specs = [jax.ShapeDtypeStruct(*s[key]) for key in ("q", "k", "v")]
  try:
    # Concrete metadata, abstract tensors: every check runs, no kernel.
    jax.eval_shape(lambda q, k, v: api(q, k, v, cu, cuP, **kw), *specs)
  except (ValueError, TypeError):
    return "raised"
  q, k, v = (jnp.asarray(rng.standard_normal(sp.shape), sp.dtype)
             for sp in specs)
  out = compiled(**kw)(q, k, v, jnp.asarray(cu), jnp.asarray(cuP))
  want = reference64(q, k, v, np.atleast_2d(cu) if q.ndim == 4 else cu,
                     np.atleast_2d(cuP) if q.ndim == 4 else cuP)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5,
                             rtol=2e-5)
  return "computed"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "-".join(
    str(getattr(x, "value", x)) for x in f))
def test_every_call_raises_or_matches_the_reference(family):
  rng = np.random.default_rng(FAMILIES.index(family))
  outcomes = {}
  for i in range(SAMPLES_PER_FAMILY):
    s = make_sample(rng, family)
    name = MUTATIONS[i] if i < 2 else str(rng.choice(MUTATIONS))
    if not mutate(rng, s, name):
      name = "none (" + name + " n/a)"
    try:
      outcome = run_sample(rng, s)
    except AssertionError as e:
      raise AssertionError(f"mutation {name!r} of {s}: {e}") from e
    outcomes[name] = outcomes.get(name, set()) | {outcome}
  assert "computed" in outcomes["none"]
  assert any("raised" in o for o in outcomes.values()), outcomes


# ----------------------------------------------------- fused_attention

TQ, TKV, NSEG = 24, 20, 4
FUSED_MASKS = ("causal_bottom_right", "causal_top_left", "no_mask")
FUSED_MUTATIONS = (
    "none", "none", "none", "shorter_segment",
    "negative_length", "negative_offset", "past_the_end", "q_overlap",
    "above_bound", "bound_zero", "segment_count_differs", "float_metadata",
    "wrong_rank", "int_inputs", "mixed_dtypes", "heads_not_multiple",
)


def random_segments(rng, tokens, gaps: bool):
  """Offsets and lengths [NSEG] of disjoint segments in ``tokens`` rows
  (empty ones allowed)."""
  cuts = np.sort(rng.choice(np.arange(tokens + 1), 2 * NSEG))
  offs, ends = cuts[0::2], cuts[1::2]
  if not gaps:
    ends = np.append(offs[1:], tokens)
  return offs.astype(np.int32), (ends - offs).astype(np.int32)


def fused_reference64(q, k, v, q_lens, kv_lens, q_offs, kv_offs, mask):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros_like(q)
  rep = q.shape[-2] // k.shape[-2]
  for ql, kl, qo, ko in zip(q_lens, kv_lens, q_offs, kv_offs):
    qs, ks = q[qo:qo + ql], np.repeat(k[ko:ko + kl], rep, axis=1)
    vs = np.repeat(v[ko:ko + kl], rep, axis=1)
    j, c = np.arange(ql)[:, None], np.arange(kl)[None]
    see = {"no_mask": np.ones((ql, kl), bool), "causal_top_left": c <= j,
           "causal_bottom_right": c <= j + kl - ql}[mask]
    s = np.einsum("qhd,khd->hqk", qs, ks) / np.sqrt(q.shape[-1])
    s = np.where(see[None], s, -np.inf)
    m = s.max(-1, keepdims=True) if kl else np.zeros(s.shape[:2] + (1,))
    p = np.where(see[None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    out[qo:qo + ql] = np.einsum("hqk,khd->qhd", p, vs)
  return out


def mutate_fused(rng, s, name):
  meta = s["meta"]
  i = int(rng.integers(0, NSEG))
  live = np.nonzero(meta["q_seqlens"] > 0)[0]
  if name == "shorter_segment":
    if not live.size:
      return False
    i = int(rng.choice(live))
    meta["q_seqlens"][i] -= 1
    meta["kv_seqlens"][i] = max(meta["kv_seqlens"][i] - 1, 0)
  elif name == "negative_length":
    meta[rng.choice(["q_seqlens", "kv_seqlens"])][i] = -1 - int(
        rng.integers(0, 5))
  elif name == "negative_offset":
    meta[rng.choice(["q_offsets", "kv_offsets"])][i] = -int(
        rng.integers(1, 5))
  elif name == "past_the_end":
    side = rng.choice(["q", "kv"])
    meta[f"{side}_seqlens"][i] = max(meta[f"{side}_seqlens"][i], 1)
    meta[f"{side}_offsets"][i] = (TQ if side == "q" else TKV) - int(
        rng.integers(0, meta[f"{side}_seqlens"][i]))
  elif name == "q_overlap":
    if live.size < 2:
      return False
    a, b = sorted(rng.choice(live, 2, replace=False))
    meta["q_offsets"][b] = meta["q_offsets"][a] + meta["q_seqlens"][a] - 1
    meta["q_seqlens"][b] = 1
  elif name == "above_bound":
    longest = int(meta["q_seqlens"].max())
    if longest < 2:
      return False
    s["max_q"] = longest - 1
  elif name == "bound_zero":
    s["max_kv"] = 0
  elif name == "segment_count_differs":
    meta["kv_offsets"] = meta["kv_offsets"][:-1]
  elif name == "float_metadata":
    meta["q_offsets"] = meta["q_offsets"].astype(np.float32)
  elif name == "wrong_rank":
    meta["q_seqlens"] = meta["q_seqlens"][None]
  elif name == "int_inputs":
    s["dtypes"] = (np.int32,) * 3
  elif name == "mixed_dtypes":
    s["dtypes"] = (np.float32, np.float32, jnp.float16)
  elif name == "heads_not_multiple":
    s["hkv"] = 3
  return True


@functools.cache
def fused_compiled(mask, max_q, max_kv):
  return jax.jit(functools.partial(
      jax_cp.fused_attention, attn_mask_type=mask, backend="xla",
      max_seqlen_q=max_q, max_seqlen_kv=max_kv))


def test_fused_attention_raises_or_matches_the_reference():
  """The same property for ``fused_attention`` (no CP): random disjoint Q
  segments, any KV segments, three masks; mutated segment metadata (values
  below 0, past the end, overlapping Q rows, above the bound), shapes and
  dtypes."""
  rng = np.random.default_rng(1234)
  outcomes = {}
  for i in range(60):
    mask = FUSED_MASKS[i % 3]
    q_offs, q_lens = random_segments(rng, TQ, gaps=bool(rng.random() < 0.5))
    kv_offs, kv_lens = random_segments(rng, TKV, gaps=True)
    if mask == "causal_bottom_right":   # every Q row sees a key
      kv_lens = np.where(q_lens > 0, np.maximum(kv_lens, 1), kv_lens)
      kv_offs = np.minimum(kv_offs, TKV - kv_lens)
    s = dict(meta=dict(q_seqlens=q_lens, kv_seqlens=kv_lens,
                       q_offsets=q_offs, kv_offsets=kv_offs),
             max_q=None if rng.random() < 0.5 else max(int(q_lens.max()), 1),
             max_kv=None, dtypes=(np.float32,) * 3, hkv=2)
    name = FUSED_MUTATIONS[i] if i < 3 else str(rng.choice(FUSED_MUTATIONS))
    if not mutate_fused(rng, s, name):
      name = "none (" + name + " n/a)"
    specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(
        ((TQ, 4, D), (TKV, s["hkv"], D), (TKV, s["hkv"], D)), s["dtypes"])]
    meta = s["meta"]
    kw = dict(attn_mask_type=mask, backend="xla", max_seqlen_q=s["max_q"],
              max_seqlen_kv=s["max_kv"])
    try:
      jax.eval_shape(lambda q, k, v, meta=meta, kw=kw: jax_cp.fused_attention(
          q, k, v, meta["q_seqlens"], meta["kv_seqlens"], meta["q_offsets"],
          meta["kv_offsets"], **kw), *specs)
      outcome = "computed"
    except (ValueError, TypeError):
      outcome = "raised"
    if outcome == "computed":
      q, k, v = (jnp.asarray(rng.standard_normal(sp.shape), sp.dtype)
                 for sp in specs)
      out = fused_compiled(mask, s["max_q"], s["max_kv"])(
          q, k, v, *(jnp.asarray(meta[n]) for n in (
              "q_seqlens", "kv_seqlens", "q_offsets", "kv_offsets")))
      want = fused_reference64(q, k, v, meta["q_seqlens"],
                               meta["kv_seqlens"], meta["q_offsets"],
                               meta["kv_offsets"], mask)
      np.testing.assert_allclose(np.asarray(out, np.float64), want,
                                 atol=2e-5, rtol=2e-5,
                                 err_msg=f"{name}, {mask}, {s}")
    outcomes[name] = outcomes.get(name, set()) | {outcome}
  assert "computed" in outcomes["none"], outcomes
  for name in FUSED_MUTATIONS[4:]:
    assert outcomes.get(name, {"raised"}) == {"raised"}, (name, outcomes)
