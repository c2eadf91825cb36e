"""Other JAX attention kernels for ``bench_fused``, where installed.

None is a dependency of jax_cp: ``pip install -e ".[peers]"`` installs
them. Each peer is a function ``(q, k, v, lens, offs) -> out`` over one
packed row ``[T, H, D]`` with causal documents (``lens``, ``offs``: int32
``[N]`` document lengths and first tokens, jit arguments), built by
:func:`load`, which never raises: a peer that does not import comes back
with its error, and ``bench_fused`` reports it and goes on. A shim that a
peer needs to import or run under this JAX is applied in :func:`load` and
named in :attr:`Peer.shims` (printed and recorded with each row).

* ``tokamax_mosaic``, ``tokamax_triton``: tokamax's Pallas flash attention
  on Mosaic GPU and on Triton (``PallasMosaicGpuFlashAttention``,
  ``PallasTritonFlashAttention``), the documents as a ``Mask`` with each
  query's first key (``k_start``) and a causal mask (with the window as
  its ``window_size``). tokamax's public ``dot_product_attention`` takes
  documents only as a dense ``[T, T]`` mask, so the op classes are called.
* ``kvax``: kvax's Triton flash attention, the documents as segment ids
  and positions, its block mask from ``create_attention_mask``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

PEERS = ("tokamax_mosaic", "tokamax_triton", "kvax")


@dataclasses.dataclass(frozen=True)
class Peer:
  """A loaded peer: ``fn`` or the ``error`` that stopped it, and the
  shims applied to make it import or run."""

  name: str
  fn: Callable | None
  error: str | None = None
  shims: tuple[str, ...] = ()


def doc_starts(offs, tokens: int):
  """int32 ``[T]``: the first token of each token's document (documents
  back to back from token 0, ``offs`` their first tokens)."""
  marks = jnp.zeros((tokens,), jnp.int32).at[offs].max(
      offs.astype(jnp.int32))
  return jax.lax.cummax(marks)


def segment_ids(offs, tokens: int):
  """int32 ``[T]``: each token's document index."""
  return jnp.cumsum(jnp.zeros((tokens,), jnp.int32).at[offs[1:]].add(1))


def _stub_xprof() -> str | None:
  """tokamax 0.0.17 imports xprof's kernel-stats tool for its own
  benchmarking only; xprof (about 100 MB) is not needed to run its ops."""
  if "xprof" in sys.modules or importlib.util.find_spec("xprof"):
    return None
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(name, types.ModuleType(name))
  sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  return "xprof stubbed (tokamax imports its kernel-stats tool)"


def _tokamax(kind: str, tokens: int, scale: float, window_left: int | None):
  """(fn, shims) of a tokamax attention op: ``kind`` "mosaic", "triton",
  or "xla" (its reference op, which runs on CPU: the tests use it)."""
  shims = [s for s in (_stub_xprof(),) if s]
  from tokamax._src.ops.attention import base  # noqa: PLC0415
  if kind == "mosaic":
    from tokamax._src.ops.attention import (  # noqa: PLC0415
        pallas_mosaic_gpu as mod,
    )
    implementation = mod.PallasMosaicGpuFlashAttention()
  elif kind == "triton":
    from tokamax._src.ops.attention import (  # noqa: PLC0415
        pallas_triton as mod,
    )
    implementation = mod.PallasTritonFlashAttention()
  else:
    implementation = base.DotProductAttention()
  causal = base.CausalMask(
      window_size=None if window_left is None else window_left + 1)

  def fn(q, k, v, lens, offs):
    del lens
    mask = base.Mask(k_start=doc_starts(offs, tokens)[None, None, :],
                     causal_mask=causal)
    return implementation(q[None], k[None], v[None], mask=mask,
                          logits_scale=scale)[0]
  return fn, tuple(shims)


