"""Recovery: the example, killed (SIGKILL) in the middle of a checkpoint
save and run again, resumes from the last complete checkpoint and ends with
the losses of an uninterrupted run.

The kill is deterministic: ``$JAX_CP_EXAMPLE_KILL_IN_SAVE`` (a test-only
hook of the example's ``Checkpointer``) kills the process once every file of
that step's checkpoint is written, before orbax commits it by renaming its
temporary directory.
"""

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.test_example import TINY, train_packed_lm

EXAMPLE = (pathlib.Path(__file__).resolve().parents[1] / "examples"
           / "train_packed_lm.py")


@pytest.mark.slow  # three runs of the example, one in a subprocess
def test_killed_in_a_save_resumes_from_the_last_complete_checkpoint(
    tmp_path):
  steps, every, killed_at = 6, 2, 4
  args = TINY + ["--steps", str(steps), "--checkpoint-every", str(every),
                 "--no-compare"]
  want = train_packed_lm.main(args)["losses"]          # uninterrupted

  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
  env = dict(os.environ, JAX_CP_EXAMPLE_KILL_IN_SAVE=str(killed_at))
  proc = subprocess.run([sys.executable, str(EXAMPLE)] + args + ckpt,
                        env=env, capture_output=True, text=True,
                        timeout=600, check=False)
  assert proc.returncode == -signal.SIGKILL, (proc.returncode,
                                              proc.stderr[-2000:])
  # Step 2 is committed; step 4 was written but not committed: only its
  # temporary directory exists.
  names = sorted(p.name for p in (tmp_path / "ckpt" / "state").iterdir())
  assert str(every) in names and str(killed_at) not in names, names
  partial = [n for n in names if n.startswith(f"{killed_at}.") and "tmp" in n]
  assert partial and any(
      p.is_file() for p in (tmp_path / "ckpt" / "state" / partial[0]).rglob(
          "*")), names

  resumed = train_packed_lm.main(args + ckpt)
  assert resumed["start_step"] == every
  np.testing.assert_allclose(resumed["losses"], want[every:], rtol=1e-6)
  assert sorted(p.name for p in (tmp_path / "ckpt" / "state").iterdir()
                if p.name.isdigit()) == [str(killed_at), str(steps)]
