"""All-gather context-parallel attention over packed THD rows (DESIGN §3).

Two entry points:

* :func:`cp_attention_local` runs *inside* the caller's ``shard_map`` on the
  local chunk of every tensor (``[Tl, H, D]`` or ``[B, Tl, H, D]``).
* :func:`cp_attention` is the global view: it takes arrays whose token axis
  is sharded over the cp mesh axis (in :func:`jax_cp.reorder_for_cp` layout)
  and opens its own ``shard_map`` on the given or the context mesh.

Forward per rank: exchange K/V over the cp axis (all-gather, or for
NO_LOAD_BALANCE with a ``max_seqlen`` bound only the halo its straddling
document needs; see :mod:`jax_cp.kv_exchange`), restore sequence order
(DUAL_CHUNK_SWAP), and run the varlen attention calls of the strategy on
per-document metadata: DUAL_CHUNK_SWAP two steps with bottom-right causal
masks; NO_LOAD_BALANCE one step made of a top-left call on the local chunk
(documents inside it; it runs while the halo is in flight) and a
bottom-right call for the one straddling document per row. The calls cover
disjoint Q rows, so each later call writes its rows into the first call's
outputs (the backend's ``into=``; in place with cudnn, no merge pass).
Backward (``jax.custom_vjp``) keeps the local q/k/v/out/lse (plus a small
received halo, :attr:`KVExchange.keeps_halo`), exchanges K/V again where it
must, runs the per-call backward in reverse order (bottom-right blocks
split into an unmasked rectangle and a top-left triangle when the config
says so), writes dq in place the same way, and returns dK/dV to their
owners (reduce-scatter, or the reverse halo permutes, merged into the
owner's rows with the backend's in-place ``merge_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cp import checks, metadata, partition
from jax_cp.attention.api import default_scale
from jax_cp.attention.registry import Segments, resolve_backend
from jax_cp.kv_exchange import KVExchange, choose_exchange
from jax_cp.strategy import CPLoadBalancingStrategy, as_strategy

_DCS = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP
_NLB = CPLoadBalancingStrategy.NO_LOAD_BALANCE
# With split_causal_backward left to the backend, NO_LOAD_BALANCE splits its
# straddle call's backward only when max_seqlen exceeds this.
_SPLIT_STRADDLE_ABOVE = 8192


@dataclasses.dataclass(frozen=True)
class CPConfig:
  """Static (hashable) layout of one CP attention call.

  Forward and backward read the same instance, so the backward always uses
  the forward's strategy, exchange and layout.
  """

  strategy: CPLoadBalancingStrategy
  cp_axis: Optional[str]
  cp_size: int
  causal: bool
  scale: float
  backend: str
  total_tokens: int           # T, the whole row
  max_seqlen: int             # bound on any padded document length
  split_causal_backward: bool
  exchange: KVExchange
  split_straddle: bool = False   # NO_LOAD_BALANCE's straddle call too

  @property
  def local_tokens(self) -> int:
    return self.total_tokens // self.cp_size


@dataclasses.dataclass(frozen=True)
class _Call:
  """One varlen attention call.

  Attributes:
    meta: per-segment lengths/offsets ``[B, n]``.
    mask: backend mask type.
    max_q, max_kv: static bounds on the segment lengths.
    exchanged: KV come from the exchanged buffer (else the local chunk).
    q_rows: the call reads/writes only the first ``q_rows`` local Q rows of
      each row (static); None = all. Small calls then produce small outputs.
    kv_rows: likewise for the KV buffer.
    overlaps_previous: its Q rows are those of the previous call (the
      triangle of a split bottom-right block); every other call's rows are
      disjoint from all others'.
    kv_range: ``(first, count)`` int32 ``[B]``, the rows of the exchanged
      buffer the call reads (the straddle call with a halo exchange): the
      backend's ``assemble_kv`` fills only those.

  The calls of a step cover disjoint Q rows, so a call writes its outputs
  into the buffers of the calls before it (the backend's ``into=`` /
  ``dq_into=``; in place with cudnn, with the full local Q/out/dO as
  inputs) and no log-sum-exp rescaling is needed. Only the triangle of a
  split block reads its ``q_rows`` prefix and has its dq added.
  """

  meta: metadata.StepMetadata
  mask: str
  max_q: int
  max_kv: int
  exchanged: bool
  q_rows: Optional[int] = None
  kv_rows: Optional[int] = None
  overlaps_previous: bool = False
  kv_range: Optional[tuple] = None


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _forward_calls(cfg: CPConfig, cu, cuP, rank) -> List[_Call]:
  """The varlen attention calls of this rank's forward."""
  w, cp, tl = cfg.max_seqlen, cfg.cp_size, cfg.local_tokens
  if cp == 1:
    m = metadata.no_load_balance_step(cu, cuP, 1, 0, cfg.total_tokens)
    # Q and KV lengths agree per document: top-left == bottom-right, and
    # top-left is the faster cuDNN backward.
    return [_Call(m, "causal_top_left" if cfg.causal else "no_mask", w, w,
                  False)]
  if cfg.strategy is _NLB:
    # Documents inside the chunk need only local K/V (and can run while the
    # exchange is in flight); the one straddling document per row needs the
    # exchanged buffer.
    # The straddling document reaches at most W-1 tokens into the chunk, so
    # its call only needs the first W-1 Q rows and, with the halo exchange,
    # the first halo + W-1 KV rows: small buffers for short documents.
    local, straddle = metadata.no_load_balance_split(
        cu, cuP, cp, rank, cfg.total_tokens, cfg.exchange.buffer_start(rank))
    bound = min(w, tl)
    q_rows = min(max(w - 1, 1), tl)
    kv_rows = (cfg.exchange.halo_tokens + q_rows
               if cfg.exchange.kind == "halo" else None)
    # A split block's rectangle and triangle keep the straddle call's range.
    kv_range = (straddle.kv_offsets[:, 0], straddle.kv_lens[:, 0])
    return [_Call(local, "causal_top_left", bound, bound, False),
            _Call(straddle, "causal_bottom_right", q_rows, w, True,
                  q_rows=q_rows if q_rows < tl else None, kv_rows=kv_rows,
                  kv_range=kv_range if kv_rows is not None else None)]
  c = max(_ceil_div(w, 2 * cp), 1)
  calls = []
  for step in (0, 1):
    m = metadata.dual_chunk_swap_step(cu, cuP, cp, rank, step, cfg.causal)
    if cfg.causal:
      # Step 0 sees at most chunks 0..r <= cp-1, step 1 the whole document.
      calls.append(_Call(m, "causal_bottom_right", c,
                         min(w, cp * c) if step == 0 else w, True))
    else:
      calls.append(_Call(m, "no_mask", c, w, True))
  return calls