def _shim_kvax() -> list[str]:
  """kvax 0.1.0 reads ``jax.experimental.shard_map`` (gone from JAX 0.11)
  and ``jax_triton.cdiv``/``next_power_of_2`` (gone from 0.4), and has two
  module globals Triton 3.6 refuses in a kernel unless ``tl.constexpr``.
  A Triton whose NVIDIA backend jax_triton cannot use raises, naming it."""
  shims = []
  try:
    import jax.experimental.shard_map as mod  # noqa: PLC0415
  except ImportError:
    mod = types.ModuleType("jax.experimental.shard_map")
    sys.modules[mod.__name__] = mod
    jax.experimental.shard_map = mod
  if not hasattr(mod, "Specs"):
    mod.Specs = object
    shims.append("jax.experimental.shard_map.Specs added")
  params = inspect.signature(getattr(mod, "shard_map", jax.shard_map))
  if "check_rep" not in params.parameters:
    def shard_map(f, *, check_rep=True, **kwargs):
      return jax.shard_map(f, check_vma=check_rep, **kwargs)
    mod.shard_map = shard_map
    shims.append("jax.experimental.shard_map.shard_map(check_rep=) as "
                 "jax.shard_map(check_vma=)")
  import jax_triton  # noqa: PLC0415
  import triton  # noqa: PLC0415
  import triton.language as tl  # noqa: PLC0415
  # jax_triton stubs Triton's NVIDIA backend where these do not import.
  importlib.import_module("triton.backends.nvidia.compiler")
  driver = importlib.import_module("triton.backends.nvidia.driver")
  missing = [n for n in ("TMA_DTYPE_DEVICE_TO_HOST", "TMA_TF32")
             if not hasattr(driver, n)]
  if missing:
    raise RuntimeError(f"jax_triton {jax_triton.__version__} needs "
                       f"{missing} of Triton {triton.__version__}'s driver")
  for name in sorted({"cdiv", "next_power_of_2"} - set(dir(jax_triton))):
    setattr(jax_triton, name, getattr(triton, name))
    shims.append(f"jax_triton.{name} as triton.{name}")
  from kvax.ops import flash_attention_triton as fat  # noqa: PLC0415
  for name in ("LOG2_CONST", "NEG_INF"):
    value = getattr(fat, name)
    if not isinstance(value, tl.constexpr):
      setattr(fat, name, tl.constexpr(value))
      shims.append(f"kvax {name} as tl.constexpr")
  return shims


def _kvax(tokens: int, scale: float, window_left: int | None):
  if window_left is not None:
    raise NotImplementedError("kvax 0.1 takes no sliding window")
  shims = _shim_kvax()
  import kvax  # noqa: PLC0415
  from kvax.ops import create_attention_mask  # noqa: PLC0415
  from kvax.ops import flash_attention as kvax_attention  # noqa: PLC0415
  from kvax.utils.common import get_default_flash_attention_params as dflt
  mesh = jax.make_mesh((1,), ("kvax",))
  # kvax 0.1.0's create_attention_mask drops its default bwd_params.
  params = dict(fwd_params=dflt(False), bwd_params=dflt(True))

  def fn(q, k, v, lens, offs):
    del lens
    seg = segment_ids(offs, tokens)[None]
    pos = (jnp.arange(tokens, dtype=jnp.int32) - doc_starts(offs, tokens))
    pos = pos[None]
    with mesh, kvax.utils.attention_specs(
        query_specs=(None, None, None, None),
        kv_specs=(None, None, None, None)):
      mask = create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True,
                                   mesh=mesh, **params)
      # Positions count up within each document (kvax's fast path).
      return kvax_attention(q[None], k[None], v[None], pos, seg, pos, seg,
                            mask, scale=scale, mesh=mesh,
                            assume_sequential_positions=True, **params)[0]
  return fn, tuple(shims)


def load(name: str, *, tokens: int, head_dim: int,
         window_left: int | None = None) -> Peer:
  """The peer ``name`` (one of :data:`PEERS`) for rows of ``tokens``;
  its import error instead where it does not load."""
  scale = 1.0 / float(np.sqrt(head_dim))
  try:
    if name.startswith("tokamax_"):
      fn, shims = _tokamax(name.removeprefix("tokamax_"), tokens, scale,
                           window_left)
    elif name == "kvax":
      fn, shims = _kvax(tokens, scale, window_left)
    else:
      raise ValueError(f"unknown peer {name!r}; one of {PEERS}")
  except Exception as err:  # noqa: BLE001  (reported; the run goes on)
    return Peer(name, None, f"{type(err).__name__}: {err}"[:400])
  return Peer(name, fn, None, shims)
