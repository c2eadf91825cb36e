"""The configurations the benchmarks measure, and how tables name them.

Standard library only: the report reads these without importing jax.
"""

from __future__ import annotations

import argparse
import re

# Document distributions of a packed row (``workload.document_lengths``),
# in the order runs measure them and tables list them: the speed targets'
# rows (one document, short documents) first.
DISTS = ("one_doc", "short_128_1k", "uniform_1k_8k", "stdlib_mix")
DIST_LABEL = {"one_doc": "one document", "short_128_1k": "128–1k docs",
              "uniform_1k_8k": "1k–8k docs",
              "stdlib_mix": "stdlib .py sizes"}

# CP load-balancing strategies, and their short names (``None``: the cp=1
# program, which has no strategy).
STRATEGIES = ("dual_chunk_swap", "no_load_balance")
SHORT = {"dual_chunk_swap": "DCS", "no_load_balance": "NLB", None: "cp=1"}

# The attention shape the scripts default to (the speed targets' row of
# ``TOKENS`` tokens, 32 query and 8 key/value heads of 128).
TOKENS = 65536
HQ = 32
HKV = 8
HEAD_DIM = 128

# What a program computes: the forward, or the forward and the gradients.
PASSES = ("fwd", "fwd_bwd")
PASS_LABEL = {"fwd": "forward", "fwd_bwd": "forward+backward"}

# A row's documents as packed, or reordered by
# ``jax_cp.balance_document_order`` to balance the cp ranks.
DOC_ORDERS = ("packed", "balanced")

# The layout's guard of the ``max_seqlen`` bound (``max_seqlen_violation``).
VIOLATIONS = ("fallback", "checked_on_host")


def dist_rank(dist: str) -> int:
  """A distribution's place in :data:`DISTS` (unknown ones last)."""
  return DISTS.index(dist) if dist in DISTS else len(DISTS)


# The example's model (``examples/packed_lm``, as ``bench_step`` builds it)
# and a larger one: layers, width, query and key/value heads.
MODELS = {"example": dict(layers=4, d_model=1024, heads=16, kv_heads=4),
          "big": dict(layers=16, d_model=2048, heads=32, kv_heads=8)}

# The rows of ``bench_step --weak`` (weak scaling): which strategy runs on
# which row. ``one_doc``: one document of the whole row; ``short``:
# documents cut at ``--max-doc-len`` (1k), reordered for the ranks.
SCALING_ROWS = ("dcs_one_doc", "nlb_short", "nlb_one_doc")
SCALING_ROW = {"dcs_one_doc": ("dual_chunk_swap", "one_doc"),
               "nlb_short": ("no_load_balance", "short"),
               "nlb_one_doc": ("no_load_balance", "one_doc")}
SCALING_ROW_LABEL = {"dcs_one_doc": "DCS, one document",
                     "nlb_short": "NLB (balanced), docs ≤ 1k",
                     "nlb_one_doc": "NLB, one document"}


# Token counts as flags and tables write them.

def parse_tokens(text: str) -> int:
  """``"65536"``, ``"64k"`` (x1024) or ``"1M"`` (x1024**2)."""
  m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
  if not m:
    raise argparse.ArgumentTypeError(f"not a token count: {text!r}")
  scale = {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
  return int(m.group(1)) * scale


def fmt_tokens(n: int) -> str:
  """The inverse of :func:`parse_tokens` where exact (``64k``, ``1M``)."""
  for unit, scale in (("M", 1 << 20), ("k", 1 << 10)):
    if n >= scale and n % scale == 0:
      return f"{n // scale}{unit}"
  return str(n)
