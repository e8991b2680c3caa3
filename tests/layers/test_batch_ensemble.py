"""BatchEnsemble: layers against M explicit numpy layers, the fast-weight initialisation, the
members' predictive and training batch, the optimiser's fast-weight rate and decay, the models'
sizes, and training, resuming and every evaluator from the command line."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import cifar_resnet
from smoothing_jax.inference import batch_ensemble_predict
from smoothing_jax.layers.batch_ensemble import (
  BatchEnsembleConv,
  BatchEnsembleDense,
  random_sign_init,
)
from smoothing_jax.models import get_model
from smoothing_jax.training import optim
from smoothing_jax.training.losses import supervised_loss
from tests.helpers import (
  init_variables,
  num_params,
  override,
  tiny_config,
  tiny_run,
  train_resume_and_evaluate,
)

M = 3


def _fast_weights(rng, c_in, c_out):
  return {"fast_in": rng.normal(1, 0.5, (M, c_in)).astype(np.float32),
          "fast_out": rng.normal(1, 0.5, (M, c_out)).astype(np.float32),
          "bias": rng.normal(0, 0.1, (M, c_out)).astype(np.float32)}


def test_dense_equals_m_numpy_layers_with_kernels_w_times_s_r():
  rng = np.random.default_rng(0)
  params = {"kernel": rng.normal(size=(5, 4)).astype(np.float32), **_fast_weights(rng, 5, 4)}
  x = rng.normal(size=(6, 5)).astype(np.float32)
  members = np.array([0, 1, 2, 2, 1, 0])
  out = BatchEnsembleDense(M, features=4).apply({"params": params}, x, members)
  for b, m in enumerate(members):
    kernel = params["kernel"] * np.outer(params["fast_in"][m], params["fast_out"][m])
    np.testing.assert_allclose(out[b], x[b] @ kernel + params["bias"][m], rtol=1e-5, atol=1e-5)
  # No members given: row r uses member r mod M (the batch repeated M times in training).
  default = BatchEnsembleDense(M, features=4).apply({"params": params}, x)
  np.testing.assert_allclose(default, BatchEnsembleDense(M, features=4).apply(
      {"params": params}, x, np.arange(6) % M), rtol=0, atol=0)


def _numpy_conv(x, kernel, stride, padding):
  """Cross-correlation of ``x [H, W, C_in]`` with ``kernel [k, k, C_in, C_out]``, zero padding."""
  k = kernel.shape[0]
  x = np.pad(x, ((padding, padding), (padding, padding), (0, 0)))
  rows = range(0, x.shape[0] - k + 1, stride)
  cols = range(0, x.shape[1] - k + 1, stride)
  return np.array([[np.einsum("hwi,hwio->o", x[i:i + k, j:j + k], kernel) for j in cols]
                   for i in rows])


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_equals_m_numpy_convolutions_with_kernels_w_times_s_r(stride):
  rng = np.random.default_rng(1)
  params = {"kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
            **_fast_weights(rng, 2, 4)}
  x = rng.normal(size=(4, 5, 5, 2)).astype(np.float32)
  members = np.array([2, 0, 1, 2])
  layer = BatchEnsembleConv(M, features=4, kernel_size=3, stride=stride, padding=1)
  out = np.asarray(layer.apply({"params": params}, x, members))
  for b, m in enumerate(members):
    kernel = params["kernel"] * np.outer(params["fast_in"][m], params["fast_out"][m])
    expected = _numpy_conv(x[b], kernel, stride, 1) + params["bias"][m]
    np.testing.assert_allclose(out[b], expected, rtol=1e-4, atol=1e-4)


def test_fast_weights_start_as_uncertainty_baselines_random_sign_init():
  key = jax.random.key(0)
  signs = np.asarray(random_sign_init(0.75)(key, (200, 100)))
  assert set(np.unique(signs)) == {-1.0, 1.0}
  assert abs((signs > 0).mean() - 0.75) < 0.01
  normal = np.asarray(random_sign_init(-0.5)(key, (200, 100)))  # the CIFAR default: N(1, 0.5²)
  assert abs(normal.mean() - 1.0) < 0.01 and abs(normal.std() - 0.5) < 0.01


@pytest.fixture(scope="module")
def tiny_batch_ensemble():
  model = get_model("resnet_batchensemble_18", 5, ensemble_size=M, width=4, stage_sizes=(1,))
  return model, init_variables(model, (2, 16, 16, 3))


def test_the_predictive_is_the_members_and_training_repeats_the_batch(tiny_batch_ensemble):
  model, variables = tiny_batch_ensemble
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  labels = jnp.array([0, 1, 2, 3])
  prediction = batch_ensemble_predict(model, variables, images)
  assert prediction.sample_probs.shape == (M, 4, 5)
  member_probs = jax.jit(lambda m: jax.nn.softmax(model.apply(variables, images,
                                                              components=jnp.full((4,), m))))
  per_member = [member_probs(m) for m in range(M)]
  np.testing.assert_allclose(prediction.sample_probs, np.stack(per_member), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(prediction.mean_probs, np.mean(per_member, 0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(per_member[0], per_member[1])

  # Training mode with BatchNorm on the batch statistics of all M copies: each member's
  # cross-entropy on the whole batch, averaged over the members.
  @jax.jit
  def loss_and_explicit():
    loss, aux = supervised_loss(model)(variables["params"], variables["batch_stats"],
                                       {"image": images, "label": labels}, jax.random.key(2), 0)
    logits = model.apply(variables, jnp.repeat(images, M, axis=0), train=True,
                         mutable=["batch_stats"])[0].reshape(4, M, 5)
    per_member = [optax.softmax_cross_entropy_with_integer_labels(logits[:, m], labels).mean()
                  for m in range(M)]
    return loss, aux["labels"], jnp.mean(jnp.stack(per_member))

  loss, repeated_labels, explicit = loss_and_explicit()
  np.testing.assert_allclose(loss, explicit, rtol=1e-5)
  assert repeated_labels.tolist() == np.repeat(labels, M).tolist()


def test_one_pass_per_frame_is_the_members_mean_whatever_the_batch(tiny_batch_ensemble):
  from smoothing_jax import temporal
  model, variables = tiny_batch_ensemble
  frame = jax.random.normal(jax.random.key(3), (4, 16, 16, 3))   # 4 streams, M = 3 members
  frames = jnp.stack([frame] * 3)                                 # a still scene
  out = temporal.stream_predictions(model, variables, frames, rng=jax.random.key(4),
                                    num_samples=2, num_frames=2)
  members_mean = batch_ensemble_predict(model, variables, frame).mean_probs
  assert set(out) == {"single", "temporal"}  # no MC row: two passes are the same members
  for method in ("single", "temporal"):
    np.testing.assert_allclose(out[method], np.stack([members_mean] * 2), rtol=1e-5, atol=1e-6)


def test_fast_weights_learn_at_the_multiplied_rate_without_decay(tiny_batch_ensemble):
  model, variables = tiny_batch_ensemble
  config = override(tiny_config(), weight_decay=0.1, momentum=0.0, nesterov=False,
                    **{"batch_ensemble.fast_weight_lr_multiplier": 0.5})
  tx = optim.create_optimizer(config, lambda step: 1.0, model)
  params = jax.tree.map(jnp.ones_like, variables["params"])
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  conv, head = updates["layer1_0"]["conv1"], updates["classifier_0"]
  np.testing.assert_allclose(conv["kernel"], -1.1)          # −(g + wd·w)
  np.testing.assert_allclose(conv["fast_in"], -0.5)         # −0.5·g: no decay
  np.testing.assert_allclose(conv["fast_out"], -0.5)
  np.testing.assert_allclose(head["bias"], -0.5 * 1.1)      # members' biases: decay, half rate
  np.testing.assert_allclose(updates["layer1_0"]["bn1"]["scale"], -1.1)
  # Adam normalises the gradient's scale away: the multiplier scales the update itself.
  adam = optim.create_optimizer(override(config, optimizer="adam"), lambda step: 1.0, model)
  updates, _ = adam.update(grads, adam.init(params), params)
  np.testing.assert_allclose(updates["layer1_0"]["conv1"]["kernel"], -1.0, rtol=1e-4)
  np.testing.assert_allclose(updates["layer1_0"]["conv1"]["fast_in"], -0.5, rtol=1e-4)


def test_model_sizes_are_uncertainty_baselines_and_the_transcribed_layers():
  # uncertainty-baselines' CIFAR README: WRN-28-10 36.5M deterministic, 36.6M BatchEnsemble of 4
  # (trainable: 36,479,194 and 36,557,548, conv kernels 36,454,832 + BatchNorm 17,952 + head).
  assert num_params(get_model("wideresnet_dnn_28_10", 10, conv_bias=False)) == 36_479_194
  wrn = num_params(get_model("wideresnet_batchensemble_28_10", 10))
  assert wrn == 36_479_194 + 78_354 and round(wrn / 1e6, 1) == 36.6
  # ResNet-18 (CIFAR): every conv (in, out) and the 512 → 10 head; each BatchEnsemble layer adds
  # M·(in + out) fast weights, the head M·10 member biases in place of its 10.
  convs = [(3, 64)] + [(64, 64)] * 4 + [(64, 128), (128, 128), (128, 128), (128, 128), (64, 128)]
  convs += [(128, 256), (256, 256), (256, 256), (256, 256), (128, 256)]
  convs += [(256, 512), (512, 512), (512, 512), (512, 512), (256, 512)]
  deterministic = num_params(get_model("resnet_dnn_18", 10))
  assert deterministic == 11_173_962
  extra = sum(4 * (i + o) for i, o in convs) + 4 * (512 + 10) + 3 * 10
  assert num_params(get_model("resnet_batchensemble_18", 10)) == deterministic + extra


def test_a_batch_ensemble_is_not_trained_as_a_deep_ensemble_of_batch_ensembles():
  from smoothing_jax.training.ensemble import check_ensemble_config
  config = override(cifar_resnet.get_config("resnet_batchensemble_18"), ensemble_members=2)
  with pytest.raises(ValueError, match="BatchEnsemble of 4 members already"):
    check_ensemble_config(config, get_model("resnet_batchensemble_18", 10))


def test_trains_resumes_and_runs_every_evaluator_from_the_command_line(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  config = tiny_run(cifar_resnet.get_config("resnet_batchensemble_18,cifar10,runlocal"),
                    num_train_steps=4, **{"input.holdout_fraction": 0.25,
                                          "model_kwargs.stage_sizes": (1,),
                                          "model_kwargs.ensemble_size": 2})
  results = train_resume_and_evaluate(config, tmp_path)
  assert [r["ensemble_size"] for r in results["ensemble_sizes"]] == [1, 2]
  for name in ("calibration", "selective", "ood"):
    assert {r["ensemble_size"] for r in results[name]} == {1, 2}, name
  assert np.isfinite(results["corruptions"]["mean_err"])
  assert {r["method"] for r in results["temporal"]} >= {"single", "temporal"}
