"""The scratch memory of the ``"cudnn"`` backend's SDPA backward, as a formula.

The handler asks XLA's FFI scratch allocator for the workspace of its
cuDNN frontend graph when it runs, outside the buffers XLA plans at compile
time: ``compile().memory_analysis()`` does not count it, and at long rows it
is the allocation that fails last. For a ragged (THD) backward with the
packed token totals given (``set_max_total_seq_len_q/kv``, as
``csrc/sdpa_graph.cc`` does), the frontend's part of the workspace is four
float32 buffers sized by the call's tokens:

* the dQ accumulator, ``Tq * Hq * D * 4`` bytes: dQ is accumulated in
  float32 over the key blocks and converted to the I/O dtype at the end;
* with GQA/MQA (``Hq != Hkv``), dK and dV at the ``Hq`` query heads,
  ``Tkv * Hq * D * 4`` bytes each: every query head's share, reduced over
  each group of ``Hq / Hkv`` heads into dK/dV afterwards (none with
  ``Hq == Hkv``);
* the softmax sums ``rowsum(dO * O)``, ``Tq * Hq * 4`` bytes.

So at ``Tq = Tkv = T`` a GQA backward needs ``T * Hq * (12 D + 4)`` bytes:
at T = 1M tokens, Hq = 16, D = 64, that is 12.95 GB (4.29 GB dQ, 8.59 GB dK
and dV, 0.07 GB sums), more than Q, K, V, O and dO together in bf16. The
frontend has no attribute that drops these buffers (its only other dQ path,
the dP workspace, is ``S * Hq * s_q * s_kv * 2`` bytes and runs only in
deterministic mode); the workspace shrinks with the tokens of one call, i.e.
with more cp ranks.

Where the frontend ignores the totals (a head dim that is not a multiple
of 16, or pre-Hopper "ampere style" kernels), it sizes the dQ accumulator
and the sums by ``S * max_seqlen_q`` instead (S: the segment slots) and
leaves dK/dV at Hq heads to cuDNN's own workspace.

The cuDNN engine adds a small workspace of its own to what
``get_workspace_size`` reports; :func:`backward_workspace_bytes` is the
frontend's part, the bulk of it.

In the deterministic mode (docs/determinism.md) the backward runs the
frontend's deterministic algorithm, which on Hopper with cuDNN 9.19 has
no dQ accumulator: it keeps the gradient of the scores, dP, in a buffer
of ``S * Hq * s_q * s_kv * 2`` bytes (``s_q`` rounded up to 64, ``s_kv``
to 128: the frontend's own bound; S the segment slots, ``s_q``/``s_kv``
the graph's bounds), quadratic in a segment's length; dK/dV at the query
heads and the softmax sums stay (``backward_workspace(...,
deterministic=True)``).

Every buffer is proportional to the call's query heads, so the backend
bounds it by running a backward whose workspace exceeds its scratch
bound (:func:`backward_scratch_limit`: 4 GiB unless
``JAX_CP_CUDNN_BWD_SCRATCH_GIB`` says otherwise, read where the backend is
resolved) as sub-calls over whole GQA head groups, one after another
(:mod:`jax_cp.attention.cudnn.split`); :func:`backward_head_groups` says
how many. At 1M tokens with Hq = 32, Hkv = 8, D = 64 the workspace is 25.9 GB
in one call and 3.2 GB in each of 8. Where even one KV head's sub-call
exceeds the bound (its K/V rows are a whole long row, as under an
all-gather at large cp), each sub-call runs over ranges of its K/V rows
(:mod:`jax_cp.attention.cudnn.kv_slices`), which shrink dK/dV at the query
heads; :func:`backward_split` says how many of both. In the deterministic
mode the slices also shrink the dP buffer (its ``s_kv``); where no split
fits, :func:`backward_split` raises ``ValueError`` naming the sizes.
"""

from __future__ import annotations

import dataclasses
import math
import os

from jax_cp.attention.head_groups import fewest_groups

_F32 = 4


@dataclasses.dataclass(frozen=True)
class BackwardWorkspace:
  """The frontend buffers of one SDPA backward call, in bytes.

  Attributes:
    dq_accum: the float32 dQ accumulator.
    dk_full_heads: float32 dK at the query heads (GQA/MQA only, else 0).
    dv_full_heads: float32 dV at the query heads (GQA/MQA only, else 0).
    softmax_sum: the float32 ``rowsum(dO * O)`` per query row and head.
    dp: the deterministic algorithm's dP buffer (0 outside the mode,
      where ``dq_accum`` takes its place).
  """

  dq_accum: int
  dk_full_heads: int
  dv_full_heads: int
  softmax_sum: int
  dp: int = 0

  @property
  def total(self) -> int:
    """All the buffers."""
    return (self.dq_accum + self.dk_full_heads + self.dv_full_heads
            + self.softmax_sum + self.dp)


