"""A byte-level decoder LM trained on packed documents with context
parallelism: ``python -m examples.packed_lm --help``.

``config`` (settings and flags), ``model`` (the NNX model), ``data`` (rows
of standard-library files, prefetching), ``train`` (loss, step, loop),
``checkpoint`` (orbax) and ``main`` (the run). Importing this package
imports no jax: ``config`` sets the platform up before jax starts.
"""
