"""The example model's gradient step, run twice: the harness of the
deterministic-mode tests (tests/test_deterministic.py on CPU,
tests/gpu/test_deterministic_cudnn.py on a GPU).

:func:`step_twice` builds the example's model (examples/packed_lm) on a
``(data, cp)`` mesh with the layout's ``deterministic`` and exchange
chosen, jits the loss and its gradients with respect to every parameter
(the training step's ``nnx.value_and_grad(loss_fn)``), runs that one
compiled program twice on the same state and batch, and returns both
results as host arrays. Run as a script (``python -m
tests.determinism_step ...``) it prints one JSON line with the largest
differences between the two runs, for the GPU test to read from a
process started with XLA's determinism flag.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np
from flax import nnx

import jax_cp
from examples.packed_lm import config, data, main, model, train
from jax_cp.cp.exchange import choose_exchange

#: (strategy, comm_type, bounded): the exchanges the tests cover; bounded
#: layouts take the batch's ``max_seqlen`` (NO_LOAD_BALANCE: the halo, or
#: the ring's fewer steps), the others none (the all-gather, the whole
#: ring).
EXCHANGES = {
    "dcs_all_gather": ("dual_chunk_swap", "all_gather", False),
    "dcs_ring": ("dual_chunk_swap", "ring", False),
    "nlb_all_gather": ("no_load_balance", "all_gather", False),
    "nlb_halo": ("no_load_balance", "all_gather", True),
    "nlb_ring": ("no_load_balance", "ring", True),
}
#: The exchange each entry of :data:`EXCHANGES` chooses.
EXPECTED_KIND = {"dcs_all_gather": "all_gather", "dcs_ring": "ring",
                 "nlb_all_gather": "all_gather", "nlb_halo": "halo",
                 "nlb_ring": "ring"}


def make_config(exchange: str, **overrides) -> config.Config:
  """The example's config for one entry of :data:`EXCHANGES`."""
  strategy, comm_type, _ = EXCHANGES[exchange]
  return config.Config(**dict(dict(strategy=strategy, comm_type=comm_type,
                                   seed=1), **overrides))


def exchange_kind(cfg: config.Config, cp: int, bound: int | None) -> str:
  """The exchange ``cfg``'s layout chooses at ``cp`` with ``bound``."""
  return choose_exchange(cfg.strategy == "no_load_balance", "cp", cp,
                         cfg.seq_len, bound, comm_type=cfg.comm_type).kind


def documents(exchange: str, dp: int, cp: int, **overrides) -> int:
  """The documents of the batch :func:`step_twice` runs on (host only)."""
  rows = data.load_rows(make_config(exchange, **overrides), dp, cp)
  cu = np.asarray(rows.cu_seqlens)
  return int(np.sum(np.diff(cu, axis=-1) > 0))


def build_step(exchange: str, deterministic: bool | None, *, dp: int,
               cp: int, platform: str, **overrides):
  """``(grads, state, batch, mesh, kind)``: the jitted ``(state, batch) ->
  (loss, [gradient per parameter])`` of the example's model with the
  layout's ``deterministic``, its arguments, the mesh they live on and
  the exchange the layout chose (arguments as for :func:`step_twice`)."""
  cfg = make_config(exchange, **overrides)
  mesh = main.make_mesh(dp, cp, platform)
  rows = data.load_rows(cfg, dp, cp)
  bound = rows.max_seqlen if EXCHANGES[exchange][2] else None
  layout = model.make_layout(cfg, mesh, bound).replace(
      deterministic=deterministic)
  batch = data.place_batch(rows, layout,
                           jax_cp.data.process_batch_rows(layout, dp))
  with jax.set_mesh(mesh):
    graphdef, state, _ = train.init_state(cfg, layout,
                                          train.make_optimizer(cfg), mesh)

  @jax.jit
  def grads(state, batch):
    net, _ = nnx.merge(graphdef, state)
    loss, g = nnx.value_and_grad(train.loss_fn)(net, batch)
    return loss, jax.tree.leaves(g)

  return grads, state, batch, mesh, exchange_kind(cfg, cp, bound)


def step_twice(exchange: str, deterministic: bool | None, *, dp: int,
               cp: int, platform: str, **overrides):
  """``(first, second, kind)``: ``{"loss": float32 scalar, "grads": [one
  array per parameter]}`` of two runs of the jitted gradient step, and
  the exchange the layout chose.

  Args:
    exchange: a key of :data:`EXCHANGES`.
    deterministic: the layout's ``deterministic``.
    dp, cp: the mesh (``dp * cp`` devices of ``platform``).
    platform: ``"cpu"`` or ``"gpu"``.
    **overrides: fields of the example's ``Config`` (sizes, backend,
      dtype).
  """
  grads, state, batch, mesh, kind = build_step(
      exchange, deterministic, dp=dp, cp=cp, platform=platform, **overrides)
  runs = []
  with jax.set_mesh(mesh):
    for _ in range(2):
      loss, g = grads(state, batch)
      runs.append(dict(loss=np.asarray(loss),
                       grads=[np.asarray(x) for x in g]))
  return runs[0], runs[1], kind


def differences(a, b) -> dict:
  """The largest absolute differences between two runs: of the loss, and
  over every gradient element; and whether they are bitwise equal."""
  grad_diff = max(float(np.max(np.abs(x.astype(np.float64)
                                      - y.astype(np.float64))))
                  for x, y in zip(a["grads"], b["grads"]))
  bitwise = a["loss"].tobytes() == b["loss"].tobytes() and all(
      x.tobytes() == y.tobytes() for x, y in zip(a["grads"], b["grads"]))
  return dict(loss_diff=float(abs(np.float64(a["loss"])
                                  - np.float64(b["loss"]))),
              grad_max_diff=grad_diff, bitwise_equal=bitwise)


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exchange", choices=sorted(EXCHANGES), required=True)
  p.add_argument("--deterministic", choices=["none", "true", "false"],
                 default="none")
  p.add_argument("--dp", type=int, default=1)
  p.add_argument("--cp", type=int, default=1)
  p.add_argument("--platform", default="gpu")
  p.add_argument("--overrides", default="{}",
                 help="JSON object of Config fields")
  return p.parse_args(argv)


def run(argv=None) -> dict:
  """The script: one JSON line with :func:`differences` of two runs, the
  exchange chosen and whether XLA's determinism flag was seen."""
  args = _parse(argv)
  det = {"none": None, "true": True, "false": False}[args.deterministic]
  a, b, kind = step_twice(args.exchange, det, dp=args.dp, cp=args.cp,
                          platform=args.platform,
                          **json.loads(args.overrides))
  result = dict(differences(a, b), exchange=kind,
                xla_flag=jax_cp.attention.xla_requests_determinism(),
                loss=float(a["loss"]),
                documents=documents(args.exchange, args.dp, args.cp,
                                    **json.loads(args.overrides)))
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  run(sys.argv[1:])
