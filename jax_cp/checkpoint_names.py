"""The names of the values a layer's backward reads, under MaxText's names:
the modules and the CP attention tag their activations with
:func:`jax.ad_checkpoint.checkpoint_name`, so that any ``jax.checkpoint``
policy (``save_only_these_names``, ...) keeps or drops each of them
(docs/long_rows.md, Rematerialization).

* ``decoder_layer_input``: the input of a ``TransformerLayer``;
* ``query_proj``, ``key_proj``, ``value_proj``: the projections, after
  rotary embedding;
* ``context``: what the attention's backward reads besides q, k, v: its
  output and log-sum-exp, and the exchanged K/V it keeps (a received halo,
  or all-gathered K/V no larger than the local queries), tagged inside the
  ``custom_vjp`` forward rule (:mod:`jax_cp.cp.vjp`);
* ``out_proj``: the attention's output projection;
* ``mlpwi`` (``mlpwi_0``: the activated gate, ``mlpwi_1``: the linear
  half, when gated) and ``mlpwo``: the MLP's dots.
"""

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ, KEY_PROJ, VALUE_PROJ = "query_proj", "key_proj", "value_proj"
CONTEXT = "context"
OUT_PROJ = "out_proj"
MLPWI, MLPWI_0, MLPWI_1 = "mlpwi", "mlpwi_0", "mlpwi_1"
MLPWO = "mlpwo"

#: Every name the modules and the attention tag.
CHECKPOINT_NAMES = (DECODER_LAYER_INPUT, QUERY_PROJ, KEY_PROJ, VALUE_PROJ,
                    CONTEXT, OUT_PROJ, MLPWI, MLPWI_0, MLPWI_1, MLPWO)
