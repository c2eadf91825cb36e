"""Orbax checkpoints of the training state, with the run's config."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from examples.packed_lm.config import Config

# What a resumed run shares with the saved one: the model and the data.
RUN_KEYS = ("layers", "d_model", "heads", "kv_heads", "seq_len", "batch",
            "seed", "strategy", "max_doc_len", "doc_order")


def _gather_json(value) -> list:
  """``value`` (JSON-able) of every process, in process order."""
  if jax.process_count() == 1:
    return [value]
  raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.int32(raw.size))
  padded = np.zeros(int(np.max(sizes)), np.uint8)
  padded[:raw.size] = raw
  every = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(x[:n])) for x, n in zip(every, sizes)]


class Checkpointer:
  """The state in ``DIR/state`` (the last two kept) with the data
  iterators' state (``data_state()``: a dict by batch shard, merged over
  the processes), the run's :data:`RUN_KEYS` in ``DIR/run_config.json``
  (another run's are refused)."""

  def __init__(self, cfg: Config, data_state: Callable[[], dict]):
    self.data_state = data_state
    self.path = pathlib.Path(cfg.checkpoint_dir).resolve()
    self.path.mkdir(parents=True, exist_ok=True)
    self.every = cfg.checkpoint_every
    run = {k: getattr(cfg, k) for k in RUN_KEYS}
    cfg_file = self.path / "run_config.json"
    exists = cfg_file.exists()
    old = json.loads(cfg_file.read_text()) if exists else run
    if diff := {k: (old.get(k), v) for k, v in run.items() if old.get(k) != v}:
      raise SystemExit(f"--checkpoint-dir {self.path} holds a run with "
                       f"other settings (old, new): {diff}")
    if jax.process_count() > 1:   # everyone has read before anyone writes
      ocp.multihost.sync_global_processes("packed_lm_run_config")
    if not exists and jax.process_index() == 0:
      cfg_file.write_text(json.dumps(run, indent=1))
    self.manager = ocp.CheckpointManager(
        self.path / "state",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

  def restore(self, state) -> tuple[object, int, dict | None]:
    """``(state, step, data state)`` of the latest checkpoint, the state
    placed like ``state``, or ``(state, 0, None)``."""
    step = self.manager.latest_step()
    if step is None:
      return state, 0, None
    got = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(state), data=ocp.args.JsonRestore()))
    return got.state, step, got.data

  def save(self, step: int, state, final: bool = False) -> None:
    """Saves every ``every``-th step and the ``final`` one (then waits for
    the writes and closes), but no step up to the latest saved."""
    if (final or step % self.every == 0) and step > (
        self.manager.latest_step() or 0):
      data = {k: v for d in _gather_json(self.data_state())
              for k, v in d.items()}
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)),
                        force=final)
    if final:
      self.manager.wait_until_finished()
      self.manager.close()
