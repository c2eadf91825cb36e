"""One small forward and backward of every custom call of the extension,
for ``compute-sanitizer --tool memcheck`` (or AddressSanitizer builds):

  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
      python3 -m tests.gpu.sanitize_calls

The platform allocator gives each buffer its own allocation, so memcheck
sees accesses past a buffer's end instead of inside XLA's pool. Runs the
ragged and the tiled graph, 32- and 64-bit offsets, the ``_into`` variants
and the row merge, and checks the results against the ``xla`` backend.

The GPU runs our custom calls and little else: the inputs come from the
host, the ``xla`` reference runs on the CPU and the comparison in NumPy,
so no XLA GPU kernel is autotuned under the sanitizer (memcheck can crash
itself in XLA's GEMM autotuning). A line is printed after
each call, so a log that stops shows where.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cp.attention import xla
from jax_cp.attention.backend import Segments
from jax_cp.attention.cudnn import backend as cudnn


def _step(name: str) -> None:
  print(f"sanitize_calls: {name} done", flush=True)


def _rel(a, b) -> float:
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> int:
  rng = np.random.default_rng(0)
  cpu = jax.devices("cpu")[0]
  tq, hq, hkv, d = 96, 4, 2, 64
  host = {name: rng.standard_normal(shape).astype(jnp.bfloat16)
          for name, shape in (("q", (tq, hq, d)), ("k", (tq, hkv, d)),
                              ("v", (tq, hkv, d)), ("do", (tq, hq, d)))}
  gpu_in = {n: jnp.asarray(x) for n, x in host.items()}
  cpu_in = {n: jax.device_put(x, cpu) for n, x in host.items()}
  q, k, v, do = (gpu_in[n] for n in ("q", "k", "v", "do"))

  def segments(lens, starts, longest, **kw):
    return Segments(jnp.array(lens, jnp.int32), jnp.array(lens, jnp.int32),
                    jnp.array(starts, jnp.int32),
                    jnp.array(starts, jnp.int32), longest, longest,
                    rows_see_keys=True, **kw)

  ragged = ([40, 24, 20], [0, 40, 64], 40, {})
  tiled = ([32, 20, 32], [0, 32, 64], 32, {"tiled": True})
  kw = dict(mask="causal_top_left", scale=0.125)
  worst = 0.0
  chosen = cudnn.ragged_offset_bits
  for bits in (32, 64):
    cudnn.ragged_offset_bits = lambda *a, bits=bits, **k_: bits
    for name, (lens, starts, longest, extra) in (("ragged", ragged),
                                                 ("tiled", tiled)):
      s = segments(lens, starts, longest, **extra)
      o, lse = jax.jit(lambda q, k, v, s=s: cudnn.forward(q, k, v, s, **kw))(
          q, k, v)
      jax.block_until_ready(o)
      _step(f"forward {name} {bits}-bit")
      g = jax.jit(lambda q, k, v, o, lse, s=s: cudnn.backward(
          q, k, v, o, lse, do, s, **kw))(q, k, v, o, lse)
      jax.block_until_ready(g)
      _step(f"backward {name} {bits}-bit")
      with jax.default_device(cpu):
        s_cpu = segments(lens, starts, longest, **extra)
        cq, ck, cv, cdo = (cpu_in[n] for n in ("q", "k", "v", "do"))
        ro, rl = xla.forward(cq, ck, cv, s_cpu, **kw)
        rg = xla.backward(cq, ck, cv, ro, rl, cdo, s_cpu, **kw)
      for a, b in zip((o,) + tuple(g), (ro,) + tuple(rg)):
        worst = max(worst, _rel(a, b))
    # The _into variants write the rows of a second call into the first's.
    first = segments([40], [0], 40)
    rest = segments([24, 20], [40, 64], 24)
    o1, l1 = cudnn.forward(q, k, v, first, **kw)
    o2, l2 = cudnn.forward(q, k, v, rest, into=(o1, l1), **kw)
    dq1, _, _ = cudnn.backward(q, k, v, o2, l2, do, first, **kw)
    jax.block_until_ready(cudnn.backward(q, k, v, o2, l2, do, rest,
                                         dq_into=dq1, **kw))
    _step(f"_into variants {bits}-bit")
  cudnn.ragged_offset_bits = chosen
  merged = cudnn.merge_rows(jnp.zeros((1, 8, 4), jnp.float32),
                            jnp.ones((1, 3, 4), jnp.float32), 2)
  assert float(np.asarray(merged).sum()) == 12.0
  _step("merge_rows")
  print(f"sanitize_calls: every custom call ran; worst relative error "
        f"against xla {worst:.2e}")
  return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
  raise SystemExit(main())
