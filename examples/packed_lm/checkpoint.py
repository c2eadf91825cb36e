"""Orbax checkpoints of the training state, with the run's config."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import orbax.checkpoint as ocp

from examples.packed_lm.config import Config

# The settings a resumed run must share with the saved one (the model and
# the data). The parameter sharding is not one of them: a state saved with
# --param-sharding fsdp restores into replicated and back.
RUN_KEYS = ("layers", "d_model", "heads", "kv_heads", "seq_len", "batch",
            "seed", "strategy", "max_doc_len", "doc_order")


class Checkpointer:
  """The state every ``cfg.checkpoint_every`` steps in ``DIR/state``
  (the last two kept), the run's :data:`RUN_KEYS` in
  ``DIR/run_config.json``; a directory of another run is refused. Several
  processes share the directory (orbax writes each shard once)."""

  def __init__(self, cfg: Config):
    self.path = pathlib.Path(cfg.checkpoint_dir).resolve()
    self.path.mkdir(parents=True, exist_ok=True)
    self.every = cfg.checkpoint_every
    run = {k: v for k, v in dataclasses.asdict(cfg).items() if k in RUN_KEYS}
    cfg_file = self.path / "run_config.json"
    exists = cfg_file.exists()
    if exists:
      old = json.loads(cfg_file.read_text())
      diff = {k: (old.get(k), v) for k, v in run.items() if old.get(k) != v}
      if diff:
        raise SystemExit(f"--checkpoint-dir {self.path} holds a run with "
                         f"other settings (old, new): {diff}")
    if jax.process_count() > 1:   # everyone has read before anyone writes
      ocp.multihost.sync_global_processes("packed_lm_run_config")
    if not exists and jax.process_index() == 0:
      cfg_file.write_text(json.dumps(run, indent=1))
    self.manager = ocp.CheckpointManager(
        self.path / "state",
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    self._last_saved = self.manager.latest_step()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, state, shardings):
    """The latest checkpoint, shaped like ``state`` and placed in
    ``shardings``."""
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, shardings)
    return self.manager.restore(self.latest_step(),
                                args=ocp.args.StandardRestore(abstract))

  def save(self, step: int, state, force: bool = False) -> None:
    """Saves at every ``every``-th step, or now with ``force``; a step
    already saved is not saved again."""
    if step != self._last_saved and (force or step % self.every == 0):
      self.manager.save(step, args=ocp.args.StandardSave(state), force=force)
      self._last_saved = step

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
