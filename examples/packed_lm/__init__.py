"""A byte-level decoder LM trained on packed documents with context
parallelism: ``python -m examples.packed_lm --help``."""