def _positive(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be a non-negative int, got {value!r}")
  return value


def _check_heads(heads_q: int, heads_kv: int) -> None:
  """Raises ValueError unless ``heads_kv`` is a positive int dividing
  ``heads_q``."""
  _positive("heads_kv", heads_kv)
  if heads_kv < 1 or heads_q % heads_kv:
    raise ValueError(f"heads_kv={heads_kv} must be positive and divide "
                     f"heads_q={heads_q}")


def honours_packed_totals(head_dim: int, head_dim_v: int | None = None
                          ) -> bool:
  """Whether the frontend sizes the backward's buffers by the packed token
  totals (both head dims multiples of 16), not by the segment slots."""
  dv = head_dim if head_dim_v is None else head_dim_v
  return head_dim % 16 == 0 and dv % 16 == 0


def backward_workspace(tokens_q: int, tokens_kv: int, heads_q: int,
                       heads_kv: int, head_dim: int, *,
                       head_dim_v: int | None = None,
                       segments: int | None = None,
                       max_seqlen_q: int | None = None,
                       packed_totals: bool | None = None,
                       deterministic: bool = False,
                       max_seqlen_kv: int | None = None
                       ) -> BackwardWorkspace:
  """The frontend workspace of one ``jax_cp_cudnn_sdpa_bwd`` call.

  Args:
    tokens_q, tokens_kv: the rows of the call's Q and K/V buffers (the
      local chunk of one cp rank, for the main call of a step).
    heads_q, heads_kv: query and key/value heads (``heads_q % heads_kv ==
      0``).
    head_dim: the Q/K head dim; ``head_dim_v`` that of V (default the
      same).
    segments, max_seqlen_q: the graph's segment slots and per-segment
      bound; needed only where the frontend ignores the packed totals.
    packed_totals: whether the frontend honours the packed token totals;
      default: both head dims are multiples of 16 (Hopper and newer).
    deterministic: the deterministic algorithm's buffers: the dP buffer
      (:func:`deterministic_dp_bytes`) instead of the dQ accumulator;
      needs ``segments``, ``max_seqlen_q`` and ``max_seqlen_kv`` (the
      graph's bounds).

  Returns:
    The buffers (:class:`BackwardWorkspace`).

  Raises:
    ValueError: a negative or non-int size, heads that do not divide,
      ``packed_totals=False`` without ``segments`` and ``max_seqlen_q``, or
      ``deterministic`` without the three.
  """
  for name, value in (("tokens_q", tokens_q), ("tokens_kv", tokens_kv),
                      ("heads_q", heads_q), ("heads_kv", heads_kv),
                      ("head_dim", head_dim)):
    _positive(name, value)
  dv = head_dim if head_dim_v is None else _positive("head_dim_v",
                                                      head_dim_v)
  _check_heads(heads_q, heads_kv)
  if packed_totals is None:
    packed_totals = honours_packed_totals(head_dim, dv)
  if packed_totals:
    rows_q = tokens_q
  else:
    if segments is None or max_seqlen_q is None:
      raise ValueError("packed_totals=False sizes the buffers by segments * "
                       "max_seqlen_q: pass both")
    rows_q = _positive("segments", segments) * _positive("max_seqlen_q",
                                                         max_seqlen_q)
  gqa = heads_q != heads_kv and packed_totals
  dp = 0
  if deterministic:
    if segments is None or max_seqlen_q is None or max_seqlen_kv is None:
      raise ValueError("deterministic=True sizes the dP buffer by segments "
                       "* max_seqlen_q * max_seqlen_kv: pass all three")
    dp = deterministic_dp_bytes(segments, heads_q, max_seqlen_q,
                                max_seqlen_kv)
  return BackwardWorkspace(
      dq_accum=0 if deterministic else rows_q * heads_q * head_dim * _F32,
      dk_full_heads=tokens_kv * heads_q * head_dim * _F32 if gqa else 0,
      dv_full_heads=tokens_kv * heads_q * dv * _F32 if gqa else 0,
      softmax_sum=rows_q * heads_q * _F32, dp=dp)


#: The multiples the frontend rounds ``s_q`` and ``s_kv`` up to when it
#: bounds the deterministic algorithm's dP buffer on Hopper.
DP_SEQLEN_Q_MULTIPLE = 64
DP_SEQLEN_KV_MULTIPLE = 128
#: Bytes of one dP value (the I/O dtype, bfloat16 or float16).
DP_VALUE_BYTES = 2


def deterministic_dp_bytes(segments: int, heads_q: int, max_seqlen_q: int,
                           max_seqlen_kv: int) -> int:
  """The dP buffer of the deterministic backward: ``S * Hq * s_q * s_kv *
  2`` bytes, ``s_q`` rounded up to :data:`DP_SEQLEN_Q_MULTIPLE` and
  ``s_kv`` to :data:`DP_SEQLEN_KV_MULTIPLE` (the graph's bounds)."""
  for name, value in (("segments", segments), ("heads_q", heads_q),
                      ("max_seqlen_q", max_seqlen_q),
                      ("max_seqlen_kv", max_seqlen_kv)):
    _positive(name, value)
  up = lambda n, m: -(-n // m) * m
  return (segments * heads_q * up(max_seqlen_q, DP_SEQLEN_Q_MULTIPLE)
          * up(max_seqlen_kv, DP_SEQLEN_KV_MULTIPLE) * DP_VALUE_BYTES)


def backward_workspace_bytes(tokens_q: int, tokens_kv: int, heads_q: int,
                             heads_kv: int, head_dim: int, **kwargs) -> int:
  """:func:`backward_workspace`'s total in bytes (same arguments)."""
  return backward_workspace(tokens_q, tokens_kv, heads_q, heads_kv,
                            head_dim, **kwargs).total


#: The default bound on one backward call's workspace, in bytes.
DEFAULT_BACKWARD_SCRATCH_LIMIT = 4 * 2**30
#: The environment variable that overrides it: GiB as a positive number,
#: or ``inf`` (never split).
SCRATCH_LIMIT_ENV = "JAX_CP_CUDNN_BWD_SCRATCH_GIB"


def backward_scratch_limit(environ=None) -> float:
  """The bound, in bytes, on the workspace of one backward sub-call:
  ``JAX_CP_CUDNN_BWD_SCRATCH_GIB`` GiB when set (``inf``: no bound), else
  :data:`DEFAULT_BACKWARD_SCRATCH_LIMIT`. The cudnn backend reads it
  where it is resolved (:func:`jax_cp.attention.registry.
  resolve_backend`), never while a call is traced: the bound is then the
  resolved backend's ``scratch_limit``, part of its identity, and applies
  to the backends resolved after the variable is set. The formulas below
  read it when called without a ``limit``.

  Raises:
    ValueError: the variable is not a positive number or ``inf``.
  """
  environ = os.environ if environ is None else environ
  text = environ.get(SCRATCH_LIMIT_ENV, "").strip()
  if not text:
    return float(DEFAULT_BACKWARD_SCRATCH_LIMIT)
  try:
    gib = float(text)
  except ValueError:
    gib = math.nan
  if not gib > 0:
    raise ValueError(f"{SCRATCH_LIMIT_ENV}={text!r} must be a positive "
                     f"number of GiB or 'inf'")
  return gib * 2**30


def backward_head_groups(tokens_q: int, tokens_kv: int, heads_q: int,
                         heads_kv: int, head_dim: int, *,
                         limit: float | None = None, **kwargs) -> int:
  """How many sub-calls over whole GQA head groups a backward runs as: the
  fewest (a divisor of ``heads_kv``) whose workspace each stays within
  ``limit`` bytes (default :func:`backward_scratch_limit`), and
  ``heads_kv`` (one KV head per sub-call) when even that exceeds it.
  Other arguments as for :func:`backward_workspace`, for the whole call.
  """
  limit = backward_scratch_limit() if limit is None else limit
  _check_heads(heads_q, heads_kv)
  return fewest_groups(heads_kv, lambda n: backward_workspace_bytes(
      tokens_q, tokens_kv, heads_q // n, heads_kv // n, head_dim,
      **kwargs) <= limit)


#: The most K/V slices a backward sub-call is cut into
#: (:func:`backward_kv_slices`).
MAX_KV_SLICES = 256


def backward_kv_slices(tokens_q: int, tokens_kv: int, heads_q: int,
                       heads_kv: int, head_dim: int, *,
                       limit: float | None = None, **kwargs) -> int:
  """How many ranges of its K/V rows a backward sub-call of these heads
  runs as (:mod:`jax_cp.attention.cudnn.kv_slices`): 1 when its workspace fits
  ``limit`` bytes (default :func:`backward_scratch_limit`), else the fewest
  whose slice's workspace fits, at most :data:`MAX_KV_SLICES`. Slices
  shrink dK/dV at the query heads only; where the buffers sized by the
  query rows alone exceed the limit, it is the fewest that make dK/dV no
  larger than them. Other arguments as for :func:`backward_workspace`."""
  limit = backward_scratch_limit() if limit is None else limit
  if kwargs.get("deterministic"):
    n = _deterministic_kv_slices(tokens_q, tokens_kv, heads_q, heads_kv,
                                 head_dim, limit, **kwargs)
    return MAX_KV_SLICES if n is None else n
  ws = lambda n: backward_workspace(tokens_q, -(-tokens_kv // n), heads_q,
                                    heads_kv, head_dim, **kwargs)
  if tokens_kv <= 1 or ws(1).total <= limit:
    return 1
  fixed = ws(1).dq_accum + ws(1).softmax_sum
  goal = limit if fixed < limit else 2 * fixed
  for n in range(2, min(MAX_KV_SLICES, tokens_kv) + 1):
    if ws(n).total <= goal:
      return n
  return min(MAX_KV_SLICES, tokens_kv)


def _slice_kwargs(tokens_kv: int, n: int, kwargs: dict) -> dict:
  """A K/V slice's arguments: its rows bound its ``max_seqlen_kv``."""
  rows = -(-tokens_kv // n)
  kv = kwargs.get("max_seqlen_kv")
  return dict(kwargs, max_seqlen_kv=rows if kv is None else min(kv, rows))


def _deterministic_kv_slices(tokens_q: int, tokens_kv: int, heads_q: int,
                             heads_kv: int, head_dim: int, limit: float,
                             **kwargs) -> int | None:
  """The fewest K/V slices whose deterministic workspace fits ``limit``
  (each slice's worst call keeps the call's ``max_seqlen_q``, its unmasked
  part), or None when none up to :data:`MAX_KV_SLICES` does."""
  for n in range(1, min(MAX_KV_SLICES, max(tokens_kv, 1)) + 1):
    ws = backward_workspace(tokens_q, -(-tokens_kv // n), heads_q, heads_kv,
                            head_dim, **_slice_kwargs(tokens_kv, n, kwargs))
    if ws.total <= limit:
      return n
  return None


def backward_split(tokens_q: int, tokens_kv: int, heads_q: int,
                   heads_kv: int, head_dim: int, *, limit: float | None = None,
                   kv_slices: bool = True, **kwargs) -> tuple[int, int]:
  """``(groups, slices)``: the head-group sub-calls of a backward
  (:func:`backward_head_groups`) and, when even one KV head's exceeds the
  limit and ``kv_slices`` allows it (no window, no tiled graph), the K/V
  slices of each (:func:`backward_kv_slices`).

  Raises:
    ValueError: with ``deterministic=True``, when no split fits the limit:
      the dP buffer of one KV head's sub-call exceeds it in every allowed
      number of K/V slices (the message names the sizes).
  """
  limit = backward_scratch_limit() if limit is None else limit
  groups = backward_head_groups(tokens_q, tokens_kv, heads_q, heads_kv,
                                head_dim, limit=limit, **kwargs)
  if not kwargs.get("deterministic"):
    if not kv_slices or groups < heads_kv:
      return groups, 1
    return groups, backward_kv_slices(
        tokens_q, tokens_kv, heads_q // groups, heads_kv // groups,
        head_dim, limit=limit, **kwargs)
  one = backward_workspace(tokens_q, tokens_kv, heads_q // groups,
                           heads_kv // groups, head_dim, **kwargs)
  if one.total <= limit:
    return groups, 1
  slices = None
  if kv_slices:
    slices = _deterministic_kv_slices(tokens_q, tokens_kv, heads_q // groups,
                                      heads_kv // groups, head_dim, limit,
                                      **kwargs)
  if slices is None:
    how = (f"in up to {MAX_KV_SLICES} K/V slices" if kv_slices else
           "and a call with a sliding window or a tiled graph is not cut "
           "into K/V slices")
    raise ValueError(
        f"the deterministic cuDNN backward of this call cannot fit its "
        f"scratch bound of {limit / 2**30:.3g} GiB "
        f"({SCRATCH_LIMIT_ENV}): Tq={tokens_q}, Tkv={tokens_kv}, "
        f"Hq={heads_q}, Hkv={heads_kv}, D={head_dim}, "
        f"S={kwargs.get('segments')} segments of up to "
        f"s_q={kwargs.get('max_seqlen_q')} x "
        f"s_kv={kwargs.get('max_seqlen_kv')} rows; its dP buffer "
        f"(S * Hq * s_q * s_kv * 2 bytes) is {one.dp / 2**30:.3g} GiB for "
        f"one KV head's {heads_q // groups} query heads, and no split fits "
        f"{how}. Raise {SCRATCH_LIMIT_ENV}, bound the documents "
        f"(max_seqlen) or spread the row over more cp ranks, or run "
        f"without the deterministic mode (docs/determinism.md).")
  return groups, slices
