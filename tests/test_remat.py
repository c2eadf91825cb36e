"""Rematerialization of the modules (jax_cp.modules.remat): the `remat`
presets save what they name (the checkpoint tags are where the backward
reads them), and under the presets that keep `context` the gradient of a CP
TransformerLayer runs no K/V exchange and no attention forward call more
than without remat, with the same gradients (cp=4, both strategies, f32;
the cuDNN forward calls in a CUDA lowering)."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from jax_cp.checkpoint_names import CHECKPOINT_NAMES
from jax_cp.modules import remat
from tests._devices import devices
from tests._lowering import lower_for_cuda

CP, T, E = 4, 64, 16
CU_P = np.array([[0, 16, 48, 64]], np.int32)
CU = np.array([[0, 13, 40, 50]], np.int32)
LAYER = dict(num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
NO_CP = CPLayout(cp_axis=None, backend="xla")
_MINIMAL = {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0",
            "mlpwi_1"}


def _x(seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((1, T, E)), jnp.float32)


# ------------------------------------------------------------ the field


def test_remat_policy_presets_and_validation():
  assert jax_cp.remat_policy("none") is None
  for name in remat.PRESETS:
    if name != "none":
      assert callable(jax_cp.remat_policy(name)), name
  policy = jax.checkpoint_policies.dots_saveable
  assert jax_cp.remat_policy(policy) is policy
  for bad in ("save_all", 3, None):
    with pytest.raises(ValueError, match=r"remat=.* is not one of \['none', "
                       r"'save_context', 'minimal'"):
      jax_cp.remat_policy(bad)
  with pytest.raises(ValueError, match="remat='mininal'"):
    cp_linen.TransformerLayer(**LAYER, remat="mininal")
  with pytest.raises(ValueError, match="remat='mininal'"):
    cp_linen.MultiHeadAttention(num_heads=2, remat="mininal")
  with pytest.raises(ValueError, match="remat='mininal'"):
    cp_nnx.TransformerLayer(2, E, remat="mininal", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="remat='mininal'"):
    cp_nnx.MultiHeadAttention(2, E, remat="mininal", rngs=nnx.Rngs(0))


def test_offload_context_is_not_a_preset():
  presets = re.escape(str(list(remat.PRESETS)))
  with pytest.raises(ValueError, match=f"remat='offload_context' is not one "
                     f"of {presets}"):
    jax_cp.remat_policy("offload_context")
  with pytest.raises(ValueError, match=f"not one of {presets}"):
    cp_linen.TransformerLayer(**LAYER, remat="offload_context")
  with pytest.raises(ValueError, match=f"not one of {presets}"):
    cp_nnx.TransformerLayer(2, E, remat="offload_context", rngs=nnx.Rngs(0))


# ------------------------------------------------------------ what is saved


def _linen_apply(activation, preset, layout=NO_CP):
  """(apply(params, x), params) of a Linen TransformerLayer."""
  m = cp_linen.TransformerLayer(**LAYER, mlp_activation=activation,
                                layout=layout, remat=preset)
  params = jax.jit(lambda x: m.init(jax.random.key(0), x, CU, CU_P))(_x())
  return (lambda p, x: m.apply(p, x, CU, CU_P)), params


def _nnx_apply(activation, preset):
  """(apply(state, x), state) of an NNX TransformerLayer."""
  m = cp_nnx.TransformerLayer(**LAYER, in_features=E,
                              mlp_activation=activation, layout=NO_CP,
                              remat=preset, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  return (lambda s, x: nnx.merge(graphdef, s)(x, CU, CU_P)), state


def _saved(apply, params):
  """[(residual, description)] that the backward of ``apply`` reads, as
  ``jax.ad_checkpoint.print_saved_residuals`` prints them."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(apply, params, _x())
  return [line.split(" ", 1) for line in out.getvalue().splitlines()]


def _named(saved) -> set[str]:
  return {m.group(1) for _, d in saved
          if (m := re.match(r"named '(\w+)'", d))}


def _bytes(saved) -> int:
  total = 0
  for aval, _ in saved:
    dtype, shape = re.match(r"(\w+)\[([\d,]*)\]", aval).groups()
    size = int(np.prod([int(d) for d in shape.split(",") if d]))
    total += size * {"f32": 4, "i32": 4}[dtype]
  return total


@pytest.mark.parametrize("build", [_linen_apply, _nnx_apply],
                         ids=["linen", "nnx"])
def test_presets_save_what_they_name(build):
  saved = {p: _saved(*build("swiglu", p)) for p in remat.PRESETS}
  assert _named(saved["save_context"]) == {"decoder_layer_input", "context"}
  assert _named(saved["minimal"]) == _MINIMAL
  assert _named(saved["minimal_with_context"]) == _MINIMAL | {"context"}
  assert _named(saved["full"]) == set()
  kept = {p: _bytes(s) for p, s in saved.items()}
  assert (kept["full"] < kept["save_context"] < kept["minimal"]
          < kept["minimal_with_context"] < kept["none"]), kept


@pytest.mark.parametrize("activation, mlp_names", [
    ("gelu", {"mlpwi"}), ("swiglu", {"mlpwi_0", "mlpwi_1"})])
def test_every_checkpoint_name_is_tagged(activation, mlp_names):
  apply, params = _linen_apply(activation, "none")
  # The forward of a VJP: the custom_vjp forward rule runs there.
  text = str(jax.make_jaxpr(lambda p, x: jax.vjp(apply, p, x)[0])(
      params, _x()))
  names = set(re.findall(r"\bname\[name=(\w+)\]", text))
  want = set(CHECKPOINT_NAMES) - {"mlpwi", "mlpwi_0", "mlpwi_1"}
  assert names == want | mlp_names


