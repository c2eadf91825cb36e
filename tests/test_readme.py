"""The README's API tour runs as written (8 virtual CPU devices)."""

import pathlib
import re

import jax
import numpy as np

from tests._devices import requires_devices

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@requires_devices(8)
def test_readme_api_tour_runs(capsys):
  text = README.read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
  tour = next(b for b in blocks if "jax_cp.cp_attention(" in b)
  namespace = {}
  exec(compile(tour, "README.md:api-tour", "exec"), namespace)  # noqa: S102
  out = namespace["out"]
  assert out.shape == (2, 192, 8, 64)
  assert jax.numpy.isfinite(out).all()
  assert namespace["ids_r"].shape == (48,)
  rows = namespace["rows"]
  assert rows.tokens.shape == (2, 192) and namespace["step_flops"] > 6e6 * 384
  assert namespace["batch"].checked_max_seqlen is not None
  # The NNX layer's loss and gradients, Flax's attention with the drop-in
  # attention_fn, and the Linen layer on the NNX parameters.
  assert jax.numpy.isfinite(namespace["loss"])
  assert namespace["y"].shape == (2, 192, 256)
  batch = namespace["batch"]
  with jax.set_mesh(namespace["mesh"]):
    y_nnx = namespace["model"](batch.tensors["x"], batch)
  np.testing.assert_allclose(namespace["y_linen"], y_nnx, rtol=1e-5,
                             atol=1e-5)
  assert "another CPLayout" in capsys.readouterr().out
  # The layer in chunks of the row equals the same layer on the whole row.
  whole = namespace["chunked"].clone(layer_chunk_size=None)
  np.testing.assert_allclose(
      namespace["y_chunks"],
      whole.apply(namespace["params_1"], namespace["x"][0],
                  namespace["cu_seqlens"], namespace["cu_seqlens_padded"]),
      rtol=1e-5, atol=1e-5)
