"""cp_attention on a dp=2 x cp=4 mesh of 8 GPUs, backend="cudnn" (marker
gpu; skipped below 8 GPUs).

* The example's mesh (``examples/packed_lm/main.make_mesh``) puts each cp
  group on 4 consecutive GPUs, and ``nvidia-smi topo -m`` links every pair
  of a group by NVLink (``NV<n>``): the K/V exchange stays on NVLink, the
  data axis spans the groups.
* Two rows of different layouts, one per data shard: every device holds
  its row's cp chunk only, and the forward and the gradients match plain
  float32 attention on the unpartitioned rows, both strategies, with and
  without a sliding window.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cp
from jax_cp import CPLayout
from jax_cp import CPLoadBalancingStrategy as S
from jax_cp.data import reorder_for_cp, restore_from_cp
from tests import reference as ref
from tests._devices import requires_devices

pytestmark = [pytest.mark.gpu, requires_devices(8, "gpu")]

DP, CP = 2, 4
T, HQ, HKV, D = 4096, 8, 2, 128
TOL = 2e-2   # bf16 inputs, float32 reference


def nvlink_matrix(text: str) -> dict[tuple[int, int], str]:
  """``{(i, j): link}`` between GPUs ``i`` and ``j`` in ``nvidia-smi topo
  -m``'s matrix (``X``, ``NV18``, ``SYS``, ``PIX``, ...). Its header lists
  the GPU columns first; each GPU row starts with its name."""
  is_gpu = re.compile(r"GPU(\d+)").fullmatch
  rows = [line.split() for line in text.splitlines()]
  header = next((r for r in rows if len(r) > 1 and is_gpu(r[0])
                 and is_gpu(r[1])), [])
  cols = [int(is_gpu(c).group(1)) for c in itertools.takewhile(is_gpu,
                                                               header)]
  return {(int(is_gpu(r[0]).group(1)), j): link
          for r in rows if r is not header and r and is_gpu(r[0])
          for j, link in zip(cols, r[1:])}


def _physical(ids):
  """The ``nvidia-smi`` indices of JAX's GPU ids (through a numeric
  ``CUDA_VISIBLE_DEVICES``)."""
  visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES",
                                               "").split(",") if d.strip()]
  if visible and all(d.isdigit() for d in visible):
    return [int(visible[i]) for i in ids]
  return list(ids)


def _mesh():
  from examples.packed_lm import main  # pylint: disable=import-outside-toplevel
  return main.make_mesh(DP, CP, "gpu")


def test_cp_groups_are_consecutive_nvlink_neighbours():
  mesh = _mesh()
  ids = [[d.id for d in row] for row in mesh.devices]
  assert dict(mesh.shape) == {"data": DP, "cp": CP}
  assert ids == [[0, 1, 2, 3], [4, 5, 6, 7]], ids
  smi = shutil.which("nvidia-smi")
  if smi is None:
    pytest.skip("nvidia-smi missing: the NVLink topology is not checked")
  links = nvlink_matrix(subprocess.run([smi, "topo", "-m"], check=True,
                                       capture_output=True, text=True).stdout)
  for row in ids:
    phys = _physical(row)
    for a in phys:
      for b in phys:
        if a != b:
          assert links.get((a, b), "").startswith("NV"), (a, b, links)


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("strategy", list(S), ids=lambda s: s.value)
def test_dp_cp_attention_matches_reference(strategy, window):
  pytest.importorskip("jax_cp.attention.cudnn.backend")
  check_dp_cp_attention(_mesh(), strategy, window, "cudnn", TOL)


def check_dp_cp_attention(mesh, strategy, window, backend: str, tol: float,
                          t: int = T, dtype=jnp.bfloat16):
  """Forward and gradients of two rows (one per data shard) on ``mesh``
  against :func:`tests.reference.batched_attention`, and each device
  holding exactly its row's cp chunk."""
  dp, cp = mesh.shape["data"], mesh.shape["cp"]
  rng = np.random.default_rng(7 + (window or 0) + len(strategy.value))
  cu, cuP = map(np.stack, zip(*[ref.random_layout(
      rng, t, cp, kind, dual_chunk=strategy is S.DUAL_CHUNK_SWAP,
      max_docs=96) for kind in ("one_long", "mixed")[:dp]]))
  q = jnp.asarray(rng.standard_normal((dp, t, HQ, D)), dtype)
  k = jnp.asarray(rng.standard_normal((dp, t, HKV, D)), dtype)
  v = jnp.asarray(rng.standard_normal((dp, t, HKV, D)), dtype)
  w = jnp.asarray(rng.standard_normal((dp, t, HQ, D)), jnp.float32)
  spec = NamedSharding(mesh, P("data", "cp"))
  layout = CPLayout(mesh=mesh, batch_axis="data", backend=backend,
                    strategy=strategy,
                    max_seqlen=int(np.diff(cuP, axis=-1).max()))
  re_ = lambda x: jax.device_put(reorder_for_cp(x, cuP, layout, seq_dim=1),
                                 spec)
  back = lambda x: np.asarray(restore_from_cp(
      jax.device_get(x), cuP, layout, seq_dim=1), np.float32)
  attn = functools.partial(
      jax_cp.cp_attention, layout=layout,
      window_size=None if window is None else (window, 0))
  loss = lambda q, k, v, w: jnp.sum(
      attn(q, k, v, (cu, cuP)).astype(jnp.float32) * w)
  args = [re_(x) for x in (q, k, v)]
  out = jax.jit(lambda q, k, v: attn(q, k, v, (cu, cuP)))(*args)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args, re_(w))
  # Device (i, j) of the mesh holds row i's j-th chunk of T / cp tokens.
  for shard in out.addressable_shards:
    (i, j), = zip(*np.nonzero(mesh.devices == shard.device))
    assert shard.index[0] == slice(i, i + 1), (shard.device, shard.index)
    assert shard.index[1] == slice(j * t // cp, (j + 1) * t // cp)
  with jax.default_device(mesh.devices.flat[0]):
    f = lambda q, k, v: ref.batched_attention(
        q, k, v, cu, cuP, window=-1 if window is None else window)
    want = f(q, k, v)
    want_g = jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(
        q, k, v)
  valid = np.stack([ref.valid_token_mask(cu[i], cuP[i]) for i in range(dp)])
  for name, got, exp in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads),
                            (want,) + tuple(want_g)):
    got = back(got)
    exp = np.asarray(exp, np.float32)
    assert np.isfinite(got).all(), name
    for row in range(dp):
      err = ref.rel_err(got[row][valid[row]], exp[row][valid[row]])
      assert err < tol, (name, row, err)
    np.testing.assert_array_equal(got[~valid], 0.0, err_msg=name)