def _backward_calls(cfg: CPConfig, cu, cuP, rank) -> List[_Call]:
  """The forward's calls in reverse order (NO_LOAD_BALANCE's straddle call
  first, so the halo's gradients travel back while the local call runs),
  bottom-right blocks split into rectangle + triangle where the config says
  so (the triangle ``overlaps_previous``)."""
  out = []
  for call in reversed(_forward_calls(cfg, cu, cuP, rank)):
    straddle = cfg.strategy is _NLB and call.exchanged
    split = cfg.split_straddle if straddle else cfg.split_causal_backward
    if call.mask != "causal_bottom_right" or not split:
      out.append(call)
      continue
    rect, diag = metadata.split_bottom_right(call.meta)
    out.append(dataclasses.replace(call, meta=rect, mask="no_mask"))
    out.append(dataclasses.replace(call, meta=diag, mask="causal_top_left",
                                   max_kv=call.max_q, overlaps_previous=True))
  return out


def _segments(call: _Call, tq: int, tkv: int) -> Segments:
  """[B, n] metadata over B rows -> one segment list over flattened rows,
  heaviest segment first.

  Every CP call satisfies ``kv_len >= q_len`` with ``kv_len > 0`` whenever
  ``q_len > 0``, so every covered row sees a key (``rows_see_keys``).

  Segment order does not change the result. Fused kernels start their
  thread blocks roughly in segment order, so putting the most work (causal
  pairs ``q * (2 * kv - q)``) first leaves short blocks for the end of the
  grid instead of one long document's (longest-first measured 2-3 % faster
  per call on the benchmark rows, H200)."""
  m = call.meta
  rows = jnp.arange(m.q_lens.shape[0], dtype=jnp.int32)[:, None]
  flat = lambda x: x.reshape(-1).astype(jnp.int32)
  seg = [flat(m.q_lens), flat(m.kv_lens), flat(m.q_offsets + rows * tq),
         flat(m.kv_offsets + rows * tkv)]
  if seg[0].shape[0] > 1:
    q, kv = seg[0].astype(jnp.float32), seg[1].astype(jnp.float32)
    order = jnp.argsort(-(q * (2 * kv - q)), stable=True)
    seg = [x[order] for x in seg]
  return Segments(*seg, max(min(call.max_q, tq), 1),
                  max(min(call.max_kv, tkv), 1), rows_see_keys=True)


