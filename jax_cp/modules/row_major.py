"""A layer input held in row-major layout on GPU (:func:`row_major`).

Under a scan over the layers (``nnx.scan``, ``nn.scan``) the inputs that
the layers' rematerialization keeps form one ``[L, ..., T, E]`` stack, the
largest buffer of a long row's training step. Left free, XLA:GPU's layout
assignment gives the backward loop's stack the layout that the re-run
layer's weight-gradient matmuls read (``E`` major, tokens minor) and
transposes the whole stack before the loop, a second copy of it (for the
16 x 2048 model at 786k tokens per rank, 51.5 GB). Fixing the layout of
the layer's input inside the checkpointed layer keeps the stack as the
forward saved it; any transposition then happens in the loop, one layer
at a time.

The fix is a primitive of its own: the identity everywhere (eager calls
included, so no array is committed to a device by it) except in programs
lowered for GPUs, where it is a layout constraint.
"""

from __future__ import annotations

from jax.experimental.layout import Layout, with_layout_constraint
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

row_major_p = Primitive("jax_cp_row_major")
row_major_p.def_impl(lambda x: x)
row_major_p.def_abstract_eval(lambda x: x)
ad.deflinear2(row_major_p, lambda ct, _: [row_major_p.bind(ct)])
batching.primitive_batchers[row_major_p] = \
    lambda args, dims: (row_major_p.bind(args[0]), dims[0])


def _pinned(x):
  return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


mlir.register_lowering(row_major_p,
                       mlir.lower_fun(lambda x: x, multiple_results=False))
for _platform in ("cuda", "rocm"):
  mlir.register_lowering(row_major_p,
                         mlir.lower_fun(_pinned, multiple_results=False),
                         platform=_platform)


def row_major(x):
  """``x`` in row-major layout where the program runs on GPUs; ``x`` as it
  is elsewhere (the module docstring)."""
  return row_major_p.bind(x)
