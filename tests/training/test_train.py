"""smoothing_jax.training.train: the loop end to end under mock TFDS data, exact resume (also across
Ctrl-C and SIGKILL), the learning trajectory, and stopping at a non-finite loss."""
import json
import os
import signal

import jax
import numpy as np
import pytest

from smoothing_jax.experiment.checkpoints import load_variables
from smoothing_jax.parallel import create_mesh
from smoothing_jax.training import train
from tests.helpers import subprocess_xla_flags, tiny_config

tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10 under TFDS mock data


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  with tfds.testing.mock_data(num_examples=16):
    state = train.train_from_config(tiny_config(), workdir)
  return workdir, state


def test_end_to_end_under_mock_cifar10(trained_workdir):
  workdir, state = trained_workdir
  assert int(state.step) == 4
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))
  assert json.load(open(os.path.join(workdir,
                                     "config.json")))["model"] == "resnet_mcdo_smoothing_18"


def test_resume_after_interruption_is_bit_identical(tmp_path):
  """Also on half of the training split (``train_fraction``: the same subset after the resume,
  its size in config.json) and with the learning trajectory recorded every 3 steps (rows 0, 3
  and the last step 4, the resumed record equal to the uninterrupted one)."""
  from smoothing_jax.analysis import trained as trained_lib
  from smoothing_jax.data import load_arrays, parse_dataset
  from smoothing_jax.training.trajectory_recorder import load_trajectory
  config = tiny_config(num_train_steps=4, checkpoint_every_steps=2, trajectory_every_steps=3,
                       trajectory_dims=8, **{"input.train_fraction": 0.5})
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_from_config(config, str(tmp_path / "full"))
    train.train_from_config(config, str(tmp_path / "cut"),
                            stop_after_steps=2)  # "killed" after step 2
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["2"]
    assert list(load_trajectory(tmp_path / "cut").steps) == [0]
    resumed = train.train_from_config(config, str(tmp_path / "cut"))
    _, class_counts = np.unique(load_arrays(parse_dataset("cifar10"), "train", shard=False)[1],
                                return_counts=True)
    polar = trained_lib.trajectory_study(trained_lib.load_trained(str(tmp_path / "full")))
  assert int(resumed.step) == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state),
               jax.device_get(full.opt_state))
  recorded = json.load(open(tmp_path / "cut" / "config.json"))
  assert recorded["input"]["train_fraction"] == 0.5
  assert recorded["model_spec"]["num_train_examples"] == np.sum(np.floor(0.5 * class_counts + 0.5))
  records = [load_trajectory(tmp_path / run) for run in ("full", "cut")]
  assert [list(r.steps) for r in records] == [[0, 3, 4]] * 2
  np.testing.assert_array_equal(records[1].projections, records[0].projections)
  np.testing.assert_array_equal(records[1].norm_sq, records[0].norm_sq)
  params_sq = sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(full.params))
  assert records[0].norm_sq[-1] == pytest.approx(params_sq, rel=1e-5)
  np.testing.assert_array_equal(polar["steps"], [0, 3, 4])
  assert polar["radius"][-1] == 0 and polar["path_ratio"] >= 1


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  config = tiny_config(num_train_steps=6,
                       checkpoint_every_steps=2,
                       log_every_steps=1,
                       learning_rate=1e30)
  with tfds.testing.mock_data(num_examples=16):
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss .* at step \d+"):
      train.train_from_config(config, str(tmp_path))
  step, variables = load_variables(str(tmp_path), create_mesh())
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(variables))


