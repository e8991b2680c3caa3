"""Training system: schedule, end-to-end runs under mock TFDS data, multi-device equality,
exact resume."""
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import cifar_resnet
from smoothing_jax import evaluate, train
from smoothing_jax import workdir as workdir_lib
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
  # Warm-up epoch: linear from 0; then 0.1, × 0.2 after epochs 60, 130, 160 (counted after
  # warm-up).
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
  assert json.load(open(os.path.join(workdir,
                                     "config.json")))["model"] == "resnet_mcdo_smoothing_18"


@pytest.mark.parametrize("eval_batch_size", [8, 5])
def test_ensemble_size_evaluation_counts_every_test_example(trained_workdir, tmp_path,
                                                            eval_batch_size):
  workdir, _ = trained_workdir
  # 13 = one full batch of 8 + a padded batch; 5 is rounded up to the 8 devices (masked padding).
  with tfds.testing.mock_data(num_examples=13):
    rows = evaluate.evaluate_ensemble_sizes([workdir], str(tmp_path),
                                            tiny_config(eval_batch_size=eval_batch_size))
  assert [r["ensemble_size"] for r in rows] == [1, 3]
  assert all(r["count"] == 13 for r in rows)
  for name in ("ensemble_sizes.json", "ensemble_sizes.csv", "ensemble_sizes.png",
               "reliability.png"):
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


def test_corruption_sweep_keeps_what_it_computed_when_a_later_set_fails(
    trained_workdir, tmp_path, monkeypatch):
  """CIFAR-10-C under its TFDS names (frosted_glass_blur, elastic); the table is on disk after
  each (type, severity), so a failure at elastic_transform 3 keeps the 7 rows before it."""
  from smoothing_jax.data import Pipeline
  workdir, _ = trained_workdir
  eval_batches = Pipeline.eval_batches

  def failing(self, batch_size=None, dataset=None):
    if dataset and dataset.endswith("elastic_transform_3"):
      raise OSError("disk error while reading elastic_transform_3")
    return eval_batches(self, batch_size, dataset)

  monkeypatch.setattr(Pipeline, "eval_batches", failing)
  with tfds.testing.mock_data(num_examples=8), pytest.raises(OSError, match="elastic_transform_3"):
    evaluate.evaluate_corruptions(workdir, str(tmp_path), config=tiny_config(),
                                  corruptions=("glass_blur", "elastic_transform"))
  rows = json.load(open(tmp_path / "corruptions.json"))
  assert [(r["type"], r["severity"]) for r in rows] == [("glass_blur", s) for s in range(1, 6)] + [
      ("elastic_transform", 1), ("elastic_transform", 2)]
  assert all(r["count"] == 8 for r in rows)
  assert len(open(tmp_path / "corruptions.csv").read().splitlines()) == 1 + len(rows)


def test_resume_after_interruption_is_bit_identical(tmp_path):
  config = tiny_config(num_train_steps=4, checkpoint_every_steps=2)
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"),
                             stop_after_steps=2)  # "killed" after step 2
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["2"]
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
  assert int(resumed.step) == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state),
               jax.device_get(full.opt_state))


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
  config = tiny_config(num_train_steps=6,
                       checkpoint_every_steps=2,
                       log_every_steps=1,
                       learning_rate=1e30)
  with tfds.testing.mock_data(num_examples=16):
    with pytest.raises(FloatingPointError, match=r"Non-finite training loss .* at step \d+"):
      train.train_and_evaluate(config, str(tmp_path))
  _, step, variables = workdir_lib.load_checkpoint(str(tmp_path), config)
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
    state = jax.device_put(train.create_train_state(config, model, rng, (16, 16, 3), schedule),
                           replicated)
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
    return [
        sys.executable, "-m", "smoothing_jax.main", f"--workdir={workdir}",
        f"--config={root}/configs/cifar_resnet.py:resnet_mcdo_smoothing_18,npz:{data},runlocal",
        "--config.model_kwargs.width=4", "--config.batch_size=8", "--config.num_train_steps=24",
        "--config.checkpoint_every_steps=4", "--config.ensemble_sizes=(1,)",
        "--config.eval_batch_size=16"
    ]

  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", CUDA_VISIBLE_DEVICES="")
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
  code, stderr = start_and_signal(4, signal.SIGTERM)
  assert code != 0 and "after SIGTERM" in stderr
  code, _ = start_and_signal(12, signal.SIGKILL)  # possibly in the middle of writing a checkpoint
  assert code == -signal.SIGKILL
  subprocess.run(command(tmp_path / "stopped"), check=True, env=env, cwd=root, capture_output=True)
  _, step_full, full = workdir_lib.load_checkpoint(str(tmp_path / "full"))
  _, step_stopped, stopped = workdir_lib.load_checkpoint(str(tmp_path / "stopped"))
  assert step_full == step_stopped == 24
  jax.tree.map(np.testing.assert_array_equal, stopped, full)


