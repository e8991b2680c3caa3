"""Training system: schedules, optimisers, losses, train_step, end-to-end runs under mock TFDS
data, evaluation of a trained run, multi-device equality, exact resume."""
import functools
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10 under TFDS mock data

from configs import cifar_resnet
from smoothing_jax import evaluate, train
from smoothing_jax import workdir as workdir_lib
from smoothing_jax.data.mixup import Mixing
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch
from smoothing_jax.train import cross_entropy
from tests.helpers import MICRO_VIT, model_options, override, tiny_config


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


def test_vit_recipe_config_and_schedule():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  assert (config.optimizer, config.learning_rate, config.batch_size,
          config.weight_decay) == ("adamw", 1.25e-4, 96, 0.05)
  assert (config.label_smoothing, config.mixup_alpha, config.cutmix_alpha,
          config.grad_clip_norm) == (0.1, 1.0, 0.8, 5.0)
  assert (config.randaugment.num_layers, config.randaugment.magnitude) == (2, 9.0)
  assert config.model_kwargs.stochastic_depth == 0.1
  schedule = train.create_learning_rate_schedule(config, steps_per_epoch=10)
  lr = 1.25e-4
  np.testing.assert_allclose([schedule(0), schedule(25), schedule(50)], [0.0, lr / 2, lr],
                             rtol=1e-6)
  # Cosine over 300 epochs after the 5 warm-up epochs: half way it is lr/2, at the end 0.
  np.testing.assert_allclose(schedule(50 + 1500), lr / 2, rtol=1e-4)
  np.testing.assert_allclose(schedule(50 + 3000), 0.0, atol=1e-12)


def test_vit_config_sets_hv_dropout_and_lets_the_command_line_change_it():
  from absl import flags
  from ml_collections import config_flags

  from configs import cifar_vit
  kwargs = cifar_vit.get_config("vit_ti,cifar100").model_kwargs
  assert (kwargs.dropout_rate_train, kwargs.embedding_dropout_rate) == (0.0, 0.0)  # HV
  argv = ["prog", f"--config={cifar_vit.__file__}:vit_ti,cifar100",
          "--config.model_kwargs.dropout_rate_train=0.1",
          "--config.model_kwargs.embedding_dropout_rate=0.2"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)  # locked, as in main
  values(argv)
  given = {k: v for k, v in values.config.model_kwargs.items() if v is not None}  # as create_model
  model = get_model("vit_ti", 10, **given)
  assert (model.dropout_rate_train, model.embedding_dropout_rate) == (0.1, 0.2)
  # AlterNet has no such options: the keys are absent, so its model still builds.
  kwargs = cifar_vit.get_config("alternet_50,cifar100").model_kwargs
  assert "dropout_rate_train" not in kwargs and "embedding_dropout_rate" not in kwargs
  get_model("alternet_50", 10, **{k: v for k, v in kwargs.items() if v is not None})


def test_adamw_with_clipping_matches_a_hand_computed_step():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  tx = train.create_optimizer(config, optax.constant_schedule(0.1))
  params = {"w": jnp.array([1.0, -2.0])}
  grads = {"w": jnp.array([30.0, 40.0])}            # norm 50 → clipped to norm 5: (3, 4)
  updates, _ = tx.update(grads, tx.init(params), params)
  # First Adam step: m̂ = g, v̂ = g², so the step is lr·g/(|g| + ε) = ±lr, plus decoupled
  # decay lr·wd·w.
  expected = -0.1 * (np.sign([3.0, 4.0]) * (np.array([3.0, 4.0]) / (np.array([3.0, 4.0]) + 1e-8))
                     + 0.05 * np.array([1.0, -2.0]))
  np.testing.assert_allclose(updates["w"], expected, rtol=1e-5)
  # SGD (momentum, coupled decay) shows the clipping: the step is −lr·(g·5/50 + wd·w).
  config.optimizer, config.momentum, config.weight_decay = "sgd", 0.9, 0.01
  tx = train.create_optimizer(config, optax.constant_schedule(0.1))
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"],
                             -0.1 * (np.array([3.0, 4.0]) + 0.01 * np.array([1.0, -2.0])),
                             rtol=1e-6)


