"""Rematerialization of the modules: the presets of the modules' ``remat``
field, policies over the names of :mod:`jax_cp.checkpoint_names`
(docs/long_rows.md, Rematerialization, says what each keeps and
re-runs).

A policy that saves ``context`` keeps the backward from running the K/V
exchange and the attention forward a second time; the rest it drops is
recomputed by matmuls, norms and element-wise ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jax_cp.checkpoint_names import (
  CONTEXT,
  DECODER_LAYER_INPUT,
  KEY_PROJ,
  MLPWI,
  MLPWI_0,
  MLPWI_1,
  MLPWO,
  OUT_PROJ,
  QUERY_PROJ,
  VALUE_PROJ,
)
from jax_cp.modules.row_major import row_major

# MaxText's "minimal": every projection and MLP dot.
_MINIMAL = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ, MLPWI, MLPWI_0,
            MLPWI_1, MLPWO)

_policies = jax.checkpoint_policies
#: The presets of the ``remat`` field by name ("none": no ``jax.checkpoint``).
PRESETS: dict[str, Callable | None] = {
    "none": None,
    "save_context": _policies.save_only_these_names(DECODER_LAYER_INPUT,
                                                    CONTEXT),
    "minimal": _policies.save_only_these_names(*_MINIMAL),
    "minimal_with_context": _policies.save_only_these_names(*_MINIMAL,
                                                            CONTEXT),
    "full": _policies.nothing_saveable,
}


def remat_policy(remat: str | Callable) -> Callable | None:
  """The ``jax.checkpoint`` policy of a ``remat`` setting.

  See docs/long_rows.md.

  Args:
    remat: a preset name or a ``jax.checkpoint`` policy (returned as is):

      * ``"none"``: no rematerialization (returns ``None``);
      * ``"save_context"``: keep ``context`` and the layer input; recompute
        projections, rotary, norms and the MLP;
      * ``"minimal"``: keep every projection and MLP dot (MaxText's
        ``minimal``); the backward re-runs the K/V exchange and the
        attention forward;
      * ``"minimal_with_context"``: ``"minimal"`` plus ``context``;
      * ``"full"``: keep only the layer input (everything re-runs, the
        exchange and the attention forward included).

  Returns:
    The policy, or ``None`` for ``"none"``.

  Raises:
    ValueError: ``remat`` is neither a preset name nor callable.
  """
  if isinstance(remat, str) and remat in PRESETS:
    return PRESETS[remat]
  if callable(remat) and not isinstance(remat, str):
    return remat
  raise ValueError(f"remat={remat!r} is not one of {list(PRESETS)} or a "
                   "jax.checkpoint policy (a callable)")


def layer_input(x):
  """``x``, a layer's input, tagged :data:`~jax_cp.checkpoint_names.
  DECODER_LAYER_INPUT` (what every preset keeps), then held in row-major
  layout on GPU (:func:`jax_cp.modules.row_major.row_major`: the
  backward of a scan over layers re-runs this, so it keeps the saved
  stack of inputs from being transposed whole)."""
  return row_major(checkpoint_name(x, DECODER_LAYER_INPUT))


def add_cotangents(a, b):
  """``a + b``, or ``a`` for the float0 cotangents of integer values: the
  parameter cotangents a chunk loop's backward sums over its chunks."""
  return a if a.dtype == jax.dtypes.float0 else a + b


def call(transform: Callable, remat: Any, body: Callable, *args):
  """``body(*args)``, under ``transform(body, policy=...)`` (``nn.remat`` or
  ``nnx.remat``) unless ``remat`` is ``"none"``."""
  policy = remat_policy(remat)
  if policy is None:
    return body(*args)
  return transform(body, policy=policy)(*args)
