"""Every Python block of docs/model.md runs as a test, as written (8
virtual CPU devices), its results checked against independent
references."""

from __future__ import annotations

import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cp
from tests import reference as ref
from tests._devices import requires_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "model.md").read_text()
PYTHON = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)


def _heading_of(code: str) -> str:
  before = PAGE[:PAGE.index(code)]
  return re.findall(r"^## (.+)$", before, flags=re.M)[-1]


def _run(code: str) -> dict:
  namespace: dict = {}
  exec(compile(code, "docs/model.md", "exec"), namespace)  # noqa: S102
  return namespace


def test_the_page_has_its_blocks_and_is_linked():
  assert [_heading_of(c) for c in PYTHON] == [
      "Four calls to a training step", "Token-axis operations",
      "Fixed slot counts", "`seq_dim`"]
  assert "docs/model.md" in (ROOT / "README.md").read_text()
  for path in re.findall(r"`((?:examples|tests)/[\w/]+\.py)`", PAGE):
    assert (ROOT / path).exists(), path


@requires_devices(8)
def test_four_calls(capsys):
  ns = _run(PYTHON[0])
  rows, batch, layout = ns["rows"], ns["batch"], ns["layout"]
  assert batch.checked_max_seqlen == layout.max_seqlen == 40
  # A row's trailing padding, longer than the bound, is no document.
  assert (ns["seg"] == 0).sum(axis=1).max() > layout.max_seqlen
  loss, grads, params = ns["loss"], ns["grads"], ns["params"]
  # The same parameters without CP, on the rows in physical order, with
  # plain masked attention in place of jax_cp's attention_fn.
  def dense(query, key, value, bias=None, mask=None, **unused):
    del bias, mask, unused
    return ref.batched_attention(query, key, value, rows.cu_seqlens,
                                 rows.cu_seqlens_padded)
  ns["jax_cp"] = types.SimpleNamespace(cp_attention_fn=lambda _: dense)
  plain = jax_cp.CPBatch(
      tensors={k: jnp.asarray(v) for k, v in rows.tensors.items()},
      cu_seqlens_padded=rows.cu_seqlens_padded, cu_seqlens=rows.cu_seqlens,
      layout=jax_cp.CPLayout(cp_axis=None))
  host = jax.tree.map(np.asarray, params)   # off the mesh
  want, want_grads = jax.jit(jax.value_and_grad(ns["loss_fn"]))(host, plain)
  assert float(loss) > 1.0
  assert float(loss) == pytest.approx(float(want), rel=1e-5)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == len(jax.tree.leaves(want_grads)) >= 10
  total = np.sqrt(sum(float(jnp.sum(w ** 2))
                      for w in jax.tree.leaves(want_grads)))
  for g, w in zip(leaves, jax.tree.leaves(want_grads)):
    # The key projection's bias has a zero gradient (a softmax does not
    # see a constant added to all its scores): its rounding is measured
    # against the whole gradient.
    err = float(jnp.linalg.norm(g - w))
    assert err <= 1e-5 * float(jnp.linalg.norm(w)) + 1e-7 * total
  assert capsys.readouterr().out.strip() == f"{float(loss)}"


@requires_devices(8)
def test_per_document_cumsum():
  ns = _run(PYTHON[1])
  rows, layout, batch = ns["rows"], ns["layout"], ns["batch"]
  seen = jax_cp.data.restore_from_cp(np.asarray(ns["seen"]),
                                     rows.cu_seqlens_padded, layout,
                                     seq_dim=1)
  want = np.zeros_like(rows.loss_mask)
  for r in range(2):
    cuP = rows.cu_seqlens_padded[r]
    for b in range(len(cuP) - 1):
      s = slice(cuP[b], cuP[b + 1])
      want[r, s] = np.cumsum(rows.loss_mask[r, s])
  np.testing.assert_array_equal(seen, want)
  assert want.max() > 10
  # A cumsum in the layout's order raises on Explicit axes, as the page
  # says.
  with jax.set_mesh(ns["mesh"]), pytest.raises(Exception,
                                               match="axis being reduced"):
    jax.jit(lambda m: jnp.cumsum(m, axis=1))(batch.tensors["loss_mask"])


def test_fixed_slot_counts():
  ns = _run(PYTHON[2])
  a, b = ns["a"], ns["b"]
  # Short documents need many slots, long ones few: the same shape only
  # because max_docs fixes it; the count each batch needs differs.
  used = lambda r: int((np.diff(r.cu_seqlens_padded, axis=1) > 0).sum(1)
                       .max())
  assert used(a) > 2 * used(b)
  seg = ns["segment_ids"](32)
  fit = jax_cp.data.rows_from_segment_ids(seg, seg)
  assert fit.cu_seqlens.shape != a.cu_seqlens.shape
  # Fewer slots than a row needs raise, naming the row.
  with pytest.raises(ValueError, match="row 0"):
    jax_cp.data.rows_from_segment_ids(seg, seg, max_docs=4)


def test_seq_dim():
  ns = _run(PYTHON[3])
  x, y, h = ns["x"], ns["y"], ns["h"]
  assert not (x == y).all()            # DUAL_CHUNK_SWAP moved tokens
  # The default token dim of [B, E, T] is 1 (E = 3 tokens): it raises,
  # naming seq_dim, in every function that takes it.
  data, cuP, layout = jax_cp.data, ns["cuP"], ns["layout"]
  for call in (lambda: data.reorder_for_cp(h, cuP, layout),
               lambda: data.restore_from_cp(h, cuP, layout),
               lambda: data.get_batch_on_this_cp_rank(
                   cuP, h, layout=layout, cp_rank=0)):
    with pytest.raises(ValueError, match="seq_dim=1"):
      call()