@pytest.mark.slow
def test_ctrl_c_and_sigkill_then_rerun_is_bit_identical(tmp_path):
  """The CLI stopped by Ctrl-C (checkpoint, one line, exit 130, no traceback) and by SIGKILL (at
  any moment), each time started again with the same command, ends with the uninterrupted run's
  parameters.  SIGTERM takes Ctrl-C's path (test_callbacks.py; on the command line,
  test_main.py's two processes).  The run is SWAG's (``--config.method=swag``: 4 epochs of 8
  steps, a model collected at the ends of epochs 3 and 4), killed after its step-28 checkpoint,
  in the middle of the collection: its moments too end bit for bit as the uninterrupted run's."""
  import re
  import subprocess
  import sys
  import time
  rng = np.random.default_rng(0)
  data = tmp_path / "data"
  data.mkdir()
  for split, n in (("train", 64), ("test", 16)):
    np.savez(data / f"{split}.npz", images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
             labels=rng.integers(0, 10, n))
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  def command(workdir):
    return [
        sys.executable, "-m", "smoothing_jax.main", f"--workdir={workdir}",
        f"--config={root}/configs/cifar_resnet.py:resnet_mcdo_smoothing_18,npz:{data},runlocal",
        "--config.model_kwargs.width=4", "--config.model_kwargs.stage_sizes=(1,)",
        "--config.input.batch_size=8", "--config.num_train_steps=32", "--config.method=swag",
        "--config.checkpoint_every_steps=4", "--config.ensemble_sizes=(1,)",
        "--config.eval_batch_size=16"
    ]

  env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags(), CUDA_VISIBLE_DEVICES="")
  checkpoints = tmp_path / "stopped" / "checkpoints"

  def start_and_signal(after_checkpoint, sig):
    victim = subprocess.Popen(command(tmp_path / "stopped"),
                              env=env,
                              cwd=root,
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE,
                              text=True)
    deadline = time.time() + 300
    while not (checkpoints /
               str(after_checkpoint)).exists() and victim.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    victim.send_signal(sig)
    _, stderr = victim.communicate(timeout=300)
    assert (checkpoints / str(after_checkpoint)).exists()
    return victim.returncode, stderr

  subprocess.run(command(tmp_path / "full"), check=True, env=env, cwd=root, capture_output=True)
  code, stderr = start_and_signal(4, signal.SIGINT)
  stopped = [line for line in stderr.splitlines() if "Stopped at step" in line]
  assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
  assert len(stopped) == 1 and re.fullmatch(
      r"Stopped at step \d+ after SIGINT \(checkpoint saved in .*\); rerun the same command to "
      r"resume\.", stopped[0]), stderr[-3000:]
  code, _ = start_and_signal(28, signal.SIGKILL)  # possibly in the middle of writing a checkpoint
  assert code == -signal.SIGKILL
  subprocess.run(command(tmp_path / "stopped"), check=True, env=env, cwd=root, capture_output=True)
  step_full, full = load_variables(str(tmp_path / "full"), create_mesh(), method_state=True)
  step_stopped, stopped = load_variables(str(tmp_path / "stopped"), create_mesh(),
                                         method_state=True)
  assert step_full == step_stopped == 32
  assert int(full["swag"]["count"]) == 2
  jax.tree.map(np.testing.assert_array_equal, stopped, full)


def _whole_checkpoint(workdir):
  """``(step, tree)`` of the newest checkpoint of ``workdir``, all of it (parameters, statistics,
  optimiser state, step), as orbax restores it with no target."""
  from smoothing_jax.experiment.checkpoints import abstract_tree, checkpoint_manager, restore_latest
  from smoothing_jax.parallel import shardings
  replicated, _ = shardings(create_mesh())
  with checkpoint_manager(workdir, read_only=True) as manager:
    return restore_latest(
        manager, lambda step: abstract_tree(manager.item_metadata(step).tree, replicated))


def test_vit_recipe_resume_is_bit_identical(msa_workdirs, tmp_path):
  """RandAugment (on the devices), Mixup/CutMix (in the step), stochastic depth, label smoothing,
  clipping and AdamW all resume exactly: the AlterNet of ``msa_workdirs`` (the full ViT recipe,
  4 steps) trained again from its recorded config, stopped after step 2 and resumed, ends with
  the same checkpoint.  (Its programs are the fixture's, read from the compilation cache.)"""
  from smoothing_jax.experiment.workdir import read_config
  full = msa_workdirs["AlterNet"]
  config, _ = read_config(full)
  assert config.mixup_alpha > 0 and config.input.randaugment.num_layers > 0
  assert config.model_kwargs.stochastic_depth > 0
  cut = str(tmp_path / "cut")
  train.train_from_config(config, cut, stop_after_steps=2)
  assert sorted(os.listdir(os.path.join(cut, "checkpoints"))) == ["2"]
  resumed = train.train_from_config(config, cut)
  assert int(resumed.step) == 4
  (step_full, whole_full), (step_cut, whole_cut) = map(_whole_checkpoint, (full, cut))
  assert step_full == step_cut == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(whole_cut),
               jax.device_get(whole_full))
