"""Training system: schedule, end-to-end runs under mock TFDS data, multi-device equality, exact resume."""
import functools
import json
import os
import signal

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import cifar_resnet
from smoothing_jax import evaluate, train
from smoothing_jax.models import get_model


def tiny_config(**overrides):
  config = cifar_resnet.get_config("resnet_mcdo_smoothing_18,cifar10,runlocal")
  config.unlock()
  config.model_kwargs.width = 4
  config.batch_size = 8
  config.eval_batch_size = 8
  config.num_train_steps = 4
  config.checkpoint_every_steps = 2
  config.log_every_steps = 2
  config.ensemble_sizes = (1, 3)
  for key, value in overrides.items():
    setattr(config, key, value)
  config.lock()
  return config


def test_learning_rate_schedule_matches_the_recipe():
  config = cifar_resnet.get_config()
  schedule = train.create_learning_rate_schedule(config, steps_per_epoch=10)
  # Warm-up epoch: linear from 0; then 0.1, × 0.2 after epochs 60, 130, 160 (counted after warm-up).
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.05)
  assert float(schedule(10)) == pytest.approx(0.1)
  assert float(schedule(10 + 599)) == pytest.approx(0.1)
  assert float(schedule(10 + 600)) == pytest.approx(0.02)
  assert float(schedule(10 + 1300)) == pytest.approx(0.004)
  assert float(schedule(10 + 1600)) == pytest.approx(0.0008)
  config.unlock()
  config.batch_size = 512
  assert float(train.create_learning_rate_schedule(config, 10)(10)) == pytest.approx(0.4)


def test_configs_are_locked():
  config = cifar_resnet.get_config()
  with pytest.raises(AttributeError):
    config.learning_rte = 0.2


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  with tfds.testing.mock_data(num_examples=16):
    state = train.train_and_evaluate(tiny_config(), workdir)
  return workdir, state


def test_end_to_end_under_mock_cifar10(trained_workdir):
  workdir, state = trained_workdir
  assert int(state.step) == 4
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))
  assert json.load(open(os.path.join(workdir, "config.json")))["model"] == "resnet_mcdo_smoothing_18"


@pytest.mark.parametrize("eval_batch_size", [8, 5])
def test_ensemble_size_evaluation_counts_every_test_example(trained_workdir, tmp_path, eval_batch_size):
  workdir, _ = trained_workdir
  # 13 = one full batch of 8 + a padded batch; 5 is rounded up to the 8 devices (masked padding).
  with tfds.testing.mock_data(num_examples=13):
    rows = evaluate.evaluate_ensemble_sizes([workdir], str(tmp_path), tiny_config(eval_batch_size=eval_batch_size))
  assert [r["ensemble_size"] for r in rows] == [1, 3]
  assert all(r["count"] == 13 for r in rows)
  for name in ("ensemble_sizes.json", "ensemble_sizes.csv", "ensemble_sizes.png", "reliability.png"):
    assert (tmp_path / name).stat().st_size > 0


def test_corruption_evaluation_under_mock_data(trained_workdir, tmp_path):
  workdir, _ = trained_workdir
  with tfds.testing.mock_data(num_examples=8):
    aggregates = evaluate.evaluate_corruptions(workdir, str(tmp_path), config=tiny_config(),
                                               corruptions=("fog",), num_samples=2)
  rows = json.load(open(tmp_path / "corruptions.json"))
  assert [(r["type"], r["severity"]) for r in rows] == [("fog", s) for s in range(1, 6)]
  assert all(r["count"] == 8 for r in rows)
  assert aggregates["mean_err"] == pytest.approx(np.mean([1 - r["Acc"] for r in rows]))


def test_resume_after_interruption_is_bit_identical(tmp_path):
  config = tiny_config(num_train_steps=4, checkpoint_every_steps=2)
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"), stop_after_steps=2)  # "killed" after step 2
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["2"]
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
  assert int(resumed.step) == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state), jax.device_get(full.opt_state))


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  config = tiny_config(num_train_steps=6, checkpoint_every_steps=2, log_every_steps=1, learning_rate=1e30)
  with tfds.testing.mock_data(num_examples=16):
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss .* at step \d+"):
      train.train_and_evaluate(config, str(tmp_path))
  _, step, variables = train.load_checkpoint(str(tmp_path), config)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(variables))


