"""Registry of varlen attention backends.

A backend computes causal/non-causal attention over *ragged segments* of a
packed token buffer. The contract (all backends implement exactly this, so the
CP layer above is backend-neutral):

``forward(q, k, v, seg, *, mask, scale, into=None) -> (out, lse)``
    q: ``[Tq, Hq, D]``; k, v: ``[Tkv, Hkv, D]`` (``Hq % Hkv == 0``).
    seg: a :class:`Segments` (per-segment lengths and *token* offsets, int32
    ``[S]``, plus static bounds ``max_seqlen_q``/``max_seqlen_kv``).
    Segment i attends Q rows ``[q_offsets[i], q_offsets[i]+q_lens[i])`` to KV
    rows ``[kv_offsets[i], kv_offsets[i]+kv_lens[i])``. Segments with a zero
    length contribute nothing. Q row ranges of different segments never
    overlap.
    mask: one of :data:`MASK_TYPES`.  ``"causal_bottom_right"``: Q row j of a
    segment sees KV rows ``<= j + kv_len - q_len``; ``"causal_top_left"``: KV
    rows ``<= j``; ``"no_mask"``: all ``kv_len`` rows.
    scale: python float, multiplies ``q @ k^T``.
    Returns out ``[Tq, Hq, D]`` in q's dtype, exactly 0 on rows no segment
    covers (and on rows that see no key), and lse ``[Tq, Hq]`` float32, the
    natural-log log-sum-exp of the scaled scores of each row; ``-inf`` on rows
    that see no key.

    ``into=(out0, lse0)`` (optional): buffers shaped like the results that
    already hold 0 / ``-inf`` on every row this call covers; the results are
    then ``out0`` / ``lse0`` with this call's rows filled in (the ``cudnn``
    backend writes them in place: no clearing, no extra buffers). Needs
    ``seg.rows_see_keys``. Used to run a second call on other rows of the
    same output.

``backward(q, k, v, out, lse, dout, seg, *, mask, scale, dq_into=None)
-> (dq, dk, dv)``
    Gradients of ``sum(out * dout)``; ``out``/``lse`` are the forward's.
    dq is 0 on uncovered rows, dk/dv are 0 on KV rows no segment reads.
    ``dq_into`` (optional): like ``into`` for dq (0 on the covered rows).
    ``dq_fill=(lo, hi)`` (optional, static): the rows this call owns. A
    fresh dq is defined only there (uncovered rows 0) and unspecified
    outside; with ``dq_into`` those rows are overwritten with this call's
    dq (0 where it covers none), whatever ``dq_into`` held, and the rest is
    as without it. Default: all rows for a fresh dq, none with
    ``dq_into``. Two calls on disjoint rows pass complementary ranges, so
    each zeroes only its own uncovered rows.

``is_available(platform) -> bool``: whether the backend can run on a JAX
platform name (``"cpu"``, ``"cuda"``, ...).

``merge_rows(dst, src, row_offset, op) -> dst'``: ``dst [B, Td, ...]`` with
rows ``[row_offset, row_offset + Ts)`` of axis 1 replaced by
``op(those rows, src)`` (``op`` ``"add"`` or ``"max"``, formed in float32),
everything else unchanged; used to merge small per-call outputs into large
ones (:mod:`jax_cp.attention.merge`). Defaults to the ``jnp`` version.

``assemble_kv(halo, k, v, rows, first, count) -> (kx, vx)``: the K/V
buffers ``[B, rows, Hkv, D]`` of a call reading ``[halo; local chunk]``
(``halo [B, H0, 2*Hkv, D]``, K heads first), correct on rows
``[first[b], first[b] + count[b])``, the only rows the call's segments read;
the backend's own attention must tolerate anything elsewhere
(:mod:`jax_cp.attention.assemble`). Defaults to the ``jnp`` version, which
fills every row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import jax

from jax_cp.attention.assemble import assemble_kv_jnp
from jax_cp.attention.merge import merge_rows_jnp

MASK_TYPES = ("no_mask", "causal_top_left", "causal_bottom_right")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """Ragged segment metadata for one attention call (a pytree).

  Attributes:
    q_lens: int32 ``[S]`` valid Q rows per segment.
    kv_lens: int32 ``[S]`` valid KV rows per segment.
    q_offsets: int32 ``[S]`` first Q row (token index) of each segment.
    kv_offsets: int32 ``[S]`` first KV row (token index) of each segment.
    max_seqlen_q: static bound on ``q_lens`` (kernels size grids by it).
    max_seqlen_kv: static bound on ``kv_lens``.
    rows_see_keys: static promise that every covered Q row sees at least
      one key (``kv_len > 0`` where ``q_len > 0``, and ``kv_len >= q_len``
      for the bottom-right mask); backends may then skip zeroing rows that
      see none. The CP layer's calls always satisfy it.
  """

  q_lens: jax.Array
  kv_lens: jax.Array
  q_offsets: jax.Array
  kv_offsets: jax.Array
  max_seqlen_q: int = dataclasses.field(metadata=dict(static=True))
  max_seqlen_kv: int = dataclasses.field(metadata=dict(static=True))
  rows_see_keys: bool = dataclasses.field(default=False,
                                          metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """A named implementation of the varlen attention contract above."""

  name: str
  forward: Callable[..., Tuple[jax.Array, jax.Array]]
  backward: Callable[..., Tuple[jax.Array, jax.Array, jax.Array]]
  is_available: Callable[[str], bool]
  merge_rows: Callable[..., jax.Array] = merge_rows_jnp
  assemble_kv: Callable[..., Tuple[jax.Array, jax.Array]] = assemble_kv_jnp


_BACKENDS: Dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
  """Registers (or replaces) a backend under ``backend.name``."""
  _BACKENDS[backend.name] = backend


def registered_backends() -> Tuple[str, ...]:
  return tuple(_BACKENDS)


def _default_platform() -> str:
  return jax.default_backend()


def resolve_backend(name: str, platform: str | None = None) -> AttentionBackend:
  """Returns the backend for ``name`` on ``platform``.

  ``"auto"`` picks ``"cudnn"`` when it is registered and usable on the
  platform, else ``"xla"``. An explicit name is used as given (so a program
  can be lowered for CUDA on a CPU-only machine); an unknown or unbuilt one
  raises ``ValueError`` saying how to get it.
  """
  if not isinstance(name, str):
    raise ValueError(f"backend must be a string, got {name!r}")
  _load_optional_backends()
  platform = platform or _default_platform()
  if name == "auto":
    cudnn = _BACKENDS.get("cudnn")
    if cudnn is not None and cudnn.is_available(platform):
      return cudnn
    return _BACKENDS["xla"]
  if name not in _BACKENDS:
    hint = ""
    if name == "cudnn":
      hint = (" The cuDNN extension is not built in this installation: on a "
              "machine with the CUDA toolkit, cuDNN and the cuDNN frontend "
              "headers, reinstall with `JAX_CP_BUILD_CUDA=1 pip install "
              "--no-build-isolation -e .` (README: Building the cuDNN "
              "extension).")
    raise ValueError(
        f"backend={name!r} is not available; registered backends: "
        f"{sorted(_BACKENDS) + ['auto']}.{hint}")
  # An explicit choice is honoured whatever the default platform is (it may
  # be lowered for another platform, e.g. CUDA from a CPU-only machine).
  return _BACKENDS[name]


_LOADED = False


def _load_optional_backends() -> None:
  global _LOADED
  if _LOADED:
    return
  _LOADED = True
  from jax_cp.attention import xla as _xla  # noqa: F401  (registers "xla")
  try:
    from jax_cp.attention import cudnn as _cudnn  # noqa: F401
  except ImportError:
    pass

