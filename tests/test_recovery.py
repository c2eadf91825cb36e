"""Recovery: the example, killed (SIGKILL) in the middle of a checkpoint
save and run again, resumes from the last complete checkpoint and ends with
the losses of an uninterrupted run.

The kill is deterministic: the child process (:data:`KILL_IN_SAVE`) runs
the example with orbax's atomic-rename commit patched to SIGKILL the
process when it commits the chosen step, once every file of that step's
checkpoint is written and before its temporary directory is renamed.
"""

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from examples.packed_lm import main
from tests._devices import requires_devices
from tests.test_example import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]

# python -c KILL_IN_SAVE STEP ARGS...: the example, killed in the commit of
# the checkpoint of step STEP.
KILL_IN_SAVE = """
import os, signal, sys
from orbax.checkpoint._src.path import atomicity
step, argv = sys.argv[1], sys.argv[2:]
commit = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *args, **kwargs):
  if self.get_final().name == step:
    os.kill(os.getpid(), signal.SIGKILL)
  return await commit(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
from examples.packed_lm import main
main.main(argv)
"""


@pytest.mark.slow  # three runs of the example, one in a subprocess
@requires_devices(4)  # TINY's dp=2 x cp=2 mesh
def test_killed_in_a_save_resumes_from_the_last_complete_checkpoint(
    tmp_path):
  steps, every, killed_at = 6, 2, 4
  args = TINY + ["--steps", str(steps), "--checkpoint-every", str(every),
                 "--no-compare"]
  want = main.main(args)["losses"]          # uninterrupted

  ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
  proc = subprocess.run(
      [sys.executable, "-c", KILL_IN_SAVE, str(killed_at), *args, *ckpt],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
      check=False)
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

  resumed = main.main(args + ckpt)
  assert resumed["start_step"] == every
  np.testing.assert_allclose(resumed["losses"], want[every:], rtol=1e-6)
  assert sorted(p.name for p in (tmp_path / "ckpt" / "state").iterdir()
                if p.name.isdigit()) == [str(killed_at), str(steps)]
