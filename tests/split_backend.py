"""The ``xla`` backend with ``split_bottom_right_backward=True``, registered
as ``"xla_split"``: the CP planner then runs the backward of every
bottom-right block as an unmasked rectangle and a top-left triangle, as
it does on the cudnn backend, so that path runs on CPU and is compared
with the plain ``xla`` backend and the reference.

Importing this module registers the backend.
"""

import dataclasses

from jax_cp.attention import register_backend, xla

#: The name to pass as ``CPLayout(backend=...)``.
SPLIT_XLA = "xla_split"

BACKEND = dataclasses.replace(xla.BACKEND, name=SPLIT_XLA,
                              split_bottom_right_backward=True)
register_backend(BACKEND)
