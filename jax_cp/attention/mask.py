"""The attention masks as an enum, with what each means (:attr:`causal`,
:attr:`bottom_right`, :meth:`diagonal_offset`: code asks the mask, never
compares its name) and the integer codes the cuDNN extension's custom
calls take.

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
  def causal(self) -> bool:
    """Whether a Q row sees only the keys up to its diagonal (and a
    sliding window applies)."""
    return self is not AttentionMask.no_mask

  @property
  def bottom_right(self) -> bool:
    """Whether the diagonal is aligned at the segment's end: the last Q
    row meets the last KV row."""
    return self is AttentionMask.causal_bottom_right

  def diagonal_offset(self, q_lens, kv_lens):
    """The KV row of Q row 0's diagonal, per segment (Q row ``j``'s is
    ``j`` past it): ``kv_len - q_len`` bottom-right, 0 top-left; None
    without a mask (every key is seen)."""
    if not self.causal:
      return None
    if self.bottom_right:
      return kv_lens - q_lens
    return kv_lens * 0

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
