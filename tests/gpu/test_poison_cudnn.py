"""GPU test: the poison flag of a broken ``max_seqlen`` promise on cuDNN
(marker gpu).

A host-checked batch whose traced metadata break the bound it was checked
for reaches every cuDNN call as ``Segments.poison`` (jax_cp.cp.guard): the
handler reads the flag on the device and fills every row of every result
with NaN, with no pass over any buffer while it is clear. Each custom call
(forward, inference form, forward into, backward, backward into, a tiled
call, a backward split over head groups) with the flag set gives NaN
everywhere and with it clear the results of the same call without a flag,
bit for bit; ``cp_attention`` at cp=1 with a forged batch gives NaN output
and gradients, and with the batch as checked the float32 reference.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from tests.gpu._requires import cudnn_backend_or_skip

cudnn_backend_or_skip()

import jax_cp  # noqa: E402
from jax_cp.attention.backend import Segments  # noqa: E402
from jax_cp.attention.cudnn import workspace as cudnn_workspace  # noqa: E402
from jax_cp.attention.registry import resolve_backend  # noqa: E402
from tests import reference as ref  # noqa: E402
from tests.gpu.test_cudnn_backend import Layout, make_layout, random_inputs  # noqa: E402

CUDNN = resolve_backend("cudnn")


def _calls(layout, mask, seg=None):
  """Every kind of call on one layout: jit(q, k, v, do, poison) -> the
  results of a forward, the inference form and a backward on ``seg``
  (default: the layout's segments), then, unless ``seg`` is given, two
  forwards the second writing into the first, and two backwards the
  second writing its dq into the first's."""
  CUDNN = resolve_backend("cudnn")  # noqa: N806  (reads the scratch bound)
  tiled = seg is not None
  seg = layout.segments() if seg is None else seg
  pick = np.arange(layout.q_lens.shape[0]) % 2 == 1
  seg_a, seg_b = layout.subset(~pick), layout.subset(pick)

  @jax.jit
  def run(q, k, v, do, poison):
    put = (lambda x: x) if poison is None else (
        lambda x: dataclasses.replace(x, poison=poison))
    kw = dict(mask=mask, scale=0.1)
    o, l = CUDNN.forward(q, k, v, put(seg), **kw)
    res = [o, l, CUDNN.forward_out(q, k, v, put(seg), **kw)]
    res += CUDNN.backward(q, k, v, o, l, do, put(seg), **kw)
    if tiled:
      return res
    oa, la = CUDNN.forward(q, k, v, put(seg_a), **kw)
    oa, la = CUDNN.forward(q, k, v, put(seg_b), into=(oa, la), **kw)
    dq, dka, dva = CUDNN.backward(q, k, v, oa, la, do, put(seg_a), **kw)
    dq, dkb, dvb = CUDNN.backward(q, k, v, oa, la, do, put(seg_b),
                                  dq_into=dq, **kw)
    return res + [oa, la, dq, dka, dva, dkb, dvb]

  return run


def _check(run, q, k, v, do):
  bare = [np.asarray(x, np.float32) for x in run(q, k, v, do, None)]
  clear = [np.asarray(x, np.float32)
           for x in run(q, k, v, do, jnp.int32(0))]
  broken = [np.asarray(x, np.float32)
            for x in run(q, k, v, do, jnp.int32(1))]
  assert len(bare) >= 6
  for i, (b, c, p) in enumerate(zip(bare, clear, broken)):
    np.testing.assert_array_equal(c, b, err_msg=f"result {i}, flag clear")
    assert np.isnan(p).all(), f"result {i}: {np.isnan(p).mean():.3f} NaN"


@pytest.mark.parametrize("kind,mask", [
    ("many_short", "causal_top_left"), ("kv_longer", "causal_bottom_right"),
    ("kv_shorter", "causal_bottom_right"), ("tiny_docs", "no_mask")])
def test_every_call_poisoned_or_unchanged(kind, mask):
  layout = make_layout(kind, seed=5)
  q, k, v, do = random_inputs(layout, 8, 2, 64, jnp.bfloat16, seed=5)
  _check(_calls(layout, mask), q, k, v, do)


def test_tiled_call_poisoned_or_unchanged():
  """Rows of one document each (the dense graph without a padding
  mask)."""
  t, rows = 256, 4
  lens = np.array([256, 200, 17, 1], np.int32)
  offs = np.arange(rows, dtype=np.int32) * t
  layout = Layout(lens, lens, offs, offs, rows * t, rows * t)
  seg = Segments(*(jnp.asarray(x, jnp.int32) for x in (lens, lens, offs,
                                                        offs)), t, t,
                 tiled=True)
  q, k, v, do = random_inputs(layout, 8, 2, 64, jnp.bfloat16, seed=6)
  _check(_calls(layout, "causal_top_left", seg), q, k, v, do)


def test_head_group_backward_poisoned_or_unchanged(monkeypatch):
  """A backward past the scratch limit runs as sub-calls over head
  groups; each carries the flag."""
  monkeypatch.setenv(cudnn_workspace.SCRATCH_LIMIT_ENV, "1e-9")
  layout = make_layout("many_short", seed=7)
  q, k, v, do = random_inputs(layout, 8, 2, 64, jnp.bfloat16, seed=7)
  _check(_calls(layout, "causal_top_left"), q, k, v, do)


@pytest.mark.parametrize("window", [None, (40, 0)])
@pytest.mark.parametrize("strategy", ["no_load_balance", "dual_chunk_swap"])
def test_cp_attention_forged_batch_is_nan(strategy, window):
  """cp=1, bound 96 on a row of 512: the batch as checked gives the
  float32 reference; its metadata swapped for a row with a longer
  document (pytree ops keep the check's record) give NaN output and
  gradients on every row."""
  t, hq, hkv, d, bound = 512, 8, 2, 64, 96
  mesh = jax.make_mesh((1,), ("cp",))
  layout = jax_cp.CPLayout(mesh=mesh, cp_axis="cp", backend="cudnn",
                           strategy=strategy, max_seqlen=bound)
  cu_p = np.array([0, 90, 180, 270, 360, 450, 512], np.int32)
  cu = np.array([0, 85, 170, 252, 340, 421, 480], np.int32)
  long_cu_p = np.array([0, 90, 300, 360, 450, 512, 512], np.int32)
  long_cu = np.array([0, 90, 290, 350, 440, 490, 490], np.int32)
  rng = np.random.default_rng(8)
  mk = lambda h: jnp.asarray(rng.standard_normal((t, h, d)), jnp.bfloat16)
  q, k, v, w = mk(hq), mk(hkv), mk(hkv), mk(hq)
  batch = jax_cp.CPBatch(None, cu_p, cu, layout=layout).check_on_host()

  @jax.jit
  def run(q, k, v, b):
    def loss(q, k, v):
      out = jax_cp.cp_attention(q, k, v, b, window_size=window)
      return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2),
                                         has_aux=True)(q, k, v)
    return (out,) + grads

  got = [np.asarray(x, np.float32) for x in run(q, k, v, batch)]
  f = lambda q, k, v: ref.attention(q, k, v, cu, cu_p,
                                    window=-1 if window is None else window[0])
  want = [f(q, k, v)] + list(jax.grad(
      lambda *a: jnp.sum(f(*a) * w.astype(jnp.float32)),
      argnums=(0, 1, 2))(q, k, v))
  valid = ref.valid_token_mask(cu, cu_p)
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isfinite(g).all(), name
    assert ref.rel_err(g[valid], np.asarray(r)[valid]) < 2e-2, name

  forged = dataclasses.replace(batch, cu_seqlens_padded=jnp.asarray(long_cu_p),
                               cu_seqlens=jnp.asarray(long_cu))
  assert forged.checked_max_seqlen == bound
  for name, g in zip(("out", "dq", "dk", "dv"), run(q, k, v, forged)):
    assert np.isnan(np.asarray(g, np.float32)).all(), name
