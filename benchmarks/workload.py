"""What the benchmarks run on: packed rows, meshes, inputs, passes, FLOPs.

* Names: the document mixes (:data:`DISTS`), strategies, passes, document
  orders and models (:data:`MODELS`) the commands take, and token counts
  as flags write them (:func:`parse_tokens`, :func:`fmt_tokens`).
* Rows: one packed row of exactly ``T`` tokens of a mix, seeded so that
  every machine draws the same documents (:func:`pack_row`), padded for a
  strategy and optionally reordered by
  :func:`jax_cp.planning.balance_document_order` (:func:`make_row`).
* Devices: a 1-D ``cp`` mesh (:func:`make_mesh`), random inputs made on
  the devices (:func:`random_inputs`), the CPU platform set before the
  first device is used (:func:`use_cpu`).
* Programs: a pass of an attention function (:func:`with_pass`) and its
  FLOPs (:func:`attention_flops`, causal pairs counted).
"""

from __future__ import annotations

import argparse
import os
import re
import zlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp

DISTS = ("one_doc", "short_128_1k", "uniform_1k_8k", "long_16k")
#: The mixes a command runs unless told (``long_16k``, documents of 16k
#: tokens, four to a 64k row, on request).
DEFAULT_DISTS = DISTS[:3]
DIST_LABEL = {"one_doc": "one document", "short_128_1k": "128–1k docs",
              "uniform_1k_8k": "1k–8k docs", "long_16k": "16k docs"}
STRATEGIES = ("dual_chunk_swap", "no_load_balance")
PASSES = ("fwd", "fwd_bwd")
DOC_ORDERS = ("packed", "balanced")
#: The example's model (``examples/packed_lm``) and a larger one; head dim
#: 64 both.
MODELS = {"example": dict(layers=4, d_model=1024, heads=16, kv_heads=4),
          "big": dict(layers=16, d_model=2048, heads=32, kv_heads=8)}


def parse_tokens(text: str) -> int:
  """``"65536"``, ``"64k"`` (x1024) or ``"1M"`` (x1024**2)."""
  m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
  if not m:
    raise argparse.ArgumentTypeError(f"not a token count: {text!r}")
  return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[
      m.group(2).lower()]


def fmt_tokens(n: int) -> str:
  """The inverse of :func:`parse_tokens` where exact (``64k``, ``1M``)."""
  for unit, scale in (("M", 1 << 20), ("k", 1 << 10)):
    if n >= scale and n % scale == 0:
      return f"{n // scale}{unit}"
  return str(n)


# ------------------------------------------------------------------ rows


def document_lengths(dist: str, tokens: int, seed: int) -> Iterator[int]:
  """Endless valid document lengths of a mix."""
  if dist not in DISTS:
    raise ValueError(f"unknown mix {dist!r}; expected one of {list(DISTS)}")
  rng = np.random.default_rng([seed, zlib.crc32(dist.encode()), tokens])
  low, high = {"short_128_1k": (128, 1024),
               "uniform_1k_8k": (1024, 8192),
               "long_16k": (16384, 16384)}.get(dist, (tokens, tokens))
  while True:
    yield tokens if dist == "one_doc" else int(
        rng.integers(low, high, endpoint=True))


def pack_row(dist: str, tokens: int, multiple: int = 1, seed: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
  """``(cu_seqlens, cu_seqlens_padded)``, int32 ``[N+1]``, of exactly
  ``tokens`` tokens: documents padded to a multiple of ``multiple``, the
  last one trimmed to fill the row. The same seed draws the same
  documents whatever the padding."""
  if tokens % multiple:
    raise ValueError(f"T={tokens} is not a multiple of {multiple}")
  lens, plens, total = [], [], 0
  for length in document_lengths(dist, tokens, seed):
    padded = -(-length // multiple) * multiple
    if total + padded >= tokens:
      lens.append(min(length, tokens - total))
      plens.append(tokens - total)
      break
    lens.append(length)
    plens.append(padded)
    total += padded
  cum = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)
  return cum(lens), cum(plens)


def make_row(dist: str, tokens: int, strategy: str, cp: int, seed: int = 0,
             order: str = "packed", window: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
  """A mix's row for ``strategy`` at ``cp``: DUAL_CHUNK_SWAP pads every
  document to a multiple of ``2*cp``; ``order="balanced"`` reorders the
  documents for the ranks (:func:`jax_cp.planning.balance_document_order`,
  with the window ``(window, 0)``)."""
  layout = jax_cp.CPLayout(cp_axis="cp", cp_size=cp, strategy=strategy)
  cu, cuP = pack_row(dist, tokens, jax_cp.data.pad_multiple_for(layout),
                     seed)
  if order == "balanced":
    perm = jax_cp.planning.balance_document_order(
        cu, cuP, layout, window_size=window_size(window))
    cu, cuP = jax_cp.planning.permute_documents(perm, cu, cuP)
  return cu, cuP


def window_size(window: int | None):
  """``(window, 0)``, or None without a window."""
  return None if window is None else (window, 0)


def attention_flops(cu, heads: int, head_dim: int, pass_name: str,
                    window: int | None = None) -> float:
  """Hardware FLOPs of a pass over the documents of ``cu``: the causal
  pairs (within the window) times ``4 * heads * head_dim``, 3.5x that
  forward+backward (the fused backward recomputes ``Q K^T``)."""
  pairs = jax_cp.planning.causal_pairs(cu, window_size(window))
  return float(jax_cp.planning.attention_flops(
      pairs, num_heads=heads, head_dim=head_dim,
      backward=pass_name == "fwd_bwd", recompute=True))


# --------------------------------------------------------------- devices


def use_cpu(devices: int) -> None:
  """JAX on the CPU with at least ``devices`` virtual devices (before the
  first device is used; an ``XLA_FLAGS`` that sets a count keeps it)."""
  jax.config.update("jax_platforms", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_"
                               f"count={devices}").strip()


def make_mesh(cp: int) -> jax.sharding.Mesh:
  """A ``("cp",)`` mesh over the first ``cp`` devices, Auto axis."""
  if cp > jax.device_count():
    raise SystemExit(f"cp={cp} needs {cp} devices; jax sees "
                     f"{jax.device_count()}")
  return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp],
                       axis_types=(AxisType.Auto,))


def random_inputs(shapes, dtype, seed: int, sharding=None) -> list:
  """Normal random arrays of ``shapes``, made on the devices (placed by
  ``sharding``)."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  make = jax.jit(lambda ks: [jax.random.normal(k, s, dtype)
                             for k, s in zip(ks, shapes)],
                 out_shardings=None if sharding is None
                 else [sharding] * len(shapes))
  return jax.block_until_ready(make(keys))


def replicated(mesh, *arrays) -> list:
  """Host arrays put whole on every device of ``mesh``."""
  return [jax.device_put(a, NamedSharding(mesh, P())) for a in arrays]


def with_pass(attend: Callable, pass_name: str) -> Callable:
  """``(q, k, v, dout, *meta)`` -> the forward ``attend(q, k, v, *meta)``,
  or ``jax.value_and_grad`` of ``sum(out * dout)`` in q, k, v."""
  if pass_name == "fwd":
    return lambda q, k, v, dout, *meta: attend(q, k, v, *meta)

  def loss(q, k, v, dout, *meta):
    out = attend(q, k, v, *meta).astype(jnp.float32)
    return jnp.sum(out * dout.astype(jnp.float32))
  return jax.value_and_grad(loss, argnums=(0, 1, 2))