# ------------------------------------------------------------ CP-aware


def _cp_mesh():
  return jax.make_mesh((CP,), ("cp",), devices=devices(CP, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))


def _layout(strategy, mesh, **kwargs):
  bound = 32 if strategy is S.NO_LOAD_BALANCE else None
  return CPLayout(mesh=mesh, strategy=strategy, max_seqlen=bound,
                  **kwargs)


def _counts(text: str) -> tuple[int, int]:
  """(K/V exchange collectives, attention dots) in compiled HLO: every
  all-gather and collective-permute; the xla backend's attention einsums,
  the only dots at HIGHEST precision (the projections use the default)."""
  exchange = len(re.findall(r"= \S+ (?:all-gather|collective-permute)"
                            r"(?:-start)?\(", text))
  return exchange, text.count("operand_precision={highest,highest}")


def _grad_program(strategy, preset, mesh):
  """(compiled HLO text, gradients) of a CP Linen TransformerLayer's loss
  in params and x, xla backend."""
  apply, params = _linen_apply("gelu", preset,
                               _layout(strategy, mesh, backend="xla"))
  w = _x(1)
  loss = lambda p, x: jnp.sum(apply(p, x) * w)
  with jax.set_mesh(mesh):
    x = jax.device_put(_x(), NamedSharding(mesh, P(None, "cp")))
    # The value too: its forward is then needed whatever the backward re-runs.
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = step.lower(params, x).compile().as_text()
    grads = step(params, x)
  return text, grads


def _assert_grads_equal(got, want, rtol=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(np.abs(np.asarray(w)).max())
    err = float(np.abs(np.asarray(g) - np.asarray(w)).max())
    assert err <= rtol * scale, (err, scale)


@pytest.mark.sweep(fast=1)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(S))
def test_context_presets_run_no_exchange_or_forward_twice(strategy):
  mesh = _cp_mesh()
  text, want = _grad_program(strategy, "none", mesh)
  base = _counts(text)
  assert base[0] >= 2 and base[1] >= 2, base
  for preset in ("save_context", "minimal_with_context"):
    text, grads = _grad_program(strategy, preset, mesh)
    assert _counts(text) == base, (preset, _counts(text), base)
    _assert_grads_equal(grads, want)
  # Without context the backward re-runs both: the counts see it.
  text, grads = _grad_program(strategy, "full", mesh)
  full = _counts(text)
  assert full[0] > base[0] and full[1] > base[1], (full, base)
  _assert_grads_equal(grads, want)


def _nnx_grad_program(preset, mesh):
  """(compiled HLO text, value and gradients) of a CP NNX TransformerLayer's
  loss in its state and x (DUAL_CHUNK_SWAP, xla backend)."""
  m = cp_nnx.TransformerLayer(
      **LAYER, in_features=E, remat=preset, rngs=nnx.Rngs(0),
      layout=_layout(S.DUAL_CHUNK_SWAP, mesh, backend="xla"))
  graphdef, state = nnx.split(m)
  w = _x(1)
  loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, CU, CU_P) * w)
  with jax.set_mesh(mesh):
    x = jax.device_put(_x(), NamedSharding(mesh, P(None, "cp")))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.lower(state, x).compile().as_text(), step(state, x)


@pytest.mark.slow
def test_nnx_save_context_runs_no_exchange_or_forward_twice():
  mesh = _cp_mesh()
  text, want = _nnx_grad_program("none", mesh)
  got_text, got = _nnx_grad_program("save_context", mesh)
  assert _counts(text)[0] >= 2 and _counts(text)[1] >= 2, _counts(text)
  assert _counts(got_text) == _counts(text)
  _assert_grads_equal(got, want)


def test_cudnn_context_presets_run_one_forward_call():
  """The cudnn backend, lowered for CUDA on CPU devices: the cuDNN forward
  custom calls of a CP layer's gradient (cp=2, DUAL_CHUNK_SWAP, bf16) are
  as many under the context presets as without remat, more under
  ``"full"`` (skipped without the extension)."""
  cudnn = pytest.importorskip("jax_cp.attention.cudnn.backend",
                              exc_type=ModuleNotFoundError)
  mesh = jax.make_mesh((2,), ("cp",), devices=devices(2, "cpu"),
                       axis_types=(jax.sharding.AxisType.Auto,))
  layout = CPLayout(mesh=mesh, strategy=S.DUAL_CHUNK_SWAP, backend="cudnn")
  sharded = NamedSharding(mesh, P(None, "cp"))
  x = jax.ShapeDtypeStruct((1, T, 128), jnp.bfloat16, sharding=sharded)
  fwd = (cudnn.FWD_TARGET, cudnn.FFI_TARGETS["sdpa_fwd_into"])

  def forward_calls(preset):
    m = cp_linen.TransformerLayer(num_heads=2, num_kv_heads=1, head_dim=64,
                                  mlp_dim=64, dtype=jnp.bfloat16,
                                  layout=layout, remat=preset)
    params = jax.eval_shape(m.init, jax.random.key(0), x, CU, CU_P)
    loss = lambda p, x: jnp.sum(m.apply(p, x, CU, CU_P).astype(jnp.float32))
    with jax.set_mesh(mesh):
      text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)),
                            params, x)
    names = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    return sum(names.count(n) for n in fwd)

  base = forward_calls("none")
  assert base >= 1
  assert forward_calls("save_context") == base
  assert forward_calls("minimal_with_context") == base
  assert forward_calls("full") > base