def test_sigterm_sets_the_preemption_flag():
  with train._Preemption() as preemption:
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.requested


def test_eight_devices_match_one_device_on_the_same_global_batch():
  assert jax.device_count() == 8
  config = tiny_config()
  model = get_model("resnet_mcdo_smoothing_18", 10, width=4)
  schedule = train.create_learning_rate_schedule(config, steps_per_epoch=2)
  rng = jax.random.key(0)
  batches = [{"image": np.asarray(jax.random.normal(jax.random.key(i), (16, 16, 16, 3))),
              "label": np.arange(16, dtype=np.int32) % 10} for i in range(2)]
  results = []
  for num_devices in (1, 8):
    mesh = train.create_mesh(num_devices)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = jax.device_put(train.create_train_state(config, model, rng, (16, 16, 3), schedule), replicated)
    step, _ = train.compile_steps(model, schedule, mesh, 10)
    losses = []
    for batch in batches:
      state, metrics = step(state, train.shard_batch(batch, data), jax.random.key(1))
      losses.append(float(metrics["loss"]))
    results.append((losses, jax.device_get(state.params), jax.device_get(state.batch_stats)))
  (l1, p1, s1), (l8, p8, s8) = results
  np.testing.assert_allclose(l1, l8, rtol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), p1, p8)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), s1, s8)


@pytest.mark.slow
def test_sigterm_and_sigkill_then_rerun_is_bit_identical(tmp_path):
  """The CLI stopped by SIGTERM (checkpoint, exit) and by SIGKILL (at any moment), each time started
  again with the same command, ends with the uninterrupted run's parameters."""
  import subprocess
  import sys
  import time
  rng = np.random.default_rng(0)
  data = tmp_path / "data"
  data.mkdir()
  for split, n in (("train", 64), ("test", 16)):
    np.savez(data / f"{split}.npz", images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
             labels=rng.integers(0, 10, n))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def command(workdir):
    return [sys.executable, "-m", "smoothing_jax.main", f"--workdir={workdir}",
            f"--config={root}/configs/cifar_resnet.py:resnet_mcdo_smoothing_18,npz:{data},runlocal",
            "--config.model_kwargs.width=4", "--config.batch_size=8", "--config.num_train_steps=24",
            "--config.checkpoint_every_steps=4", "--config.ensemble_sizes=(1,)", "--config.eval_batch_size=16"]

  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", CUDA_VISIBLE_DEVICES="")
  checkpoints = tmp_path / "stopped" / "checkpoints"

  def start_and_signal(after_checkpoint, sig):
    victim = subprocess.Popen(command(tmp_path / "stopped"), env=env, cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (checkpoints / str(after_checkpoint)).exists() and victim.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    victim.send_signal(sig)
    _, stderr = victim.communicate(timeout=300)
    assert (checkpoints / str(after_checkpoint)).exists()
    return victim.returncode, stderr

  subprocess.run(command(tmp_path / "full"), check=True, env=env, cwd=root, capture_output=True)
  code, stderr = start_and_signal(4, signal.SIGTERM)
  assert code != 0 and "after SIGTERM" in stderr
  code, _ = start_and_signal(12, signal.SIGKILL)  # possibly in the middle of writing a checkpoint
  assert code == -signal.SIGKILL
  subprocess.run(command(tmp_path / "stopped"), check=True, env=env, cwd=root, capture_output=True)
  _, step_full, full = train.load_checkpoint(str(tmp_path / "full"))
  _, step_stopped, stopped = train.load_checkpoint(str(tmp_path / "stopped"))
  assert step_full == step_stopped == 24
  jax.tree.map(np.testing.assert_array_equal, stopped, full)


def test_vit_recipe_resume_is_bit_identical(tmp_path):
  """RandAugment (tf.data), Mixup/CutMix (in the step), stochastic depth and AdamW all resume exactly."""
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar10,runlocal")
  config.unlock()
  config.model_kwargs.update(hidden_dim=8, depth=1, num_heads=1, head_dim=8, mlp_dim=8, patch_size=8)
  config.batch_size = 8
  config.num_train_steps = 4
  config.checkpoint_every_steps = 2
  config.ensemble_sizes = (1,)
  config.lock()
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"), stop_after_steps=2)
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state), jax.device_get(full.opt_state))
  assert int(resumed.step) == 4