def _prefix(x, rows: Optional[int]):
  return x if rows is None else x[:, :rows]


def _add(a, b):
  """a + b, summed in float32, in a's dtype (one fused pass)."""
  return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)


class _Sum:
  """The running sum of one gradient over the calls of a step.

  Full-size parts are added as they come (one fused pass each). Parts that
  cover only a prefix of the rows (the straddle calls) are summed among
  themselves in float32, which is cheap, and merged into the full sum once
  with the backend's in-place ``merge_rows``: no pass over the full buffer
  and no copy of it.
  """

  def __init__(self):
    self.full = None
    self.prefix = None

  def add(self, part, rows: Optional[int]):
    if rows is None:
      self.full = part if self.full is None else _add(self.full, part)
    elif self.prefix is None:
      self.prefix = part.astype(jnp.float32)
    else:
      self.prefix = self.prefix + part.astype(jnp.float32)

  def merged(self, merge_rows, dtype):
    """The full sum with the prefix merged in; the prefix alone (in
    ``dtype``) if no full part came; None if nothing came."""
    prefix = None if self.prefix is None else self.prefix.astype(dtype)
    if self.full is None:
      return prefix
    if prefix is None:
      return self.full
    return merge_rows(self.full, prefix.astype(self.full.dtype), 0, "add")


def _call_kv(cfg: CPConfig, backend, call: _Call, k, v, kx, vx, halo,
             cache=None):
  """The K/V a call reads: the local chunk, or the first ``kv_rows`` rows of
  the exchanged buffer (assembled from the halo when there is one, by the
  backend's ``assemble_kv`` on the call's ``kv_range``). ``cache`` (a dict)
  lets the two halves of a split block share one assembly."""
  if not call.exchanged:
    return _prefix(k, call.kv_rows), _prefix(v, call.kv_rows)
  if halo is None:
    return _prefix(kx, call.kv_rows), _prefix(vx, call.kv_rows)
  key = (call.kv_rows, None if call.kv_range is None else
         tuple(id(x) for x in call.kv_range))
  if cache is not None and key in cache:
    return cache[key]
  first, count = call.kv_range or (None, None)
  kv = cfg.exchange.assemble(halo, k, v, call.kv_rows, first, count,
                             assemble_kv=backend.assemble_kv)
  if cache is not None:
    cache[key] = kv
  return kv


def _rank(cfg: CPConfig):
  if cfg.cp_size == 1:
    return jnp.int32(0)
  return jax.lax.axis_index(cfg.cp_axis).astype(jnp.int32)


# ----------------------------------------------------------------- custom_vjp


def _flat(x):
  return x.reshape((-1,) + x.shape[2:])


def _flat_rows(rows, batch: int):
  """A row range of every batch entry -> the range over flattened rows,
  exact only for B = 1 (None otherwise: the backend's default)."""
  if rows is None or batch != 1:
    return None
  return rows