def test_vit_recipe_resume_is_bit_identical(tmp_path):
  """RandAugment (tf.data), Mixup/CutMix (in the step), stochastic depth and AdamW all resume
  exactly."""
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar10,runlocal")
  config.unlock()
  config.model_kwargs.update(hidden_dim=8,
                             depth=1,
                             num_heads=1,
                             head_dim=8,
                             mlp_dim=8,
                             patch_size=8)
  config.batch_size = 8
  config.num_train_steps = 4
  config.checkpoint_every_steps = 2
  config.ensemble_sizes = (1,)
  config.lock()
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"), stop_after_steps=2)
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state),
               jax.device_get(full.opt_state))
  assert int(resumed.step) == 4


# Checkpoints across device counts and corrupted checkpoints.  The cheapest model to compile
# (one ResNet stage of width 4 on 16×16 images) keeps these tests to seconds on CPU.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def npz_config(data_dir, **overrides):
  """``resnet_dnn_18`` cut to one stage of width 4 on the 16×16 ``npz:`` set of ``_write_npz``."""
  config = cifar_resnet.get_config(f"resnet_dnn_18,npz:{data_dir},runlocal")
  config.unlock()
  config.model_kwargs.width = 4
  config.model_kwargs.stage_sizes = (1,)
  config.batch_size = 8
  config.eval_batch_size = 16
  config.num_train_steps = 4
  config.checkpoint_every_steps = 2
  config.ensemble_sizes = (1,)
  for key, value in overrides.items():
    setattr(config, key, value)
  config.lock()
  return config


def _write_npz(root):
  rng = np.random.default_rng(0)
  for split, n in (("train", 32), ("test", 16)):
    images = rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)
    np.savez(os.path.join(root, f"{split}.npz"), images=images, labels=rng.integers(0, 4, n))
  return str(root)


@pytest.fixture(scope="module")
def npz_run(tmp_path_factory):
  """``(data_dir, workdir, final variables)`` of 4 steps on 8 devices (checkpoints 2 and 4)."""
  data = _write_npz(tmp_path_factory.mktemp("npz_data"))
  workdir = str(tmp_path_factory.mktemp("npz_run"))
  state = train.train_and_evaluate(npz_config(data), workdir)
  return data, workdir, jax.device_get({"params": state.params, "batch_stats": state.batch_stats})


def _flat(variables) -> dict:
  from flax.traverse_util import flatten_dict
  return {k: np.asarray(v) for k, v in flatten_dict(jax.device_get(variables), sep="/").items()}


def _worker(data_dir, jobs):
  """Body of ``python -m tests.test_train DATA JOBS`` in a process with its own device count.

  ``jobs``: ``["train", workdir, stop_after_steps]`` (resumes if ``workdir`` has checkpoints)
  or ``["evaluate", workdir, output_dir]`` (``--mode=evaluate`` of ``workdir``, then the
  ``load_checkpoint`` variables saved to ``output_dir/variables.npz``).
  """
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.INFO)  # "Resumed from step ..." on stderr
  for kind, workdir, arg in jobs:
    if kind == "train":
      train.train_and_evaluate(npz_config(data_dir), workdir, stop_after_steps=arg)
    else:
      evaluate.evaluate_ensemble_sizes([workdir], arg)
      _, step, variables = workdir_lib.load_checkpoint(workdir)
      np.savez(os.path.join(arg, "variables.npz"), step=step, **_flat(variables))


def _start_worker(num_devices: int, data_dir: str, jobs: list) -> subprocess.Popen:
  flags = f"--xla_force_host_platform_device_count={num_devices} --xla_backend_optimization_level=0"
  return subprocess.Popen([sys.executable, "-m", "tests.test_train", data_dir, json.dumps(jobs)],
                          cwd=ROOT, env=dict(os.environ, XLA_FLAGS=flags, CUDA_VISIBLE_DEVICES=""),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(worker: subprocess.Popen) -> str:
  _, stderr = worker.communicate(timeout=600)
  assert worker.returncode == 0, stderr[-5000:]
  return stderr


def _copy_steps(source: str, destination, steps) -> str:
  """A copy of workdir ``source`` keeping only the checkpoint ``steps``."""
  shutil.copytree(source, destination)
  checkpoints = os.path.join(destination, "checkpoints")
  for name in os.listdir(checkpoints):
    if int(name) not in steps:
      shutil.rmtree(os.path.join(checkpoints, name))
  return str(destination)


# Steps 1-2 or 3-4 on another device count sum BatchNorm statistics and gradients over the
# batch in another order: float32 round-off, not bit equality (observed: at most 2.4e-7, about
# 2 ulp of the largest parameters ~1.4; relative 2e-5 only on entries ~1e-4 with a 5e-10 error).
_ACROSS_DEVICE_COUNTS = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)


