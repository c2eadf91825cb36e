"""Type aliases of jax_cp's public signatures (as :mod:`jax.typing` for
JAX's): what an argument may be, for readers and type checkers.

* ``Array``: a JAX array (``jax.Array``), traced or not.
* ``ArrayLike``: anything JAX turns into an array (numpy arrays, JAX
  arrays, Python scalars): ``jax.typing.ArrayLike``.
* ``HostArray``: host (numpy) data, as the data pipeline takes it.
* ``WindowSize``: a causal sliding window ``(left, 0)``, or ``None``.
* ``DTypeLike``: a dtype or anything ``numpy.dtype`` takes.
"""

from __future__ import annotations

import jax
import numpy as np

type Array = jax.Array
type ArrayLike = jax.typing.ArrayLike
type HostArray = np.ndarray
type WindowSize = tuple[int, int] | None
type DTypeLike = jax.typing.DTypeLike

__all__ = ("Array", "ArrayLike", "DTypeLike", "HostArray", "WindowSize")
