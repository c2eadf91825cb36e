"""The planner counts what runs: the cost model's attention calls per
rank (:func:`jax_cp.planning.cost_model.plan_calls`, read from the call
plan on the host metadata) equal the backend calls that tracing
``cp_attention``'s forward makes on a rank, counted by a backend that
wraps ``xla`` and counts its ``forward`` calls. Both strategies, cp = 1,
2 and 4, with and without a sliding window and a ``max_seqlen`` bound,
on rows of one document, many short ones and documents straddling
chunks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.attention import register_backend, xla
from jax_cp.planning import estimate_cp_imbalance
from tests import reference as ref
from tests._devices import devices

T, HQ, HKV, D = 64, 4, 2, 8
COUNT = {"calls": 0}


def _counting_forward(*args, **kw):
  COUNT["calls"] += 1
  return xla.BACKEND.forward(*args, **kw)


register_backend(dataclasses.replace(xla.BACKEND, name="xla_counting",
                                     forward=_counting_forward,
                                     forward_out=None))


def traced_calls(strategy, cp, cu, cuP, window, bound, comm_type="all_gather",
                 hq=HQ, hkv=HKV):
  """Backend forward calls while tracing one rank's forward (the
  ``shard_map`` body is traced once)."""
  mesh = jax.sharding.Mesh(np.array(devices(cp)), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, strategy=strategy,
                           backend="xla_counting", max_seqlen=bound,
                           comm_type=comm_type)
  spec = lambda h: jax.ShapeDtypeStruct((T, h, D), jnp.float32)
  # A value and its gradient: the forward's plan, with its lse.
  f = lambda q, k, v: jax.vjp(lambda q: jax_cp.cp_attention(
      q, k, v, (cu, cuP), layout=layout,
      window_size=None if window is None else (window, 0)), q)[0]
  COUNT["calls"] = 0
  jax.jit(f).trace(spec(hq), spec(hkv), spec(hkv))
  return COUNT["calls"]


@pytest.mark.sweep(fast=5)
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp,window,bounded", [
    (1, None, False), (2, None, True), (2, 5, False), (4, None, False),
    (4, None, True), (4, 5, False), (4, 0, False)])
def test_planned_calls_are_the_traced_calls(cp, strategy, window, bounded):
  rng = np.random.default_rng(cp)
  for kind in ("one_long", "mixed"):
    cu, cuP = ref.random_layout(rng, T, cp, kind,
                                dual_chunk=strategy is S.DUAL_CHUNK_SWAP)
    bound = int(np.diff(cuP).max()) if bounded else None
    layout = jax_cp.CPLayout(cp_size=cp, strategy=strategy, max_seqlen=bound)
    est = estimate_cp_imbalance(
        cu, cuP, layout, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D,
        window_size=None if window is None else (window, 0))
    traced = traced_calls(strategy, cp, cu, cuP, window, bound)
    assert traced >= 1
    assert est.calls_per_rank == traced, kind


@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
@pytest.mark.parametrize("cp,window", [(2, None), (4, 5)])
def test_all_to_all_calls_are_the_traced_calls(cp, strategy, window):
  """The exchange planner charges the all-to-all the cp = 1 plan's calls
  (:func:`jax_cp.planning.recommend_exchange`): what a rank traces."""
  from jax_cp.planning.cost_model import plan_calls
  rng = np.random.default_rng(10 + cp)
  hq, hkv = 2 * cp, cp
  for kind in ("one_long", "mixed"):
    cu, cuP = ref.random_layout(rng, T, cp, kind,
                                dual_chunk=strategy is S.DUAL_CHUNK_SWAP)
    planned = plan_calls(strategy, 1, np.atleast_2d(cu), np.atleast_2d(cuP),
                         hq // cp, hkv // cp, D, None,
                         -1 if window is None else window)
    traced = traced_calls(strategy, cp, cu, cuP, window, None,
                          comm_type="all_to_all", hq=hq, hkv=hkv)
    assert planned == traced >= 1, kind
