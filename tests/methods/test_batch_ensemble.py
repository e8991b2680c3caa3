"""The BatchEnsemble method: the predictive is the M members (an explicit loop over members),
training repeats the batch, the optimiser's fast-weight rate and decay, what it cannot be, and
on one trained tiny workdir: training, resuming, every evaluator, and ``Run.predict``,
``ensemble_sizes`` and the training's evaluation agreeing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import cifar_resnet
from smoothing_jax import methods
from smoothing_jax.experiment.config_base import with_method
from smoothing_jax.methods.batch_ensemble import BatchEnsemble
from smoothing_jax.methods.losses import supervised_loss
from smoothing_jax.models import get_model
from smoothing_jax.training import optim
from tests.helpers import init_variables, override, tiny_config, tiny_run, train_resume_and_evaluate
from tests.methods.paths import assert_every_evaluator_reports, assert_paths_agree, three_paths

M = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """``(workdir, {evaluator: result})`` of a tiny BatchEnsemble (2 members) trained from the
  command line under TFDS mock data, resumed, and every evaluator run on it."""
  tfds = pytest.importorskip("tensorflow_datasets")
  root = tmp_path_factory.mktemp("batch_ensemble")
  config = tiny_run(cifar_resnet.get_config("resnet_batchensemble_18,cifar10,runlocal"),
                    num_train_steps=4, **{"input.holdout_fraction": 0.25,
                                          "model_kwargs.stage_sizes": (1,),
                                          "model_kwargs.ensemble_size": 2})
  results = train_resume_and_evaluate(config, root)
  return str(root / "run"), functools.partial(tfds.testing.mock_data, num_examples=16), results


@pytest.fixture(scope="module")
def tiny_batch_ensemble():
  model = get_model("resnet_batchensemble_18", 5, ensemble_size=M, width=4, stage_sizes=(1,))
  return model, init_variables(model, (2, 16, 16, 3))


def test_the_predictive_is_the_members_and_training_repeats_the_batch(tiny_batch_ensemble):
  model, variables = tiny_batch_ensemble
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  labels = jnp.array([0, 1, 2, 3])
  method = methods.resolve(None, model)
  assert isinstance(method, BatchEnsemble) and method.nested() == (method, (1, 2, 3))
  prediction = method.predict(variables, images, rng=jax.random.key(0))
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
    loss_fn = supervised_loss(model, tile=method.tile)
    loss, aux = loss_fn(variables["params"], variables["batch_stats"],
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
  members_mean = methods.resolve(None, model).predict(variables, frame,
                                                      rng=jax.random.key(0)).mean_probs
  assert set(out) == {"single", "temporal"}  # no MC row: two passes are the same members
  for method in ("single", "temporal"):
    np.testing.assert_allclose(out[method], np.stack([members_mean] * 2), rtol=1e-5, atol=1e-6)


def test_fast_weights_learn_at_the_multiplied_rate_without_decay(tiny_batch_ensemble):
  model, variables = tiny_batch_ensemble
  config = override(with_method(tiny_config(), "batch_ensemble"), weight_decay=0.1, momentum=0.0,
                    nesterov=False,
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


def test_a_batch_ensemble_is_not_trained_as_a_deep_ensemble_of_batch_ensembles():
  config = override(cifar_resnet.get_config("resnet_batchensemble_18"),
                    **{"deep_ensemble.members": 2})
  with pytest.raises(ValueError, match=r"BatchEnsemble of 4 members already; train it with "
                     r"deep_ensemble.members=1\.$"):
    methods.resolve(config, get_model("resnet_batchensemble_18", 10))
  with pytest.raises(ValueError, match="^optimizer 'adamw' decays every parameter"):
    methods.resolve(override(config, optimizer="adamw", **{"deep_ensemble.members": 1}),
                    get_model("resnet_batchensemble_18", 10))


def test_trains_resumes_and_runs_every_evaluator_from_the_command_line(trained):
  assert_every_evaluator_reports(trained[2], "batch_ensemble")


def test_predict_the_evaluators_and_the_training_evaluation_agree(trained, tmp_path):
  workdir, data, _ = trained
  assert_paths_agree(three_paths(workdir, tmp_path, data=data))


def test_sample_outputs_are_the_members_of_the_predictive(tiny_batch_ensemble):
  """Each member's logits (and classifier input) as the predictive's; per-member images go to
  their own member (ODIN's steps)."""
  model, variables = tiny_batch_ensemble
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  method = methods.resolve(None, model)
  outputs = jax.jit(lambda x: method.sample_outputs(variables, x, None))
  out = outputs(images)
  assert out["logits"].shape == (M, 4, 5) and out["features"].shape[:2] == (M, 4)
  np.testing.assert_allclose(jax.nn.log_softmax(out["logits"]),
                             method.sample_log_probs(variables, images, None), atol=1e-5)
  per_member = outputs(jnp.stack([images * (1 + m) for m in range(M)]))
  for m in range(M):
    np.testing.assert_allclose(per_member["logits"][m], outputs(images * (1 + m))["logits"][m],
                               atol=1e-5)
