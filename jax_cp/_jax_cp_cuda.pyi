"""cuDNN SDPA and row-merge handlers (XLA FFI) for jax_cp's
'cudnn' backend (built from csrc/, see csrc/module.cc)."""

from typing import Any

#: FFI target names by role: sdpa_fwd, sdpa_fwd_out (the inference form:
#: no stats), sdpa_fwd_into, sdpa_bwd, sdpa_bwd_into, merge_rows.
FFI_TARGETS: dict[str, str]
#: Values of the SDPA calls' ``mask`` attribute by mask type.
MASK_CODES: dict[str, int]
#: Values of the merge call's ``op`` attribute ("add", "max").
MERGE_OP_CODES: dict[str, int]
#: The largest head dim the SDPA handlers take.
MAX_HEAD_DIM: int
#: The SDPA segment metadata operand is int32 [SEGMENT_META_ROWS, W] with
#: W >= S + 1 a multiple of SEGMENT_META_WIDTH_MULTIPLE.
SEGMENT_META_ROWS: int
SEGMENT_META_WIDTH_MULTIPLE: int

def registrations() -> dict[str, Any]:
  """Returns {FFI target name: handler capsule} (execute stage only)."""

def graph_cache_stats() -> dict[str, int]:
  """Returns dict(builds=, hits=, entries=) of the process-wide cuDNN graph
  cache."""

def reset_graph_cache_stats() -> None:
  """Zeroes the builds/hits counters (cached graphs are kept)."""

def build_info() -> dict[str, int | str]:
  """Compile-time versions of the cuDNN frontend, cuDNN and CUDA headers, and
  the CUDA runtime soname."""

def reset_failed_handles() -> int:
  """Forgets every remembered cudnnCreate failure, so the next call on such
  a device tries again; returns how many were forgotten."""

def failed_handles() -> dict[int, str]:
  """Returns {device: message} of the remembered cudnnCreate failures."""

def set_fault_injection(spec: str) -> None:
  """Test only: replaces the fault injection spec (as JAX_CP_FAULT_INJECT:
  ``'point[:count],...'``; ``''`` disarms every point) and zeroes the
  counters. Raises ValueError for an unknown point or a bad count."""

def fault_injection_counts() -> dict[str, dict[str, int]]:
  """Test only: {point: dict(remaining=, injected=)} for every fault point;
  remaining is -1 (every hit fails), 0 (not armed) or the failures left."""
