"""Parameters between the Linen modules of :mod:`jax_cp.flax` and the NNX
modules of :mod:`jax_cp.nnx`.

Both name their parameters alike (``attention/query/kernel``,
``mlp/up/kernel``, ``pre_attention_norm/scale``, ...) with the same shapes,
so converting is a check of paths and shapes and a copy of the arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx, traverse_util


def _flat(tree: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(dict(tree))


def linen_params(model: nnx.Module) -> dict[str, Any]:
  """The parameters of an NNX ``model`` as Linen variables,
  ``{"params": {...}}``, for ``linen_module.apply``. The arrays are shared,
  not copied.

  See docs/concepts.md.
  """
  state = nnx.state(model, nnx.Param)
  return {"params": nnx.to_pure_dict(state)}


def load_linen_params(model: nnx.Module, variables: Mapping[str, Any]
                      ) -> nnx.Module:
  """Copies Linen parameters into an NNX ``model`` in place (and returns
  it).

  See docs/concepts.md.

  Args:
    model: an NNX module of :mod:`jax_cp.nnx` built with the configuration
      of the Linen module the parameters come from.
    variables: Linen variables ``{"params": {...}}`` (or the ``params``
      dict itself).

  Raises:
    ValueError: a parameter path is missing on either side, or a shape or
      dtype differs.
  """
  params = variables.get("params", variables)
  state = nnx.state(model, nnx.Param)
  want = _flat(nnx.to_pure_dict(state))
  got = _flat(params)
  missing = sorted("/".join(p) for p in set(want) - set(got))
  extra = sorted("/".join(p) for p in set(got) - set(want))
  if missing or extra:
    raise ValueError(
        f"the Linen parameters do not fit the NNX model: missing {missing}, "
        f"unexpected {extra} (build both modules with the same "
        "configuration)")
  for path, w in sorted(want.items()):
    g = got[path]
    if tuple(np.shape(g)) != tuple(w.shape) or jax.numpy.result_type(
        g) != w.dtype:
      raise ValueError(
          f"parameter {'/'.join(path)}: Linen has {np.shape(g)} "
          f"{jax.numpy.result_type(g)}, the NNX model {w.shape} {w.dtype}")
  nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(
      {p: got[p] for p in want}))
  nnx.update(model, state)
  return model