def test_weighted_pixel_cross_entropy_masks_void():
  logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]]))
  labels = jnp.array([[0, 1, 3]])
  w = jnp.array([2.0, 0.5, 1.0])
  expected = (2.0 * -np.log(0.7) + 0.5 * -np.log(0.6)) / 2.5
  np.testing.assert_allclose(cross_entropy(logits, labels, w), expected, rtol=1e-6)
  np.testing.assert_allclose(cross_entropy(logits, labels), (-np.log(0.7) - np.log(0.6)) / 2,
                             rtol=1e-6)


def test_train_step_with_mixing_uses_soft_targets():
  model = get_model("vit_ti",
                    4,
                    hidden_dim=8,
                    depth=1,
                    num_heads=1,
                    head_dim=8,
                    mlp_dim=8,
                    patch_size=4)
  images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.array([0, 1, 2, 3])
  variables = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, images)
  state = train.TrainState.create(apply_fn=model.apply, params=variables["params"], batch_stats={},
                                  tx=optax.sgd(0.0))
  smoothing_only = Mixing(4, label_smoothing=0.2)
  _, metrics = train.train_step(optax.constant_schedule(0.0),
                                train.supervised_loss(model, smoothing_only), state, {
                                    "image": images,
                                    "label": labels
                                }, jax.random.key(3))
  rng = jax.random.fold_in(jax.random.key(3), 0)
  logits = model.apply(variables,
                       images,
                       train=True,
                       rngs={
                           "dropout": rng,
                           "noise": jax.random.fold_in(rng, 1)
                       })
  log_p = jax.nn.log_softmax(logits)
  expected = -jnp.mean(jnp.sum((0.8 * jax.nn.one_hot(labels, 4) + 0.05) * log_p, -1))
  np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)


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
  from smoothing_jax.data.resident import ResidentPipeline as Pipeline
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
  """Also on half of the training split (``train_fraction``: the same subset after the resume,
  its size in config.json) and with the learning trajectory recorded every 3 steps (rows 0, 3
  and the last step 4, the resumed record equal to the uninterrupted one)."""
  from smoothing_jax.analysis import trained as trained_lib
  from smoothing_jax.analysis.trajectory import load_trajectory
  from smoothing_jax.data import load_arrays, parse_dataset
  config = tiny_config(num_train_steps=4, checkpoint_every_steps=2, train_fraction=0.5,
                       trajectory_every_steps=3, trajectory_dims=8)
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"),
                             stop_after_steps=2)  # "killed" after step 2
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["2"]
    assert list(load_trajectory(tmp_path / "cut").steps) == [0]
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
    _, class_counts = np.unique(load_arrays(parse_dataset("cifar10"), "train", shard=False)[1],
                                return_counts=True)
    polar = trained_lib.trajectory_study(trained_lib.load_trained(str(tmp_path / "full")))
  assert int(resumed.step) == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state),
               jax.device_get(full.opt_state))
  recorded = json.load(open(tmp_path / "cut" / "config.json"))
  assert recorded["train_fraction"] == 0.5
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
    mesh = create_mesh(num_devices)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = jax.device_put(train.create_train_state(config, model, rng, (16, 16, 3), schedule),
                           replicated)
    step, _ = train.compile_steps(model, schedule, mesh, 10)
    losses = []
    for batch in batches:
      state, metrics = step(state, shard_batch(batch, data), jax.random.key(1))
      losses.append(float(metrics["loss"]))
    results.append((losses, jax.device_get(state.params), jax.device_get(state.batch_stats)))
  (l1, p1, s1), (l8, p8, s8) = results
  np.testing.assert_allclose(l1, l8, rtol=1e-5)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), p1, p8)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6), s1, s8)


