"""jax_cp.modules: one runtime under the Linen and NNX modules. The two
packages export the same modules (NNX also the parameter converters) and
agree on attributes; `import jax_cp` imports no Flax and jax_cp.nnx
nothing from jax_cp.flax; both record the strategy they ran as
`cp_strategy_code`."""

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp import flax as cp_linen
from jax_cp import nnx as cp_nnx
from jax_cp.modules import settings
from jax_cp.nnx import convert
from tests._devices import devices

ROOT = pathlib.Path(__file__).parents[1]
T = 64
CU_P = np.array([[0, 16, 48, 64]], np.int32)
CU = np.array([[0, 13, 40, 50]], np.int32)


def test_linen_and_nnx_export_the_same_modules():
  converters = ["linen_params", "load_linen_params"]
  assert sorted(cp_nnx.__all__) == sorted([*cp_linen.__all__, *converters])
  for name in cp_linen.__all__:
    assert getattr(cp_linen, name) is not None, name
    assert getattr(cp_nnx, name) is not None, name
  for name in converters:
    assert getattr(cp_nnx, name) is getattr(convert, name), name
  with pytest.raises(AttributeError, match="no attribute 'kv_heads'"):
    cp_linen.kv_heads  # noqa: B018


def _imports(code: str) -> list[str]:
  """The modules of interest that ``code`` leaves imported, in a fresh
  interpreter started in the repository root."""
  probe = ("import sys\n" + code + "\nprint(sorted(m for m in sys.modules "
           "if m in ('flax', 'flax.linen') or m.startswith('jax_cp.flax')))")
  out = subprocess.run([sys.executable, "-c", probe], check=True,
                       capture_output=True, text=True,
                       cwd=ROOT)
  return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_import_jax_cp_imports_no_flax():
  assert _imports("import jax_cp") == []
  assert _imports("import jax_cp.nnx") == ["flax", "flax.linen"]


@pytest.mark.parametrize("kwargs, want", [
    ({}, 4), (dict(num_kv_heads=2), 2), (dict(num_kv_heads=1), 1)])
def test_num_kv_heads_is_resolved_alike(kwargs, want):
  linen = cp_linen.MultiHeadAttention(num_heads=4, **kwargs)
  nnx_mha = cp_nnx.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0), **kwargs)
  assert linen.num_kv_heads == nnx_mha.num_kv_heads == want
  # A clone (how Linen rebuilds modules) keeps the resolved count valid.
  assert linen.clone().num_kv_heads == want


def _qkv():
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.standard_normal((1, T, h, 8)), jnp.float32)
          for h in (2, 1, 1)]


@pytest.mark.parametrize("strategy", list(S))
def test_both_record_the_strategy_code(strategy):
  mesh = jax.make_mesh((4,), ("cp",), devices=devices(4, "cpu"))
  layout = CPLayout(mesh=mesh, strategy=strategy, backend="xla")
  q, k, v = _qkv()
  linen = cp_linen.DotProductAttention(layout=layout)
  with jax.set_mesh(mesh):
    _, state = jax.jit(lambda q, k, v: linen.apply(
        {}, q, k, v, CU, CU_P, mutable=["intermediates"]))(q, k, v)
    dpa = cp_nnx.DotProductAttention(layout=layout)
    run = nnx.capture(lambda m, q, k, v: m(q, k, v, CU, CU_P),
                      nnx.Intermediate)
    _, inter = nnx.jit(run)(dpa, q, k, v)
  want = settings.STRATEGY_CODES[strategy]
  assert [int(c) for c in jax.tree.leaves(state)] == [want]
  assert [int(c) for c in jax.tree.leaves(inter)] == [want]
  assert settings.strategy_from_code(jax.tree.leaves(inter)[0]) is strategy
  # Outside nnx.capture nothing is recorded: the state stays empty.
  with jax.set_mesh(mesh):
    dpa(q, k, v, CU, CU_P)
  assert jax.tree.leaves(nnx.state(dpa)) == []
