"""The attention masks as an enum, with the integer codes the cuDNN
extension's custom calls take.

:class:`AttentionMask` is a ``str`` enum: each member equals its name
(``AttentionMask.causal_top_left == "causal_top_left"``), so it goes
wherever a mask string goes (:data:`~jax_cp.attention.validation.MASK_TYPES`
holds the same names). :attr:`AttentionMask.code` is the value of the SDPA
custom calls' ``mask`` attribute, the C++ enum ``jax_cp::SdpaMask``
(csrc/ffi_targets.h), which the extension exports as ``MASK_CODES``;
tests/test_cuda_contract.py checks that the two agree.
"""

from __future__ import annotations

import enum


class AttentionMask(enum.StrEnum):
  """The mask of a varlen call (docs/internals.md, Backend contract)."""

  #: Every Q row sees every KV row of its segment.
  no_mask = "no_mask"
  #: Q row ``j`` sees KV rows ``<= j``.
  causal_top_left = "causal_top_left"
  #: The last Q row of a segment sees its last KV row.
  causal_bottom_right = "causal_bottom_right"

  @property
  def code(self) -> int:
    """The custom calls' ``mask`` attribute: ``jax_cp::SdpaMask``'s value
    (an int64)."""
    return _CODES[self]


_CODES = {
    AttentionMask.no_mask: 0,
    AttentionMask.causal_top_left: 1,
    AttentionMask.causal_bottom_right: 2,
}