def _cp_forward(q, k, v, cu, cuP, cfg: CPConfig):
  """(out, lse, halo): halo is the received K|V halo when the exchange
  keeps it for the backward (else None)."""
  backend = resolve_backend(cfg.backend)
  halo = kx = vx = None
  if cfg.exchange.kind == "halo":
    halo = cfg.exchange.receive_halo(k, v)
  else:
    kx, vx = cfg.exchange.gather(k, v, cuP)
  out = lse = None
  # The calls cover disjoint Q rows: the first one's outputs hold 0 / -inf
  # on the others' rows, which write into them (in place with cudnn).
  for call in _forward_calls(cfg, cu, cuP, _rank(cfg)):
    assert not call.overlaps_previous, call
    if call.exchanged and halo is not None and out is not None:
      # The assembly waits for the halo: keep it after the earlier calls,
      # which then hide the exchange (XLA may otherwise schedule it first).
      halo, out, lse = jax.lax.optimization_barrier((halo, out, lse))
    kc, vc = _call_kv(cfg, backend, call, k, v, kx, vx, halo)
    into = None if out is None else (_flat(out), _flat(lse))
    o, l = backend.forward(_flat(q), _flat(kc), _flat(vc),
                           _segments(call, q.shape[1], kc.shape[1]),
                           mask=call.mask, scale=cfg.scale, into=into)
    out, lse = o.reshape(q.shape), l.reshape(q.shape[:3])
  return out.astype(q.dtype), lse, (halo if cfg.exchange.keeps_halo else
                                    None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _cp_attention(q, k, v, cu, cuP, cfg: CPConfig):
  return _cp_forward(q, k, v, cu, cuP, cfg)[0]


def _cp_attention_fwd(q, k, v, cu, cuP, cfg: CPConfig):
  out, lse, halo = _cp_forward(q, k, v, cu, cuP, cfg)
  # Residuals are local, plus a small received halo (KVExchange.keeps_halo):
  # all-gathered K/V are rebuilt in the backward.
  return out, (q, k, v, cu, cuP, out, lse, halo)


def _cp_attention_bwd(cfg: CPConfig, res, dout):
  q, k, v, cu, cuP, out, lse, halo = res
  backend = resolve_backend(cfg.backend)
  kx = vx = None
  if halo is None:
    # The barrier keeps XLA from merging this re-gather with the forward's
    # (which would keep the exchanged K/V alive from forward to backward).
    k, v = jax.lax.optimization_barrier((k, v))
    if cfg.exchange.kind == "halo":
      halo = cfg.exchange.receive_halo(k, v)
    else:
      kx, vx = cfg.exchange.gather(k, v, cuP)
  dout = dout.astype(out.dtype)
  dq, dk, dv, dkx, dvx = _Sum(), _Sum(), _Sum(), _Sum(), _Sum()
  assembled = {}
  rest = None    # rows of dq the first call left to the next one
  for call in _backward_calls(cfg, cu, cuP, _rank(cfg)):
    kr = call.kv_rows
    kcc, vcc = _call_kv(cfg, backend, call, k, v, kx, vx, halo, assembled)
    # The first call makes the full-size dq, later calls on other rows write
    # into it (in place with cudnn), both reading the full local buffers; a
    # split block's triangle reads its prefix rows and is summed (_Sum).
    into = dq.full is not None and not call.overlaps_previous
    r = call.q_rows if call.overlaps_previous else None
    # A first call whose rows lie in the first q_rows (the straddle call)
    # zeroes only those; the next call zeroes its uncovered rows after them.
    fill = None
    if not into and not call.overlaps_previous and call.q_rows is not None:
      fill, rest = (0, call.q_rows), (call.q_rows, q.shape[1])
    elif into and rest is not None:
      fill, rest = rest, None
    qc = _prefix(q, r)
    dq_i, dk_i, dv_i = backend.backward(
        _flat(qc), _flat(kcc), _flat(vcc), _flat(_prefix(out, r)),
        _prefix(lse, r).reshape(-1, q.shape[2]), _flat(_prefix(dout, r)),
        _segments(call, qc.shape[1], kcc.shape[1]), mask=call.mask,
        scale=cfg.scale, dq_into=_flat(dq.full) if into else None,
        dq_fill=_flat_rows(fill, q.shape[0]))
    if into:
      dq.full = dq_i.reshape(q.shape)
    else:
      dq.add(dq_i.reshape(qc.shape), r)
    (dkx if call.exchanged else dk).add(dk_i.reshape(kcc.shape), kr)
    (dvx if call.exchanged else dv).add(dv_i.reshape(vcc.shape), kr)
  merge = backend.merge_rows
  dq = dq.merged(merge, q.dtype)
  dk, dv = dk.merged(merge, k.dtype), dv.merged(merge, v.dtype)
  dkx, dvx = dkx.merged(merge, k.dtype), dvx.merged(merge, v.dtype)
  if dkx is not None:
    # Gradients of the exchanged K/V go back to their owners and are merged
    # into the local ones (dk/dv may be None: DUAL_CHUNK_SWAP has no local
    # call).
    dk, dv = cfg.exchange.scatter(dkx, dvx, cuP, into=(dk, dv),
                                  merge_rows=merge)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None,
          None)


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


