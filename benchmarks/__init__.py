"""Benchmarks of jax_cp, run from the repository root as modules
(``python -m benchmarks.bench_cp --help``; see ``benchmarks/README.md``).

Shared modules: :mod:`benchmarks.names` (distributions, strategies, passes
and their labels), :mod:`benchmarks.workload` (rows, inputs, step
programs), :mod:`benchmarks.timing` (steady, pipelined and paired A/B
timing), :mod:`benchmarks.results` (writing and loading result files),
:mod:`benchmarks.derived` (speed-ups and shares across records),
:mod:`benchmarks.targets` (the speed targets of ``targets.json``),
:mod:`benchmarks.tables` and :mod:`benchmarks.plots` (``RESULTS.md``,
``speedup.png``), :mod:`benchmarks.weak_scaling` and
:mod:`benchmarks.scaling_report` (``bench_step --weak``, ``SCALING.md``)
and :mod:`benchmarks.profiling` (kernels of a profiler trace, collectives
of program text).
"""
