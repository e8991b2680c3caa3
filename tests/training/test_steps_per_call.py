"""K training steps per host call on the resident path (``config.steps_per_call``): the loop's
parameters are the same for every K ≥ 2, bit for bit, also across a resume with another K; and a
non-finite loss inside a call is named by its step.  (K = 1 is the step itself, not a loop of
one: another program, whose float32 round-off differs.)"""
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from smoothing_jax.experiment.checkpoints import load_variables
from smoothing_jax.parallel import create_mesh
from smoothing_jax.training import train
from tests.helpers import override, small_npz, small_npz_config, subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(data, k: int, **overrides):
  """Two epochs of 16 steps (32 images, batches of 2) on one device, logging and checkpoints only
  at the end: K = 13 makes calls of 13 and 3 steps (an epoch ends at 16)."""
  return override(small_npz_config(data, **{
      "num_devices": 1, "input.batch_size": 2, "num_train_steps": 32, "log_every_steps": 100,
      "checkpoint_every_steps": 100, "steps_per_call": k, **overrides}))


def _variables(workdir):
  return jax.device_get(load_variables(workdir, create_mesh(1))[1])


def _differences(root) -> list:
  """The parameters (paths) in which K = 13, and K = 13 stopped after one call and resumed with
  K = 5, differ from K = 2 (the runs in ``root``)."""
  data = small_npz(root)
  for k in (2, 13):
    train.train_from_config(_config(data, k), os.path.join(root, f"k{k}"))
  stopped = os.path.join(root, "stopped")
  try:
    train.train_from_config(_config(data, 13), stopped, stop_after_steps=13)
  except train.Preempted:
    pass
  assert load_variables(stopped, create_mesh(1))[0] == 13
  train.train_from_config(_config(data, 5), stopped)
  one = jax.tree_util.tree_flatten_with_path(_variables(os.path.join(root, "k2")))[0]
  return [f"{name} {jax.tree_util.keystr(path)}" for name in ("k13", "stopped")
          for (path, a), b in zip(one, jax.tree.leaves(_variables(os.path.join(root, name))),
                                  strict=True)
          if not np.array_equal(a, b)]


def test_every_k_and_a_resume_with_another_k_give_the_same_parameters_bit_for_bit(tmp_path):
  """In a process with XLA:CPU's default emitters, as users run (the suite's older emitters, for
  compile speed, fuse a loop of steps differently from one step: float32 round-off)."""
  checked = subprocess.run(
      [sys.executable, "-m", "tests.training.test_steps_per_call", str(tmp_path)],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS=subprocess_xla_flags(default_emitters=True)),
      capture_output=True, text=True, timeout=600)
  assert checked.returncode == 0, checked.stderr[-5000:]
  assert json.loads(checked.stdout.splitlines()[-1]) == []


def test_a_non_finite_loss_inside_a_call_names_its_step(tmp_path):
  """The step where the loss first diverges, named by a run of one step a call of the loop (the
  step's log every step), is the one named by a run of 13 steps a call."""
  data = small_npz(tmp_path)
  named = []
  for k in (2, 13):
    config = _config(data, k, learning_rate=1e4, log_every_steps=1 if k == 2 else 100)
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss .* at step \d+\.") as e:
      train.train_from_config(config, str(tmp_path / f"k{k}"))
    named.append(int(re.search(r"at step (\d+)\.", str(e.value)).group(1)))
    shutil.rmtree(tmp_path / f"k{k}")
  # (log_every_steps 1 cuts K = 2 to calls of one step: the loop's program, a trip count of 1.)
  # Inside a call of K = 13 (calls start at steps 1, 14, 17 and 30), not at its first step.
  assert named[0] == named[1] and named[0] not in (1, 14, 17, 30), named


if __name__ == "__main__":
  print(json.dumps(_differences(sys.argv[1])))