def test_gradient_accumulation_gives_the_full_batch_update_without_batchnorm():
  """A BatchNorm-free model (a micro ViT, no dropout): k = 2 micro-batches sharded over the 8
  devices, and k = 4 micro-batches of 4 (which 8 devices do not divide, so replicated), give the
  same update, loss and accuracy as one batch of 16."""
  config = tiny_config()
  model = get_model("vit_ti", 10, **MICRO_VIT)
  schedule = train.create_learning_rate_schedule(config, steps_per_epoch=2)
  batch = {"image": np.asarray(jax.random.normal(jax.random.key(1), (16, 16, 16, 3))),
           "label": np.arange(16, dtype=np.int32) % 10}
  mesh = create_mesh(8)
  results = {}
  for k in (1, 2, 4):
    sharding = train.train_batch_sharding(override(config, batch_size=16, grad_accum_steps=k),
                                          mesh)
    assert (sharding.spec == jax.sharding.PartitionSpec()) == (k == 4)
    step, _ = train.compile_steps(model, schedule, mesh, 10, grad_accum_steps=k,
                                  batch_sharding=sharding)
    state = jax.device_put(
        train.create_train_state(config, model, jax.random.key(0), (16, 16, 3), schedule),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))  # donated by the step
    state, metrics = step(state, shard_batch(batch, sharding), jax.random.key(2))
    results[k] = jax.device_get((state.params, metrics))
  for k in (2, 4):
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
                 results[k], results[1])
  with pytest.raises(ValueError, match="grad_accum_steps must be a positive integer that divides"):
    train.train_batch_sharding(override(config, batch_size=16, grad_accum_steps=3), mesh)


def test_half_precision_training_tracks_float32_and_keeps_float32_state():
  """The quickstart recipe and data (digits, smoothing + MC dropout, width 8, one block a stage)
  for 20 steps in float32 and with ``half_precision``, from the same initialisation, batches and
  dropout keys: every step's loss agrees within 5% (bfloat16 rounds each operation by up to
  2⁻⁹ ≈ 0.2%; the losses here measured within 1%), and parameters, BatchNorm statistics and
  optimizer state — what checkpoints save — stay float32."""
  import itertools
  from configs import quickstart
  from smoothing_jax.data import create_pipeline
  config = override(quickstart.get_config("runlocal"), **model_options(stage_sizes=(1, 1, 1, 1)))
  pipeline = create_pipeline("digits", config.batch_size, 0)
  batches = list(itertools.islice(pipeline.train_iterator(), 20))
  schedule = train.create_learning_rate_schedule(config, pipeline.steps_per_epoch)
  spec = {"num_classes": 10, "stem": "cifar", "image_shape": [32, 32, 3]}
  losses = {}
  for half in (False, True):
    model = workdir_lib.build_model(override(config, half_precision=half), spec)
    assert model.dtype == (jnp.bfloat16 if half else jnp.float32)
    state = train.create_train_state(config, model, jax.random.key(0), (32, 32, 3), schedule)
    loss_fn = train.make_loss(config, model, num_train=pipeline.num_train,
                              steps_per_epoch=pipeline.steps_per_epoch)
    step = jax.jit(functools.partial(train.train_step, schedule, loss_fn))
    run = []
    for batch in batches:
      state, metrics = step(state, batch, jax.random.key(1))
      run.append(float(metrics["loss"]))
    losses[half] = np.asarray(run)
    floats = [x for x in jax.tree.leaves((state.params, state.batch_stats, state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)]  # (optax's step counts are integers)
    assert floats and all(x.dtype == jnp.float32 for x in floats)
  assert losses[False][-1] < losses[False][0]  # it trains
  np.testing.assert_allclose(losses[True], losses[False], rtol=0.05)


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
        "--config.model_kwargs.width=4", "--config.model_kwargs.stage_sizes=(1, 1, 1, 1)",
        "--config.batch_size=8", "--config.num_train_steps=24",
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
  config = override(cifar_vit.get_config("vit_ti,cifar10,runlocal"),
                    **model_options(hidden_dim=8, depth=1, num_heads=1, head_dim=8, mlp_dim=8,
                                    patch_size=8),
                    batch_size=8,
                    num_train_steps=4,
                    checkpoint_every_steps=2,
                    ensemble_sizes=(1,))
  with tfds.testing.mock_data(num_examples=16):
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    train.train_and_evaluate(config, str(tmp_path / "cut"), stop_after_steps=2)
    resumed = train.train_and_evaluate(config, str(tmp_path / "cut"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(full.params))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.opt_state),
               jax.device_get(full.opt_state))
  assert int(resumed.step) == 4
