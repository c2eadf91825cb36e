"""The main example: packing of real documents, a short training run whose
loss decreases and matches the no-CP loss, and checkpoint resume."""

import json
import pathlib
import sys

import numpy as np
import pytest

import jax_cp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]
                       / "examples"))
import packed_data  # noqa: E402  pylint: disable=wrong-import-position
import train_packed_lm  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--seq-len", "64", "--batch", "2", "--dp", "2", "--cp", "2",
        "--lr", "1e-2", "--backend", "xla", "--quiet"]


def _check_rows(rows, pad_multiple):
  cu, cuP = rows.cu_seqlens, rows.cu_seqlens_padded
  lens, plens = np.diff(cu, axis=1), np.diff(cuP, axis=1)
  assert (cuP[:, -1] == rows.seq_len).all()
  assert (lens <= plens).all() and (plens % pad_multiple == 0).all()
  assert (plens - lens < pad_multiple).all()          # minimal padding
  for r in range(rows.num_rows):
    for b in np.nonzero(lens[r])[0]:
      s, n = cuP[r, b], lens[r, b]
      doc = rows.tokens[r, s:s + n]
      np.testing.assert_array_equal(rows.labels[r, s:s + n - 1], doc[1:])
      assert rows.loss_mask[r, s:s + n - 1].all()
      assert not rows.loss_mask[r, s + n - 1:cuP[r, b + 1]].any()
      np.testing.assert_array_equal(rows.position_ids[r, s:s + n],
                                    np.arange(n))


@pytest.mark.parametrize("strategy, cp, multiple", [
    ("dual_chunk_swap", 4, 8), ("no_load_balance", 4, 1)])
def test_packing_of_stdlib_sources(strategy, cp, multiple):
  rows = packed_data.load_stdlib_rows(6, 256, cp_size=cp, strategy=strategy,
                                      seed=3)
  _check_rows(rows, multiple)
  assert rows.max_seqlen <= 128                       # files cut at T/2
  text = bytes(rows.tokens[0, :rows.cu_seqlens[0, 1]].astype(np.uint8))
  assert text.isascii() or text.decode("utf-8", "ignore")
  # Deterministic, and row i does not depend on how many rows were asked.
  again = packed_data.load_stdlib_rows(3, 256, cp_size=cp, strategy=strategy,
                                       seed=3)
  np.testing.assert_array_equal(again.tokens, rows.tokens[:3])

  # The two CP views agree: rank r's slice is the r-th contiguous chunk of
  # the reordered (global-view) row.
  glob = packed_data.reorder_rows_for_cp(rows, cp, strategy)
  tl = rows.seq_len // cp
  for r in range(cp):
    local = packed_data.rows_on_cp_rank(rows, cp, r, strategy)
    for k in packed_data.PackedRows.TOKEN_FIELDS:
      np.testing.assert_array_equal(getattr(local, k),
                                    getattr(glob, k)[:, r * tl:(r + 1) * tl])
    idx = jax_cp.get_partition_indices(rows.cu_seqlens_padded[0], cp, r,
                                       strategy)
    np.testing.assert_array_equal(local.tokens[0], rows.tokens[0, idx])


def test_balanced_rows_hold_the_same_documents():
  """NO_LOAD_BALANCE rows with their documents reordered: still well-formed
  rows (labels, mask and positions per document), the same documents per
  row, and no rank's work above what it was as packed."""
  cp = 4
  packed = packed_data.load_stdlib_rows(6, 1024, cp_size=cp,
                                        strategy="no_load_balance", seed=1,
                                        max_doc_len=200)
  rows = packed_data.load_stdlib_rows(6, 1024, cp_size=cp,
                                      strategy="no_load_balance", seed=1,
                                      max_doc_len=200, balance=True)
  _check_rows(rows, 1)

  def docs(r, x):
    cu, cuP = x.cu_seqlens[r], x.cu_seqlens_padded[r]
    return sorted(x.tokens[r, cuP[b]:cuP[b] + cu[b + 1] - cu[b]].tobytes()
                  for b in range(len(cu) - 1))

  moved = 0
  for r in range(rows.num_rows):
    assert docs(r, rows) == docs(r, packed)
    moved += not np.array_equal(rows.tokens[r], packed.tokens[r])
    before, after = (jax_cp.estimate_cp_imbalance(
        x.cu_seqlens[r], x.cu_seqlens_padded[r], cp, "no_load_balance")
        for x in (packed, rows))
    assert max(after.pairs_per_rank) <= max(before.pairs_per_rank)
  assert moved                                  # the order did change
  # DUAL_CHUNK_SWAP rows are left as packed.
  dcs = [packed_data.load_stdlib_rows(2, 512, cp_size=2, seed=1,
                                      balance=b) for b in (False, True)]
  np.testing.assert_array_equal(dcs[0].tokens, dcs[1].tokens)