def test_checkpoints_move_between_device_counts(npz_run, tmp_path, caplog):
  """8 → 1: evaluate (load_checkpoint); 1 → 8 and 8 → 2: resume; the resumed runs end with the
  uninterrupted 8-device run's variables (to float32 round-off)."""
  data, full, final = npz_run
  cut8 = _copy_steps(full, tmp_path / "cut8", {2})  # = an 8-device run stopped after step 2
  cut1, results = str(tmp_path / "cut1"), str(tmp_path / "results")
  one = _start_worker(1, data, [["evaluate", full, results], ["train", cut1, 2]])
  two = _start_worker(2, data, [["train", cut8, None]])
  _finish(one)
  with caplog.at_level(logging.INFO):
    resumed = train.train_and_evaluate(npz_config(data), cut1)  # 1 → 8
  assert "Resumed from step 2" in caplog.text
  assert int(resumed.step) == 4
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.params), final["params"])
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.batch_stats), final["batch_stats"])

  rows = json.load(open(os.path.join(results, "ensemble_sizes.json")))  # 8 → 1
  assert rows[0]["count"] == 16 and np.isfinite(rows[0]["nll"])
  on_one = dict(np.load(os.path.join(results, "variables.npz")))
  assert int(on_one.pop("step")) == 4
  _, _, here = workdir_lib.load_checkpoint(full)
  assert on_one.keys() == _flat(here).keys()
  for key, value in _flat(here).items():
    np.testing.assert_array_equal(on_one[key], value, err_msg=key)

  assert "Resumed from step 2" in _finish(two)  # 8 → 2
  _, step, variables = workdir_lib.load_checkpoint(cut8)  # written by 2 devices, read on 8
  assert step == 4
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(variables), final)


def _corrupt(workdir, step: int):
  """Flip every byte of the OCDBT data files (``d/*``) of checkpoint ``step``.

  orbax 0.12.8 writes ``<step>/default/ocdbt.process_0/d/*`` and merges them into
  ``<step>/default/d/*``; small arrays such as this test model's are stored inline in the
  merged file, larger ones in the per-process files, so all are flipped.
  """
  for directory, _, names in os.walk(os.path.join(workdir, "checkpoints", str(step))):
    for name in names if os.path.basename(directory) == "d" else ():
      with open(os.path.join(directory, name), "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in data))


def _files(directory) -> dict:
  """``{relative path: sha256}`` of every file under ``directory``."""
  digests = {}
  for d, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(d, name)
      with open(path, "rb") as f:
        digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return digests


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_corrupted_latest_checkpoint_falls_back_to_the_newest_intact_one(npz_run, tmp_path, caplog):
  data, full, final = npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  _corrupt(workdir, 4)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with caplog.at_level(logging.WARNING):
    _, step, _ = workdir_lib.load_checkpoint(str(workdir))
  assert step == 2
  assert f"Checkpoint step 4 in {checkpoints} cannot be restored (ValueError: " in caplog.text
  assert _files(checkpoints) == before  # load_checkpoint changes nothing

  caplog.clear()
  with caplog.at_level(logging.WARNING):
    resumed = train.train_and_evaluate(npz_config(data), str(workdir))
  assert "Checkpoint step 4" in caplog.text and "4.corrupt" in caplog.text
  assert "never retrieved" not in caplog.text  # no noise of the reads the failed restore abandoned
  assert int(resumed.step) == 4  # steps 3-4 again, on the same devices: bit-identical
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), final["params"])
  # Nothing deleted: the unreadable step is kept as 4.corrupt, byte for byte, beside the new 4.
  after = _files(checkpoints)
  assert sorted(os.listdir(checkpoints)) == ["2", "4", "4.corrupt"]
  for name, digest in before.items():
    kept = "4.corrupt" + name[1:] if name.startswith("4" + os.sep) else name
    assert after[kept] == digest, name
  _, step, variables = workdir_lib.load_checkpoint(str(workdir))
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(variables["params"]), final["params"])


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_no_intact_checkpoint_is_a_one_line_error_and_deletes_nothing(npz_run, tmp_path, caplog):
  data, full, _ = npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  for step in (2, 4):
    _corrupt(workdir, step)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with pytest.raises(FileNotFoundError) as error:
    workdir_lib.load_checkpoint(str(workdir))
  assert isinstance(error.value, workdir_lib.NoIntactCheckpointError)
  message = str(error.value)
  assert message.startswith(f"No intact checkpoint in {checkpoints}: steps 4, 2 failed to restore")
  assert "\n" not in message
  with pytest.raises(workdir_lib.NoIntactCheckpointError, match="No intact checkpoint in"):
    train.train_and_evaluate(npz_config(data), str(workdir))
  assert _files(checkpoints) == before
  assert "never retrieved" not in caplog.text


if __name__ == "__main__":
  _worker(sys.argv[1], json.loads(sys.argv[2]))
