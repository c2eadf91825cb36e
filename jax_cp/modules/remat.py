"""Rematerialization of the modules: the names of the values a layer's
backward reads, and the presets of the modules' ``remat`` field.

The layers tag their activations with :func:`jax.ad_checkpoint.
checkpoint_name`, under MaxText's names, so that any ``jax.checkpoint``
policy (``save_only_these_names``, ``save_and_offload_only_these_names``,
...) keeps, drops or offloads each of them:

* ``decoder_layer_input``: the input of a :class:`TransformerLayer`;
* ``query_proj``, ``key_proj``, ``value_proj``: the projections, after
  rotary embedding;
* ``context``: what the attention's backward reads besides q, k, v: its
  output and log-sum-exp, and the exchanged K/V it keeps (a received halo,
  or all-gathered K/V with :attr:`jax_cp.cp_config.CPConfig.keep_gathered_kv`),
  tagged inside the ``custom_vjp`` forward rule (:mod:`jax_cp.cp_vjp`);
* ``out_proj``: the attention's output projection;
* ``mlpwi`` (``mlpwi_0``: the activated gate, ``mlpwi_1``: the linear
  half, when gated) and ``mlpwo``: the MLP's dots.

A policy that saves ``context`` keeps the backward from running the K/V
exchange and the attention forward a second time; the rest it drops is
recomputed by matmuls, norms and element-wise ops. docs/design.md,
Rematerialization, says what each preset keeps and re-runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"
CONTEXT = "context"
OUT_PROJ = "out_proj"
MLPWI, MLPWI_0, MLPWI_1 = "mlpwi", "mlpwi_0", "mlpwi_1"
MLPWO = "mlpwo"

#: Every name the modules and the attention tag.
CHECKPOINT_NAMES = (DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ,
                    CONTEXT, OUT_PROJ, MLPWI, MLPWI_0, MLPWI_1, MLPWO)

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
    "offload_context": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[DECODER_LAYER_INPUT],
        names_which_can_be_offloaded=[CONTEXT], offload_src="device",
        offload_dst="pinned_host"),
}


def remat_policy(remat: str | Callable) -> Callable | None:
  """The ``jax.checkpoint`` policy of a ``remat`` setting.

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
        exchange and the attention forward included);
      * ``"offload_context"``: ``"save_context"`` with ``context`` moved to
        pinned host memory between forward and backward (XLA's host
        offload). Measured on jax 0.11.2's GPU backend, it saves no device
        memory per layer (docs/design.md, Rematerialization): prefer
        ``"save_context"`` there.

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
