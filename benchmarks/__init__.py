"""Benchmarks of jax_cp, run from the repository root as modules
(``python -m benchmarks.bench_cp --help``; see ``benchmarks/README.md``).

Shared modules: :mod:`benchmarks.workload` (rows, inputs, step programs),
:mod:`benchmarks.timing` (steady, pipelined and paired A/B timing) and
:mod:`benchmarks.reporting` (result files, tables, ``RESULTS.md``).
"""