# ----------------------------------------------------------------- public API


def _config(q, k, v, cu_seqlens, cu_seqlens_padded, *, cp_size, cp_axis,
            load_balancing_strategy, cp_comm_type, attn_mask_type,
            softmax_scale, backend, max_seqlen, window_size,
            split_causal_backward, total_tokens, platform=None) -> CPConfig:
  """Validates everything that can be checked now and builds the config."""
  strategy = as_strategy(load_balancing_strategy)
  checks.check_qkv_shapes(q.shape, k.shape, v.shape)
  checks.check_attention_config(strategy, attn_mask_type, cp_comm_type,
                                window_size, q.dtype)
  for name, x in (("cu_seqlens", cu_seqlens),
                  ("cu_seqlens_padded", cu_seqlens_padded)):
    if jnp.ndim(x) != (2 if q.ndim == 4 else 1) or (
        q.ndim == 4 and jnp.shape(x)[0] != q.shape[0]):
      raise ValueError(
          f"{name} must be [N+1] for q [T, H, D] or [B, N+1] for q "
          f"[B, T, H, D]; got {name} {jnp.shape(x)} with q {q.shape}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must hold integers, got {jnp.result_type(x)}")
  checks.check_divisible_tokens(total_tokens, cp_size)
  checks.check_cu_seqlens_padded(cu_seqlens_padded, total_tokens)
  checks.check_cu_seqlens(cu_seqlens, cu_seqlens_padded)
  if strategy is _DCS and cp_size > 1:
    checks.check_dual_chunk_divisible(cu_seqlens_padded, cp_size)
  w = check_max_seqlen(max_seqlen, cu_seqlens_padded, total_tokens)
  name = resolve_backend(backend, platform).name
  if split_causal_backward is None:
    split_causal_backward = name == "cudnn"
    # NO_LOAD_BALANCE's straddle block is at most W-1 rows: below this bound
    # the extra call of a split costs more than the slower bottom-right
    # backward saves (measured on H200, benchmarks/results/RESULTS.md).
    split_straddle = split_causal_backward and w > _SPLIT_STRADDLE_ABOVE
  else:
    split_straddle = bool(split_causal_backward)
  exchange = choose_exchange(
      strategy is _NLB, cp_axis, cp_size, total_tokens, w,
      communicate=cp_comm_type != checks.CP_COMM_LOCAL_COPIES)
  return CPConfig(strategy=strategy, cp_axis=cp_axis, cp_size=cp_size,
                  causal=attn_mask_type == "causal",
                  scale=default_scale(q.shape[-1], softmax_scale),
                  backend=name, total_tokens=total_tokens, max_seqlen=w,
                  split_causal_backward=bool(split_causal_backward),
                  exchange=exchange, split_straddle=split_straddle)


def check_max_seqlen(max_seqlen, cu_seqlens_padded, total_tokens: int) -> int:
  """``max_seqlen`` as an int bound in ``[1, T]`` (None = T); when the
  metadata is concrete, raises if a padded document is longer."""
  if max_seqlen is None:
    return total_tokens
  if isinstance(max_seqlen, jax.core.Tracer) or int(max_seqlen) < 1:
    raise ValueError(f"max_seqlen must be a static positive int, got "
                     f"{max_seqlen!r}")
  partition.check_max_seqlen_bound(cu_seqlens_padded, max_seqlen)
  return min(int(max_seqlen), total_tokens)


def _as_batched(q, k, v, cu, cuP):
  if q.ndim == 4:
    return q, k, v, cu, cuP, False
  return q[None], k[None], v[None], cu[None], cuP[None], True


