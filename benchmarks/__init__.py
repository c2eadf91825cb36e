"""Benchmarks of jax_cp, run from the repository root as modules
(``python -m benchmarks.bench_cp --help``; ``benchmarks/README.md``).

Commands: :mod:`~benchmarks.bench_fused`, :mod:`~benchmarks.bench_cp`,
:mod:`~benchmarks.bench_step`, :mod:`~benchmarks.bench_memory` and
:mod:`~benchmarks.results` (the tables). The shared base they import:
:mod:`~benchmarks.workload` (rows, meshes, inputs, FLOPs),
:mod:`~benchmarks.timing` (paired A/B), :mod:`~benchmarks.results` (result
files, tables), :mod:`~benchmarks.profiling` (kernels of a trace),
:mod:`~benchmarks.exactness` (the subset reference), and for
``bench_memory`` :mod:`~benchmarks.hlo_flops`,
:mod:`~benchmarks.buffer_breakdown`, :mod:`~benchmarks.deviceless` and
:mod:`~benchmarks.standin_attention`.
"""
