"""One small forward and backward of every custom call of the extension,
for ``compute-sanitizer --tool memcheck`` (or AddressSanitizer builds):

  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
      python3 -m tests.gpu.sanitize_calls

The platform allocator gives each buffer its own allocation, so memcheck
sees accesses past a buffer's end instead of inside XLA's pool. Runs the
ragged and the tiled graph, 32- and 64-bit offsets, the ``_into`` variants
and the row merge, and checks the results against the ``xla`` backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention import cudnn, xla
from jax_cp.attention.backend import Segments


def main() -> int:
  rng = np.random.default_rng(0)
  tq, hq, hkv, d = 96, 4, 2, 64
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  q, k, v, do = mk(tq, hq, d), mk(tq, hkv, d), mk(tq, hkv, d), mk(tq, hq, d)
  seg = Segments(jnp.array([40, 24, 20], jnp.int32),
                 jnp.array([40, 24, 20], jnp.int32),
                 jnp.array([0, 40, 64], jnp.int32),
                 jnp.array([0, 40, 64], jnp.int32), 40, 40,
                 rows_see_keys=True)
  tiled = Segments(jnp.array([32, 20, 32], jnp.int32),
                   jnp.array([32, 20, 32], jnp.int32),
                   jnp.array([0, 32, 64], jnp.int32),
                   jnp.array([0, 32, 64], jnp.int32), 32, 32,
                   rows_see_keys=True, tiled=True)
  kw = dict(mask="causal_top_left", scale=0.125)
  worst = 0.0
  chosen = cudnn.ragged_offset_bits
  for bits in (32, 64):
    cudnn.ragged_offset_bits = lambda *a, bits=bits, **k_: bits
    for s in (seg, tiled):
      o, lse = jax.jit(lambda q, k, v, s=s: cudnn.forward(q, k, v, s, **kw))(
          q, k, v)
      g = jax.jit(lambda q, k, v, o, lse, s=s: cudnn.backward(
          q, k, v, o, lse, do, s, **kw))(q, k, v, o, lse)
      ro, rl = xla.forward(q, k, v, s, **kw)
      rg = xla.backward(q, k, v, ro, rl, do, s, **kw)
      for a, b in zip((o,) + tuple(g), (ro,) + tuple(rg)):
        a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
        worst = max(worst, float(jnp.linalg.norm(a32 - b32)
                                 / jnp.linalg.norm(b32)))
    # The _into variants write the rows of a second call into the first's.
    first = Segments(seg.q_lens[:1], seg.kv_lens[:1], seg.q_offsets[:1],
                     seg.kv_offsets[:1], 40, 40, rows_see_keys=True)
    rest = Segments(seg.q_lens[1:], seg.kv_lens[1:], seg.q_offsets[1:],
                    seg.kv_offsets[1:], 24, 24, rows_see_keys=True)
    o1, l1 = cudnn.forward(q, k, v, first, **kw)
    o2, l2 = cudnn.forward(q, k, v, rest, into=(o1, l1), **kw)
    dq1, _, _ = cudnn.backward(q, k, v, o2, l2, do, first, **kw)
    cudnn.backward(q, k, v, o2, l2, do, rest, dq_into=dq1, **kw)
  cudnn.ragged_offset_bits = chosen
  merged = cudnn.merge_rows(jnp.zeros((1, 8, 4), jnp.float32),
                            jnp.ones((1, 3, 4), jnp.float32), 2)
  assert float(merged.sum()) == 12.0
  jax.block_until_ready(merged)
  print(f"sanitize_calls: every custom call ran; worst relative error "
        f"against xla {worst:.2e}")
  return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
  raise SystemExit(main())
