"""The examples of jax_cp (run from the repository root, e.g. ``python -m
examples.packed_lm``)."""
