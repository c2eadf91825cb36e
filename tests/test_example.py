"""The example package ``examples/packed_lm``: its flags and defaults, its
grain pipeline of standard-library files (aligned rows, per batch shard,
resumable state), a short training run whose loss decreases and matches
the no-CP loss, and resuming from a checkpoint (with the check of the
run's config)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from examples.packed_lm import config, data, main, model
from jax_cp import CPLayout
from jax_cp.data import balance_rows
from jax_cp.planning import estimate_cp_imbalance
from tests._devices import requires_devices

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--seq-len", "64", "--batch", "2", "--dp", "2", "--cp", "2",
        "--lr", "1e-2", "--backend", "xla", "--quiet"]


def test_dtype_defaults_to_bfloat16_on_gpu_and_float32_on_cpu():
  assert config.parse_args([]).dtype == "float32"
  assert config.parse_args(["--device", "gpu"]).dtype == "bfloat16"
  assert config.parse_args(["--device", "gpu", "--dtype",
                            "float32"]).dtype == "float32"
  assert config.Config(device="gpu").dtype == "bfloat16"
  text = " ".join(config.build_parser().format_help().split())
  assert "bfloat16 on GPU, float32 on CPU" in text


def test_config_sets_the_platform_up_before_jax_is_imported():
  code = ("import os, sys; from examples.packed_lm import config; "
          "assert 'jax' not in sys.modules; "
          "config.configure_platform(config.parse_args(['--cp', '8'])); "
          "print(os.environ['JAX_PLATFORMS'], os.environ['XLA_FLAGS'])")
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True,
                       cwd=pathlib.Path(__file__).resolve().parents[1])
  assert out.stdout.split() == [
      "cpu", "--xla_force_host_platform_device_count=16"]


def test_defaults_that_follow_other_flags():
  cfg = config.parse_args(["--seq-len", "256", "--d-model", "1024",
                           "--steps", "60"])
  assert cfg.max_doc_len == 128 and cfg.lr == pytest.approx(0.6 / 1024)
  assert cfg.warmup == 6 and cfg.remat == "none"
  assert cfg.doc_order == "packed"          # dual_chunk_swap: never reordered
  assert config.parse_args(["--strategy", "no_load_balance"]).doc_order == \
      "balanced"
  with pytest.raises(SystemExit):
    config.parse_args(["--remat", "everything"])
  with pytest.raises(ValueError, match="remat='everything'"):
    config.Config(remat="everything")


def test_remat_flag_takes_the_library_presets_and_reaches_every_layer():
  from jax_cp.modules.remat import PRESETS
  assert config.REMAT == tuple(PRESETS)
  cfg = config.Config(layers=2, d_model=32, heads=2, kv_heads=1,
                      remat="save_context")
  lm = model.PackedLM(cfg, model.make_layout(cfg), rngs=nnx.Rngs(0))
  assert [lm.layer_0.remat, lm.layer_1.remat] == ["save_context"] * 2


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_grain_rows_of_stdlib_files_are_aligned_deterministic_and_resume():
  cfg = config.Config(seq_len=256, seed=3, batch=2)
  it = iter(data.shard_pipeline(cfg, 4, 2))
  first = _take(it, 2)
  state = it.get_state()
  after = _take(it, 3)
  it.close()
  for rows in first + after:
    assert rows.tokens.shape == (2, 256)
    plens = np.diff(rows.cu_seqlens_padded, axis=1)
    assert (plens % 8 == 0).all() and rows.max_seqlen <= 128   # cut at T/2
    assert rows.cu_seqlens.shape == (2, data.MAX_DOCS + 1)
    # Aligned by grain: each document's valid tokens start its slot, and
    # the labels are its next bytes.
    for r in range(2):
      for a, n in zip(rows.cu_seqlens_padded[r, :-1],
                      np.diff(rows.cu_seqlens[r])):
        np.testing.assert_array_equal(rows.labels[r, a:a + n - 1],
                                      rows.tokens[r, a + 1:a + n])
        assert rows.loss_mask[r, a:a + n].sum() == max(n - 1, 0)
  text = bytes(first[0].tokens[0, :first[0].cu_seqlens[0, 1]].astype(
      np.uint8))
  assert text.decode("utf-8", "replace").strip()
  # The same seed gives the same rows; the saved state resumes the stream
  # where it was.
  again = iter(data.shard_pipeline(cfg, 4, 2))
  np.testing.assert_array_equal(next(again).tokens, first[0].tokens)
  again.set_state(state)
  for want in after:
    np.testing.assert_array_equal(next(again).tokens, want.tokens)
  again.close()


def test_batches_are_the_shards_rows_in_global_order_with_their_state():
  """dp=2: shard s reads every other file from s on; a process holding
  both shards gets both shards' rows, in order, and its state resumes
  each."""
  cfg = config.Config(seq_len=128, seed=1, batch=4)
  both = data.Batches(cfg, 2, [0, 1], 2)
  got = _take(both, 2)
  state = both.get_state()
  later = next(both)
  both.close()
  shard1 = iter(data.shard_pipeline(cfg, 2, 2, 1, 2))
  rows1 = _take(shard1, 3)
  shard1.close()
  for step, rows in enumerate(got):
    assert rows.tokens.shape == (4, 128)
    np.testing.assert_array_equal(rows.tokens[2:], rows1[step].tokens)
  one = data.Batches(cfg, 2, [1], 2)    # another process, shard 1 only
  one.set_state(state)
  np.testing.assert_array_equal(next(one).tokens, later.tokens[2:])
  np.testing.assert_array_equal(later.tokens[2:], rows1[2].tokens)
  one.close()
  files = data.stdlib_files()
  docs0 = data.documents(cfg, 0, 2, files)
  docs1 = data.documents(cfg, 1, 2, files)
  whole = data.documents(cfg, 0, 1, files)
  for i in range(5):   # None: a file too short, dropped by grain
    for got_doc, want in ((docs0[i], whole[2 * i]),
                          (docs1[i], whole[2 * i + 1])):
      assert (got_doc is None) == (want is None)
      if want is not None:
        np.testing.assert_array_equal(got_doc["tokens"], want["tokens"])


def test_balanced_doc_order_is_the_library_balancing_of_the_packed_rows():
  cfg = dict(seq_len=1024, seed=0, max_doc_len=512, batch=4,
             strategy="no_load_balance")
  it = iter(data.shard_pipeline(config.Config(**cfg, doc_order="packed"),
                                4, 4))
  packed = next(it)
  it.close()
  it = iter(data.shard_pipeline(config.Config(**cfg), 4, 4))
  rows = next(it)
  it.close()
  layout = CPLayout(cp_size=4, strategy="no_load_balance")
  want = balance_rows(packed, layout)
  for k in ("tokens", "labels", "cu_seqlens", "cu_seqlens_padded"):
    np.testing.assert_array_equal(getattr(rows, k), getattr(want, k))
  assert not np.array_equal(rows.tokens, packed.tokens)
  # And it balances: no row's busiest rank has more (query, key) pairs.
  for r in range(4):
    work = [max(estimate_cp_imbalance(
        x.cu_seqlens[r], x.cu_seqlens_padded[r], layout).pairs_per_rank)
            for x in (packed, rows)]
    assert work[1] <= work[0], r


@requires_devices(4)  # TINY's dp=2 x cp=2 mesh
def test_no_load_balance_on_balanced_rows_matches_no_cp():
  got = main.main(TINY + ["--steps", "2", "--strategy", "no_load_balance"])
  assert got["doc_order"] == "balanced" and np.isfinite(got["losses"]).all()
  assert got["eval_loss_cp"] == pytest.approx(got["eval_loss_nocp"],
                                              rel=1e-4)


@requires_devices(4)  # TINY's dp=2 x cp=2 mesh
def test_training_decreases_resumes_and_matches_no_cp(tmp_path):
  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
  first = main.main(TINY + ckpt + ["--steps", "2", "--no-compare"])
  assert first["start_step"] == 0 and len(first["losses"]) == 2
  assert first["param_sharding"] == "fsdp" and first["dtype"] == "float32"
  assert (tmp_path / "ckpt" / "state" / "2").is_dir()
  # The state was saved sharded (FSDP); it resumes into replicated
  # parameters just as well.
  second = main.main(TINY + ckpt + ["--steps", "6", "--param-sharding",
                                    "replicated"])
  assert second["start_step"] == 2
  losses = first["losses"] + second["losses"]
  assert len(losses) == 6 and np.isfinite(losses).all()
  assert losses[-1] < losses[0] - 0.5, losses
  # The final parameters give the same loss with and without CP.
  assert second["eval_loss_cp"] == pytest.approx(second["eval_loss_nocp"],
                                                 rel=1e-4)


@requires_devices(4)  # TINY's dp=2 x cp=2 mesh
def test_checkpoint_dir_of_another_run_is_refused(tmp_path):
  d = tmp_path / "ckpt"
  d.mkdir()
  saved = {k: v for k, v in vars(config.parse_args(TINY)).items()
           if k in ("layers", "d_model", "heads", "kv_heads", "seq_len",
                    "batch", "seed", "strategy", "max_doc_len", "doc_order")}
  (d / "run_config.json").write_text(json.dumps(saved | {"d_model": 999}))
  with pytest.raises(SystemExit, match=r"other settings.*'d_model': \(999"):
    main.main(TINY + ["--checkpoint-dir", str(d), "--steps", "1"])
  # Another strategy reorders the rows: another run, refused too.
  (d / "run_config.json").write_text(json.dumps(saved))
  with pytest.raises(SystemExit, match="'doc_order': \\('packed', "
                     "'balanced'\\)"):
    main.main(TINY + ["--checkpoint-dir", str(d), "--steps", "1",
                      "--strategy", "no_load_balance"])


@requires_devices(4)  # TINY's dp=2 x cp=2 mesh
def test_checkpoint_at_the_last_step_and_report(tmp_path):
  """--checkpoint-every dividing --steps: the final save does not repeat
  the step already saved (orbax refuses it); --report writes the result."""
  report = tmp_path / "out" / "report.json"
  got = main.main(TINY + [
      "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
      "--steps", "1", "--no-compare", "--report", str(report)])
  assert (tmp_path / "ckpt" / "state" / "1").is_dir()
  assert json.loads(report.read_text()) == got
  assert got["num_processes"] == 1 and got["local_rows"] == [0, 1]
