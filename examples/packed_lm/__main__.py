"""``python -m examples.packed_lm [flags]`` (from the repository root)."""

import sys

from examples.packed_lm import config

config.configure_platform(config.parse_args(sys.argv[1:]))  # before jax
from examples.packed_lm import main  # noqa: E402  (imports jax)

main.main(sys.argv[1:])
