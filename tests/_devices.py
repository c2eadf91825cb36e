"""Devices for the tests that build meshes.

A test that needs more devices of its platform than the machine has skips,
with a reason that starts with :data:`SKIP_PREFIX` and names the count
(``tests/gpu/run_gpu_suite.sh`` counts these skips):

* :func:`devices` inside a test (or a mesh helper): the first ``n`` devices,
  or a skip; for counts that depend on a parameter;
* :func:`requires_devices`, a mark (handled in ``tests/conftest.py``), for a
  test whose count is fixed.

``platform`` is a JAX platform name (``"cpu"``, ``"gpu"``); None is JAX's
default backend, the one ``jax.devices()`` lists.
"""

from __future__ import annotations

import jax
import pytest

SKIP_PREFIX = "requires_devices:"


def _available(platform: str | None) -> list:
  try:
    return list(jax.devices(platform))
  except RuntimeError:          # no such platform here
    return []


def skip_reason(n: int, platform: str | None = None) -> str | None:
  """Why a test needing ``n`` devices of ``platform`` cannot run here, or
  None when it can."""
  have = len(_available(platform))
  if have >= n:
    return None
  name = platform
  if name is None:
    try:
      name = jax.default_backend()
    except RuntimeError:
      name = "default"
  return f"{SKIP_PREFIX} needs {n} {name} devices, {have} present"


def devices(n: int, platform: str | None = None) -> list:
  """The first ``n`` devices of ``platform``; skips the calling test when
  there are fewer."""
  reason = skip_reason(n, platform)
  if reason is not None:
    pytest.skip(reason)
  return _available(platform)[:n]


def requires_devices(n: int, platform: str | None = None):
  """The mark ``requires_devices(n, platform=...)``: the test skips where
  fewer than ``n`` devices of ``platform`` exist."""
  return pytest.mark.requires_devices(n, platform=platform)


def cp_mesh(cp: int, platform: str | None = None):
  """A 1-D ``("cp",)`` mesh over the first ``cp`` devices of ``platform``
  (Auto axes); skips the calling test when there are fewer."""
  return jax.make_mesh((cp,), ("cp",), devices=devices(cp, platform),
                       axis_types=(jax.sharding.AxisType.Auto,))