def cp_attention_local(q, k, v, cu_seqlens, cu_seqlens_padded, *,
                       cp_axis: Optional[str] = "cp",
                       load_balancing_strategy=_DCS,
                       cp_comm_type: str = "all_gather",
                       attn_mask_type: str = "causal",
                       softmax_scale: Optional[float] = None,
                       backend: str = "auto",
                       max_seqlen: Optional[int] = None,
                       window_size=None,
                       split_causal_backward: Optional[bool] = None):
  """CP attention on this rank's chunk, inside the caller's ``shard_map``.

  Args:
    q: local queries ``[Tl, Hq, D]`` or ``[B, Tl, Hq, D]`` (``Tl = T/cp``), in
      the layout of :func:`jax_cp.get_batch_on_this_cp_rank` with the same
      strategy.
    k, v: local keys/values ``[.., Tl, Hkv, D]``, ``Hq % Hkv == 0``.
    cu_seqlens, cu_seqlens_padded: the *global* row metadata ``[N+1]`` or
      ``[B, N+1]`` (replicated over the cp axis; may be traced).
    cp_axis: the mesh axis the row is split over (``None``: no CP).
    load_balancing_strategy: :class:`CPLoadBalancingStrategy` or its string.
    cp_comm_type: ``"all_gather"`` (the only exchange implemented), or
      ``"local_copies"``: the same exchange with every collective replaced
      by a local copy of the same shape (no communication; wrong results
      for cp > 1), to time a step without its communication.
    attn_mask_type: ``"causal"`` or ``"no_mask"`` (DUAL_CHUNK_SWAP only).
    softmax_scale: defaults to ``1/sqrt(D)``.
    backend: ``"auto"``, ``"cudnn"`` or ``"xla"``.
    max_seqlen: static bound on every padded document length (None = T).
      Kernels size their grids by it; a document longer than the bound gives
      undefined results on the cuDNN backend (checked when the metadata is
      concrete).
    window_size: ``None`` or ``(-1, 0)``; sliding windows are rejected.
    split_causal_backward: run the backward of bottom-right causal blocks as
      an unmasked rectangle plus a top-left triangle (faster with cuDNN 9.19
      for large blocks). Default: on for cudnn, off otherwise; with cudnn,
      NO_LOAD_BALANCE's straddle block (at most ``max_seqlen - 1`` rows) is
      split only when ``max_seqlen > 8192``, below which the extra call
      costs more than it saves. Same result either way.

  Returns:
    The local output, shaped and typed like ``q``.
  """
  cp_size = 1 if cp_axis is None else jax.lax.axis_size(cp_axis)
  cfg = _config(q, k, v, cu_seqlens, cu_seqlens_padded, cp_size=cp_size,
                cp_axis=cp_axis,
                load_balancing_strategy=load_balancing_strategy,
                cp_comm_type=cp_comm_type, attn_mask_type=attn_mask_type,
                softmax_scale=softmax_scale, backend=backend,
                max_seqlen=max_seqlen, window_size=window_size,
                split_causal_backward=split_causal_backward,
                total_tokens=q.shape[-3] * cp_size)
  q4, k4, v4, cu, cuP, squeeze = _as_batched(
      q, k, v, jnp.asarray(cu_seqlens, jnp.int32),
      jnp.asarray(cu_seqlens_padded, jnp.int32))
  out = _cp_attention(q4, k4, v4, cu, cuP, cfg)
  return out[0] if squeeze else out


def _resolve_mesh(mesh):
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError("cp_attention needs a mesh: pass mesh=... or set one "
                       "with `with jax.set_mesh(mesh):`")
  return mesh


def _platform(mesh) -> Optional[str]:
  """The platform of the mesh's devices ("cpu", "gpu", ...), if known."""
  try:
    return mesh.devices.flat[0].platform
  except Exception:  # pylint: disable=broad-except  (an AbstractMesh)
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)


