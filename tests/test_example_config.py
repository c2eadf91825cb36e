"""The example's --mlp-chunk-size and --layer-chunk-size flags reach
every layer."""

import pytest

from examples.packed_lm import config


@pytest.mark.parametrize("text,want", [("auto", "auto"), ("none", None),
                                       ("None", None), ("4096", 4096),
                                       (512, 512), (None, None)])
def test_chunk_size_values(text, want):
  assert config.parse_chunk_size(text) == want


@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "big", True])
def test_chunk_size_rejects(bad):
  with pytest.raises(ValueError, match="mlp_chunk_size"):
    config.parse_chunk_size(bad)


def test_flag_reaches_the_layers():
  from flax import nnx

  import jax_cp
  from examples.packed_lm import model as lm
  args = config.build_parser().parse_args(
      ["--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
       "--mlp-chunk-size", "48"])
  cfg = config.Config(**vars(args))
  assert cfg.mlp_chunk_size == 48
  layout = jax_cp.CPLayout(cp_axis=None)
  m = lm.PackedLM(cfg, layout, rngs=nnx.Rngs(0))
  assert all(getattr(m, f"layer_{i}").mlp_chunk_size == 48
             for i in range(2))


@pytest.mark.parametrize("bad", ["auto", "0", -2, "big"])
def test_layer_chunk_size_rejects(bad):
  with pytest.raises(ValueError, match="layer_chunk_size must be none or"):
    config.parse_chunk_size(bad, "layer_chunk_size", auto=False)


def test_layer_chunk_flag_reaches_the_layers():
  from flax import nnx

  import jax_cp
  from examples.packed_lm import model as lm
  args = config.build_parser().parse_args(
      ["--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
       "--layer-chunk-size", "4096"])
  cfg = config.Config(**vars(args))
  assert cfg.layer_chunk_size == 4096
  m = lm.PackedLM(cfg, jax_cp.CPLayout(cp_axis=None), rngs=nnx.Rngs(0))
  assert all(getattr(m, f"layer_{i}").layer_chunk_size == 4096
             for i in range(2))
  assert config.Config().layer_chunk_size is None