def test_no_load_balance_on_balanced_rows_matches_no_cp():
  got = train_packed_lm.main(TINY + ["--steps", "2", "--strategy",
                                     "no_load_balance"])
  assert got["doc_order"] == "balanced"
  assert np.isfinite(got["losses"]).all()
  assert got["eval_loss_cp"] == pytest.approx(got["eval_loss_nocp"],
                                              rel=1e-4)


def test_long_documents_are_split_across_rows():
  docs = [np.arange(1, 101, dtype=np.int32), np.arange(1, 6, dtype=np.int32)]
  rows = packed_data.pack_documents(iter(docs * 3), seq_len=64, num_rows=3,
                                    pad_multiple=4)
  _check_rows(rows, 4)
  # Row 0 is the head of document 0, row 1 starts with its tail.
  np.testing.assert_array_equal(rows.cu_seqlens_padded[0, :2], [0, 64])
  np.testing.assert_array_equal(rows.tokens[1, :36], np.arange(65, 101))


def test_training_runs_decreases_and_resumes(tmp_path):
  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
  first = train_packed_lm.main(TINY + ckpt + ["--steps", "2", "--no-compare"])
  assert first["start_step"] == 0 and len(first["losses"]) == 2
  assert (tmp_path / "ckpt" / "state").is_dir()

  # The state was saved sharded (FSDP, the default); it resumes into
  # replicated parameters just as well.
  second = train_packed_lm.main(TINY + ckpt + ["--steps", "6",
                                               "--param-sharding",
                                               "replicated"])
  assert second["start_step"] == 2                    # resumed
  assert first["param_sharding"] == "fsdp"
  losses = first["losses"] + second["losses"]
  assert len(losses) == 6 and np.isfinite(losses).all()
  assert losses[-1] < losses[0] - 0.5, losses
  # The final params give the same loss with and without CP.
  assert second["eval_loss_cp"] == pytest.approx(second["eval_loss_nocp"],
                                                 rel=1e-4)


def test_linen_api_resumes_an_nnx_checkpoint(tmp_path):
  """--api linen trains the same model: the NNX run's checkpoint (the same
  parameter tree) resumes in Linen, and its CP and no-CP losses agree."""
  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
  first = train_packed_lm.main(TINY + ckpt + ["--steps", "2", "--no-compare"])
  assert first["api"] == "nnx"
  second = train_packed_lm.main(TINY + ckpt + ["--steps", "3", "--api",
                                               "linen", "--strategy",
                                               "dual_chunk_swap"])
  assert second["api"] == "linen" and second["start_step"] == 2
  assert np.isfinite(second["losses"]).all()
  assert second["losses"][0] < first["losses"][0]
  assert second["eval_loss_cp"] == pytest.approx(second["eval_loss_nocp"],
                                                 rel=1e-4)


def test_checkpoint_config_without_doc_order_resumes(tmp_path):
  """A run saved before --doc-order existed (its rows as packed) resumes a
  DUAL_CHUNK_SWAP run, whose rows are never reordered; NO_LOAD_BALANCE on
  balanced rows is another run and is refused."""
  d = tmp_path / "ckpt"
  train_packed_lm.main(TINY + ["--checkpoint-dir", str(d), "--steps", "1",
                               "--no-compare"])
  cfg = json.loads((d / "run_config.json").read_text())
  assert cfg.pop("doc_order") == "packed"
  (d / "run_config.json").write_text(json.dumps(cfg))
  got = train_packed_lm.main(TINY + ["--checkpoint-dir", str(d), "--steps",
                                     "2", "--no-compare"])
  assert got["start_step"] == 1 and got["doc_order"] == "packed"
  with pytest.raises(SystemExit, match="doc_order"):
    train_packed_lm.main(TINY + ["--checkpoint-dir", str(d), "--steps", "3",
                                 "--strategy", "no_load_balance"])


def test_checkpoint_dir_of_another_run_is_refused(tmp_path):
  d = tmp_path / "ckpt"
  d.mkdir()
  (d / "run_config.json").write_text('{"d_model": 999}')
  with pytest.raises(SystemExit, match="other settings"):
    train_packed_lm.main(TINY + ["--checkpoint-dir", str(d), "--steps", "1"])


def test_checkpoint_at_the_last_step_and_report(tmp_path):
  """--checkpoint-every dividing --steps: the final save does not repeat the
  step already saved (orbax refused it); --report writes the result."""
  report = tmp_path / "out" / "report.json"
  got = train_packed_lm.main(TINY + [
      "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1",
      "--steps", "1", "--no-compare", "--report", str(report)])
  assert (tmp_path / "ckpt" / "state" / "1").is_dir()
  assert json.loads(report.read_text()) == got
  assert got["num_processes"] == 1 and got["local_rows"] == [0, 1]