def cp_attention(q, k, v, cu_seqlens, cu_seqlens_padded, *, mesh=None,
                 cp_axis: str = "cp",
                 load_balancing_strategy=_DCS,
                 cp_comm_type: str = "all_gather",
                 attn_mask_type: str = "causal",
                 softmax_scale: Optional[float] = None,
                 backend: str = "auto",
                 batch_axis: Optional[str] = None,
                 head_axis: Optional[str] = None,
                 max_seqlen: Optional[int] = None,
                 window_size=None,
                 split_causal_backward: Optional[bool] = None):
  """CP attention, global view: ``jit``-friendly over sharded arrays.

  Args:
    q: ``[T, Hq, D]`` or ``[B, T, Hq, D]`` in :func:`jax_cp.reorder_for_cp`
      layout (same strategy), token axis sharded over ``cp_axis``.
    k, v: ``[.., T, Hkv, D]``, same layout.
    cu_seqlens, cu_seqlens_padded: ``[N+1]`` or ``[B, N+1]`` int metadata of
      the rows in physical order (not reordered).
    mesh: a ``Mesh``; ``None`` takes the context mesh (``jax.set_mesh``).
    cp_axis: mesh axis the tokens are split over.
    batch_axis: optional mesh axis (or tuple of axes) the batch dim is
      sharded over (data parallel); needs 4-D inputs.
    head_axis: optional mesh axis the heads are sharded over (tensor
      parallel); needs ``Hkv`` divisible by its size.
    The other arguments are those of :func:`cp_attention_local`.

  Returns:
    The output, same shape, dtype and layout as ``q``. Differentiable in
    q, k, v.
  """
  mesh = _resolve_mesh(mesh)
  checks.check_mesh_axis(mesh, cp_axis, "cp_axis")
  batch_axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(
      batch_axis or ())
  for ax in batch_axes:
    checks.check_mesh_axis(mesh, ax, "batch_axis")
  checks.check_mesh_axis(mesh, head_axis, "head_axis")
  if batch_axes and q.ndim != 4:
    raise ValueError(f"batch_axis={batch_axis!r} needs inputs [B, T, H, D], "
                     f"got q {q.shape}")
  cp_size = mesh.shape[cp_axis]
  # Validate (and resolve the backend) once, on the global shapes.
  _config(q, k, v, cu_seqlens, cu_seqlens_padded, cp_size=cp_size,
          cp_axis=cp_axis, load_balancing_strategy=load_balancing_strategy,
          cp_comm_type=cp_comm_type, attn_mask_type=attn_mask_type,
          softmax_scale=softmax_scale, backend=backend,
          max_seqlen=max_seqlen, window_size=window_size,
          split_causal_backward=split_causal_backward,
          total_tokens=q.shape[-3], platform=_platform(mesh))
  if head_axis is not None:
    tp = mesh.shape[head_axis]
    if k.shape[-2] % tp or q.shape[-2] % tp:
      raise ValueError(f"head_axis={head_axis!r} of size {tp} must divide "
                       f"Hq={q.shape[-2]} and Hkv={k.shape[-2]}")
  bspec = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) \
      if batch_axes else None
  if q.ndim == 4:
    x_spec = P(bspec, cp_axis, head_axis, None)
    m_spec = P(bspec, None)
  else:
    x_spec = P(cp_axis, head_axis, None)
    m_spec = P(None)
  backend_name = resolve_backend(backend, _platform(mesh)).name
  local = functools.partial(
      cp_attention_local, cp_axis=cp_axis,
      load_balancing_strategy=load_balancing_strategy,
      cp_comm_type=cp_comm_type, attn_mask_type=attn_mask_type,
      softmax_scale=softmax_scale, backend=backend_name,
      max_seqlen=max_seqlen, window_size=window_size,
      split_causal_backward=split_causal_backward)
  args = [_place(x, mesh, spec) for x, spec in (
      (q, x_spec), (k, x_spec), (v, x_spec),
      (jnp.asarray(cu_seqlens, jnp.int32), m_spec),
      (jnp.asarray(cu_seqlens_padded, jnp.int32), m_spec))]
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(x_spec, x_spec, x_spec, m_spec, m_spec),
                       out_specs=x_spec, check_vma=False)(*args)


def _place(x, mesh, spec):
  """Puts ``x`` in the sharding ``shard_map`` expects: ``jax.reshard`` on
  meshes with Explicit axes (it checks types), a sharding constraint on
  Auto ones (a no-op when already so)."""
  sharding = NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec
  explicit = any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
  if explicit:
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)
