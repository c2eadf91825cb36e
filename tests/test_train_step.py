"""The example's training step: its collectives at dp=2 x cp=4 (compiled
HLO), the FSDP shardings, the mesh shape and the prefetching loop."""

import collections
import re

import jax
import numpy as np
import pytest

import jax_cp
from examples.packed_lm import config, data, main, model, train
from tests._devices import devices, requires_devices

# Sizes chosen so that no parameter shape shares a dimension with the
# token axes (T = 160 per row, T / cp = 40 per device).
LAYERS, D, HEADS, KV, HEAD_DIM, T, CP_SIZE = 2, 48, 4, 2, 12, 160, 4
MODEL = dict(layers=LAYERS, d_model=D, heads=HEADS, kv_heads=KV,
             dtype="float32", backend="xla", strategy="dual_chunk_swap",
             seq_len=T, max_doc_len=T // 2, seed=1)

_LINE = re.compile(
    r"= ((?:[^=\n]|/\*index=\d+\*/)*?) (all-gather|reduce-scatter|all-reduce|"
    r"all-to-all|collective-permute)(?:-start)?\((.*)$", re.M)
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def _collectives(hlo: str):
  """``(kind, [result dims...], op_name)`` per collective instruction."""
  out = []
  for m in _LINE.finditer(hlo):
    shapes = [tuple(int(x) for x in s.split(",") if x)
              for s in _SHAPE.findall(m.group(1))]
    op = re.search(r'op_name="([^"]*)"', m.group(3))
    out.append((m.group(2), shapes, op.group(1) if op else ""))
  return out


def _compiled_step(mode: str, dp: int = 2, cp: int = CP_SIZE):
  devices(dp * cp)
  cfg = config.Config(**MODEL, param_sharding=mode, steps=10, warmup=2)
  mesh = main.make_mesh(dp, cp, "cpu")
  rows = data.load_rows(cfg, dp, cp)
  layout = model.make_layout(cfg, mesh, rows.max_seqlen)
  local = jax_cp.data.process_batch_rows(layout, dp)
  batch = data.place_batch(rows, layout, local)
  with jax.set_mesh(mesh):
    graphdef, state, shardings = train.init_state(
        cfg, layout, train.make_optimizer(cfg), mesh)
    step = train.make_train_step(graphdef, shardings, mesh, mode)
    hlo = step.lower(state, batch).compile().as_text()
  return state, shardings, hlo


@pytest.mark.sweep(fast=1)
@pytest.mark.parametrize("mode, dp, cp", [
    ("fsdp", 2, 4), ("replicated", 2, 4), ("fsdp", 1, 2)])
def test_step_collectives_are_kv_exchange_and_parameter_traffic(mode, dp,
                                                                cp):
  """The compiled step moves only: the CP K/V exchange (all-gather of K/V,
  reduce-scatter of dK/dV, over cp, inside the attention's shard_map), the
  parameters' collectives of the sharding (FSDP: all-gathers of whole
  parameters; gradient reductions of parameter shapes) and scalars. No
  activation of the token axes is gathered, reduced, exchanged all-to-all
  or permuted outside attention. At data=1 x cp=2 XLA's partitioner would
  gather the MLP's input tokens (to shard its hidden features) if the
  layers did not pin their activations (CPLayout.shard_tokens)."""
  state, shardings, hlo = _compiled_step(mode, dp, cp)
  n = dp * cp
  params = jax.tree.leaves(state[0])
  # Dims of size 1 dropped: XLA may gather a vector as [1, n].
  dims = lambda s: tuple(sorted(d for d in s if d != 1))
  param_dims = collections.Counter(dims(x.shape) for x in params)
  is_param = lambda s: dims(s) in param_dims
  is_shard = lambda s: any(
      tuple(sorted(s)) == tuple(sorted(p[:i] + (p[i] // n,) + p[i + 1:]))
      for p in map(tuple, (x.shape for x in params)) for i in range(len(p))
      if p[i] % n == 0)
  kv_full = (1, T, 2 * KV, HEAD_DIM)      # K and V of one row, stacked
  kv_local = (1, T // cp, 2 * KV, HEAD_DIM)

  found = _collectives(hlo)
  kinds = collections.Counter(k for k, _, _ in found)
  assert set(kinds) <= {"all-gather", "reduce-scatter", "all-reduce"}, kinds
  kv_gathers = param_gathers = kv_scatters = 0
  for kind, shapes, op in found:
    token_dims = [s for s in shapes if T in s or T // cp in s]
    if kind == "all-gather":
      if "shard_map" in op:
        assert shapes[-1] == kv_full, (shapes, op)
        kv_gathers += 1
      else:
        assert all(is_param(s) for s in shapes), (shapes, op)
        param_gathers += 1
    elif kind == "reduce-scatter":
      if "shard_map" in op:
        assert shapes[-1] == kv_local, (shapes, op)
        kv_scatters += 1
      else:       # a gradient reduced to its shard (XLA:GPU forms these)
        assert all(is_shard(s) or is_param(s) or s == () for s in shapes), (
            shapes, op)
    else:          # gradients (parameter shapes) and scalars
      assert all(s == () or is_param(s) or is_shard(s) for s in shapes), (
          shapes, op)
    if "shard_map" not in op:
      assert not token_dims, (kind, shapes, op)
  # The K/V exchange of every layer, forward and backward.
  assert kv_gathers == 2 * LAYERS and kv_scatters == LAYERS, found
  matrices = sum(1 for x in params if x.ndim >= 2)
  if mode == "fsdp":
    # Every weight matrix is gathered where it is used (once per use).
    assert param_gathers >= matrices, (param_gathers, matrices)
    specs = [s.spec for s in jax.tree.leaves(shardings[0])]
    assert all(any(a == (model.DATA, model.CP) for a in s) for s in specs)
  else:
    assert param_gathers == 0, found


def test_fsdp_specs_and_optimizer_state_follow_parameters():
  devices(2 * CP_SIZE)
  mesh = main.make_mesh(2, CP_SIZE, "cpu")
  P = jax.sharding.PartitionSpec
  spec = lambda shape, mode="fsdp": train.param_spec(shape, mesh, mode)
  # The first dimension divisible by the mesh size (8): gathered shards
  # are contiguous, no transpose.
  assert spec((48, 192)) == P(("data", "cp"), None)
  assert spec((12, 4, 64)) == P(None, None, ("data", "cp"))
  assert spec((256, 48)) == P(("data", "cp"), None)
  assert spec((3, 5)) == P()       # nothing divisible by 8
  assert spec(()) == P()
  assert spec((48, 192), "replicated") == P()
  with pytest.raises(ValueError, match="mode='zero3'"):
    spec((48, 192), "zero3")
  # Adam's moments are sharded like their parameters.
  cfg = config.Config(**MODEL)
  with jax.set_mesh(mesh):
    _, _, shardings = train.init_state(
        cfg, model.make_layout(cfg, mesh), train.make_optimizer(cfg), mesh)
  params = jax.tree.leaves(shardings[0])
  moments = [s for k, s in jax.tree_util.tree_leaves_with_path(shardings[1])
             if "mu" in jax.tree_util.keystr(k)]
  assert [s.spec for s in moments] == [s.spec for s in params]


def test_mesh_shape_choice():
  choose = config.choose_mesh_shape
  assert choose(None, None, "cpu", 8) == (2, 4)
  assert choose(None, None, "gpu", 2) == (1, 2)
  assert choose(None, None, "gpu", 8) == (1, 8)
  assert choose(2, None, "gpu", 8) == (2, 4)
  assert choose(None, 4, "gpu", 8) == (2, 4)
  assert choose(1, 1, "gpu", 8) == (1, 1)
  # A chosen dp divides the batch: one row on 2 GPUs at cp=1 is dp=1.
  assert choose(None, 1, "gpu", 2, batch=1) == (1, 1)
  assert choose(None, 1, "gpu", 8, batch=4) == (4, 1)
  assert choose(None, 1, "gpu", 8, batch=6) == (2, 1)


TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--seq-len", "64", "--batch", "2", "--dp", "2", "--cp", "2",
        "--backend", "xla", "--quiet", "--no-compare", "--steps", "5"]


@pytest.mark.slow    # three training runs
@requires_devices(4)
def test_training_losses_do_not_depend_on_prefetch_or_log_interval():
  a = main.main(TINY + ["--prefetch", "0", "--log-every", "1"])
  b = main.main(TINY + ["--prefetch", "3", "--log-every", "4"])
  assert len(a["losses"]) == 5 and np.isfinite(a["losses"]).all()
  assert a["losses"] == b["losses"]
  assert a["tokens_per_s"] > 0 and b["tokens_per_s"] > 0


@requires_devices(4)
def test_replicated_parameters_train_like_fsdp():
  a = main.main(TINY + ["--param-sharding", "replicated"])
  b = main.main(TINY + ["--param-sharding", "fsdp"])
  np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-4)


def test_scanned_layers_compute_the_unrolled_model():
  """``scan_layers``: the same logits and gradients as the unrolled layers
  given the same parameters (layer i = slice i of the stacked ones), on a
  (data, cp) mesh; FSDP shards no stacked parameter over its layer axis."""
  from flax import nnx
  devices(2 * CP_SIZE)
  mesh = main.make_mesh(2, CP_SIZE, "cpu")
  cfg_scan = config.Config(**MODEL, scan_layers=True)
  cfg = config.Config(**MODEL)
  rows = data.load_rows(cfg, 2, CP_SIZE)
  layout = model.make_layout(cfg, mesh, rows.max_seqlen)
  batch = data.place_batch(rows, layout,
                           jax_cp.data.process_batch_rows(layout, 2))
  with jax.set_mesh(mesh):
    scanned = model.PackedLM(cfg_scan, layout, rngs=nnx.Rngs(3))
    unrolled = model.PackedLM(cfg, layout, rngs=nnx.Rngs(4))
    stacked = nnx.state(scanned.layers, nnx.Param)
    for i in range(LAYERS):
      nnx.update(getattr(unrolled, f"layer_{i}"),
                 jax.tree.map(lambda x, i=i: x[i], stacked))
    for name in ("embed", "final_norm", "logits"):
      nnx.update(getattr(unrolled, name),
                 nnx.state(getattr(scanned, name), nnx.Param))
    loss = lambda m: jax.numpy.mean(m(batch) ** 2)
    # Jitted: eagerly every op of the model dispatches on its own.
    step = nnx.jit(nnx.value_and_grad(loss))
    a, ga = step(scanned)
    b, gb = step(unrolled)
  np.testing.assert_allclose(a, b, rtol=1e-5)
  g_stacked = nnx.state(ga.layers, nnx.Param) if hasattr(ga, "layers") \
      else ga["layers"]
  for i in range(LAYERS):
    got = jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], g_stacked))
    want = jax.tree.leaves(gb[f"layer_{i}"])
    assert len(got) == len(want)
    for x, y in zip(got, want):
      np.testing.assert_allclose(x, y, rtol=2e-4, atol=1e-6)
  spec = train.param_spec((8, 48, 192), mesh, stacked=True)
  assert spec == jax.sharding.PartitionSpec(None, ("data", "cp"), None)
  with jax.set_mesh(mesh):
    _, _, shardings = train.init_state(
        cfg_scan, layout, train.make_optimizer(cfg_scan), mesh)
  for path, s in jax.tree_util.tree_leaves_with_path(shardings[0]):
    if "layers" in jax.tree_util.keystr(path) and s.spec:
      assert s.spec[0] is None, (jax.tree_util.keystr(path), s.spec)
