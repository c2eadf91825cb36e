"""Varying manual axes for the ``custom_vjp`` rules of the modules.

Inside a ``shard_map`` with ``check_vma=True`` every value has the set of
mesh axes it varies over, and a ``custom_vjp``'s backward must return
cotangents of its inputs' types. A parameter (the same on every rank)
used with a rank's tokens gets a cotangent that varies over the token
axes; so the modules first mark such a parameter as varying where the
tokens do (``lax.pcast(..., to="varying")``), whose transpose sums the
cotangent over those axes, as autodiff of plain JAX code does. Outside
``shard_map`` (no varying axes) nothing changes.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` varies over (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)     # jax 0.11
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))         # earlier releases


def vary_like(value, like):
  """``value`` marked varying over every mesh axis ``like`` varies over
  (and ``value`` does not)."""
  missing = tuple(sorted(varying_axes(like) - varying_axes(value)))
  if not missing:
    return value
  return jax.lax.pcast(value, missing, to="varying")


def vary_tree_like(tree, like):
  """:func:`vary_like` on every array leaf of ``tree``."""
  return jax.tree.map(lambda v: vary_like(v, like), tree)
