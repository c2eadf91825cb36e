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


@pytest.mark.parametrize("field, value", [("mlp_chunk_size", 48),
                                          ("layer_chunk_size", 4096)])
def test_flag_reaches_the_layers(field, value):
  from flax import nnx

  import jax_cp
  from examples.packed_lm import model as lm
  args = config.build_parser().parse_args(
      ["--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
       "--" + field.replace("_", "-"), str(value)])
  cfg = config.Config(**vars(args))
  assert getattr(cfg, field) == value
  layout = jax_cp.CPLayout(cp_axis=None)
  m = lm.PackedLM(cfg, layout, rngs=nnx.Rngs(0))
  assert all(getattr(getattr(m, f"layer_{i}"), field) == value
             for i in range(2))


def test_layer_chunks_are_off_by_default():
  assert config.Config().layer_chunk_size is None


@pytest.mark.parametrize("bad", ["auto", "0", -2, "big"])
def test_layer_chunk_size_rejects(bad):
  with pytest.raises(ValueError, match="layer_chunk_size must be none or"):
    config.parse_chunk_size(bad, "layer_chunk_size", auto=False)
