"""The BNN-VI method: the predictive is N weight samples (an explicit loop over keys), the ELBO,
the optimiser's decay mask, and on one trained tiny workdir: training, resuming, every
evaluator, and ``Run.predict``, ``ensemble_sizes`` and the training's evaluation agreeing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import cifar_resnet
from smoothing_jax import methods
from smoothing_jax.experiment.config_base import with_method
from smoothing_jax.layers.mean_field import kl_divergence
from smoothing_jax.methods import bnnvi
from smoothing_jax.models import get_model, is_stochastic
from smoothing_jax.passes import sample_rngs
from smoothing_jax.training import optim
from tests.helpers import (
  ALL_CLASSIFIER_EVALS,
  override,
  tiny_config,
  tiny_run,
  train_resume_and_evaluate,
)
from tests.methods.paths import assert_paths_agree, three_paths


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """``(workdir, data context, {evaluator: result})``: a one-stage ResNet with mean-field kernels
  (the layers and ELBO of vgg_bnnvi_16 at a fraction of its compile time; the configs are checked
  in test_config_base) trained from the command line under TFDS mock data, resumed, and every
  evaluator but temporal run on it (a mean-field model streams as MC dropout does,
  test_temporal, and its scan over frames of weight samples is the longest compile)."""
  tfds = pytest.importorskip("tensorflow_datasets")
  root = tmp_path_factory.mktemp("bnnvi")
  config = tiny_run(cifar_resnet.get_config("resnet_dnn_18,cifar10,runlocal"), num_train_steps=4,
                    ensemble_sizes=(1, 2),
                    **{"input.holdout_fraction": 0.25, "model_kwargs.stage_sizes": (1,),
                       "model_kwargs.mean_field": True})
  results = train_resume_and_evaluate(config, root, ALL_CLASSIFIER_EVALS[:-1])
  return str(root / "run"), functools.partial(tfds.testing.mock_data, num_examples=16), results


@pytest.fixture(scope="module")
def mean_field_resnet():
  """A one-stage ResNet with mean-field kernels (BatchNorm deterministic) and its variables."""
  model = get_model("resnet_dnn_18", 4, width=4, stage_sizes=(1,), mean_field=True)
  variables = jax.jit(model.init)({"params": jax.random.key(0), "noise": jax.random.key(1)},
                                  jnp.zeros((1, 16, 16, 3)))
  return model, variables


def test_the_predictive_is_the_mean_of_n_weight_samples(mean_field_resnet):
  model, variables = mean_field_resnet
  method = methods.resolve(None, model)
  assert isinstance(method, bnnvi.BNNVI) and method.name == "bnnvi"
  images = jax.random.normal(jax.random.key(2), (3, 16, 16, 3))
  rng = jax.random.key(3)
  pred = method.with_samples(3).predict(variables, images, rng=rng)
  one_pass = jax.jit(lambda key: jax.nn.softmax(model.apply(variables, images, train=False,
                                                            rngs=sample_rngs(key))))
  loop = [np.asarray(one_pass(key), np.float64) for key in jax.random.split(rng, 3)]
  np.testing.assert_allclose(pred.sample_probs, np.stack(loop), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pred.mean_probs, np.mean(loop, axis=0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(loop[0], loop[1])  # weight samples differ


def test_the_elbo_is_mean_nll_plus_annealed_kl_over_n_and_decay_skips_the_posterior(
    mean_field_resnet):
  config = override(with_method(tiny_config(), "bnnvi"), **{"bnnvi.kl_anneal_epochs": 2})
  model, variables = mean_field_resnet
  assert is_stochastic(model) and model.weights == "mean_field"
  batch = {"image": jax.random.normal(jax.random.key(2), (4, 16, 16, 3)),
           "label": jnp.array([0, 1, 2, 3])}
  loss_fn = methods.resolve(config, model).loss(config, num_train=100, steps_per_epoch=10)

  @jax.jit
  def elbo_and_nll(step):
    """The loss, its metrics, and the NLL of one training pass drawn from the loss's key."""
    key = jax.random.key(3)
    loss, aux = loss_fn(variables["params"], variables["batch_stats"], batch, key, step)
    logits, _ = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"],
                            rngs=sample_rngs(key))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, aux["metrics"], nll

  kl = kl_divergence(variables["params"], 0.1)
  for step, beta in ((0, 0.0), (15, 0.5), (40, 1.0)):
    loss, metrics, nll = elbo_and_nll(step)
    assert float(metrics["kl_weight"]) == beta
    np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-5)
    np.testing.assert_allclose(metrics["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(loss, nll + beta * kl / 100, rtol=1e-5)
  # Zero gradients at rate 1: the update is −0.5·w where weight decay 0.5 applies, else 0.
  tx = optim.create_optimizer(override(config, weight_decay=0.5, momentum=0.0), lambda s: 1.0,
                              model)
  params = jax.tree.map(lambda p: p + 1.0, variables["params"])  # biases 0 → 1
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  head, conv, bn = (updates["classifier_0"], updates["layer1_0"]["conv1"],
                    updates["layer1_0"]["bn1"])
  np.testing.assert_allclose(head["bias"], -0.5 * np.asarray(params["classifier_0"]["bias"]))
  np.testing.assert_allclose(bn["scale"], -0.5 * np.asarray(params["layer1_0"]["bn1"]["scale"]))
  for layer in (head, conv):  # the posterior's μ and ρ: regularised by the KL alone
    assert not np.any(np.asarray(layer["kernel"])) and not np.any(np.asarray(layer["kernel_rho"]))
  assert bnnvi.decay_mask(variables["params"])["classifier_0"] == {
      "bias": True, "kernel": False, "kernel_rho": False}


def test_trains_resumes_and_runs_every_evaluator_from_the_command_line(trained):
  _, _, results = trained
  rows = results["ensemble_sizes"]
  assert [r["ensemble_size"] for r in rows] == [1, 2] and rows[0]["nll"] != rows[1]["nll"]
  for name in ("calibration", "selective", "ood"):
    assert {r["ensemble_size"] for r in results[name]} == {1, 2}, name
  assert np.isfinite(results["corruptions"]["mean_err"])
  assert {r["method"] for r in results["ensemble_sizes"]} == {"bnnvi"}


def test_predict_the_evaluators_and_the_training_evaluation_agree(trained, tmp_path):
  workdir, data, _ = trained
  assert_paths_agree(three_paths(workdir, tmp_path, data=data))
  assert_paths_agree(three_paths(workdir, tmp_path, num_samples=2, data=data))


def test_uncertainty_baselines_vi_recipe_builds_its_wrn_and_anneals_beta_per_step():
  """``configs/cifar_resnet.py:wideresnet_bnnvi_28_10`` is uncertainty-baselines'
  ``baselines/cifar/variational_inference.py`` (commit 163351d4): its WRN (72,940,426
  parameters, no conv bias, the stride on ``conv1`` of stage 2's first block), counted from
  abstract shapes, nothing compiled; its recipe; β = min(1, (step + 1) / (steps per epoch ·
  200))."""
  from flax.traverse_util import flatten_dict

  from smoothing_jax.experiment.spec import ModelSpec, build_model
  from tests.helpers import abstract_variables
  config = cifar_resnet.get_config("wideresnet_bnnvi_28_10,cifar10")
  assert (config.optimizer, config.momentum, config.nesterov) == ("sgd", 0.9, True)
  assert (config.input.batch_size, config.base_batch_size, config.learning_rate) == (512, 128, 0.1)
  assert config.weight_decay == pytest.approx(8e-4)  # Keras L2 4e-4 · ‖w‖²
  assert (config.warmup_epochs, config.num_epochs, config.lr_milestones, config.lr_decay) == (
      1, 249, (74, 149, 199), 0.2)
  assert (config.bnnvi.kl_anneal_epochs, config.bnnvi.kl_anneal_per_step,
          config.bnnvi.prior_std) == (200, True, 0.1)
  assert (config.input.holdout_fraction, config.ece_bins) == (0.05, 15)
  model = build_model(config, ModelSpec(num_classes=10, stem="cifar", image_shape=(32, 32, 3)))
  variables = abstract_variables(model)
  params = flatten_dict(variables["params"], sep="/")
  assert sum(int(np.prod(p.shape)) for p in params.values()) == 72_940_426
  biases = [k for k in params if k.endswith("/bias")]
  assert biases and all(k.split("/")[-2].startswith("bn") or k == "linear/bias" for k in biases)

  def conv_outputs(variables, images):
    _, state = model.apply(variables, images, train=False, rngs=sample_rngs(jax.random.key(0)),
                           capture_intermediates=True, mutable=["intermediates"])
    block = state["intermediates"]["layer2_0"]
    return block["conv1"]["__call__"][0], block["conv2"]["__call__"][0]

  conv1, conv2 = jax.eval_shape(conv_outputs, variables,
                                jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32))
  assert conv1.shape == conv2.shape == (1, 16, 16, 320)  # 32 → 16 at conv1
  objective = bnnvi.Objective(0.1, None, 100, steps_per_epoch=10, kl_anneal_epochs=4,
                              kl_anneal_per_step=True)
  assert [float(bnnvi.annealed_kl_weight(s, objective)) for s in (0, 19, 39, 400)] == [
      np.float32(1 / 40), 0.5, 1.0, 1.0]
  assert float(bnnvi.annealed_kl_weight(15, objective._replace(kl_anneal_per_step=False))) == 0.25


def test_the_ibnn_repository_bnnvi_trains_with_adam_and_decays_no_variational_parameter():
  """``configs/cifar_ibnn.py:wideresnet_bayesian_28_10`` is the iBNN repository's BNN-VI (its
  ``train.py`` at 665ba40): the BNN-VI method with the fixed prior N(1, 0.5²), whose KL covers
  every variational kernel and bias, and Adam at 1e-3 without decay (optax.adam's β 0.9/0.999
  and ε 1e-8 are torch's); the decay mask skips every σ and μ (the stem conv and BatchNorm
  alone are deterministic).  Shapes only, nothing compiled."""
  from flax.traverse_util import flatten_dict

  from configs import cifar_ibnn
  from smoothing_jax.experiment.spec import ModelSpec, build_model
  from tests.helpers import abstract_variables
  config = cifar_ibnn.get_config("wideresnet_bayesian_28_10,cifar10")
  model = build_model(config, ModelSpec(num_classes=10, stem="cifar", image_shape=(32, 32, 3)))
  assert isinstance(methods.resolve(config, model), bnnvi.BNNVI)
  assert (model.bnn_reference, model.point_stem, model.posterior_std_init) == ("ibnn", True, 0.015)
  assert (config.bnnvi.prior_mean, config.bnnvi.prior_std, config.bnnvi.kl_anneal_epochs) == (
      1.0, 0.5, 200)
  params = abstract_variables(model)["params"]
  mask = flatten_dict(bnnvi.decay_mask(params), sep="/")
  decayed = {k for k, on in mask.items() if on}
  assert decayed == {k for k in mask if k.startswith("conv1/") or "bn" in k.split("/")[-2]}
  assert {"conv1/kernel", "conv1/bias", "bn1/scale"} <= decayed
  # One Adam step at rate 1e-3 from any gradient: −1e-3 · g / (|g| + ε) on every parameter.
  tiny = get_model("resnet_dnn_18", 4, width=4, stage_sizes=(1,), mean_field=True,
                   bnn_reference="ibnn")
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype),
                        abstract_variables(tiny, (1, 16, 16, 3))["params"])
  assert "bias_rho" in params["classifier_0"]
  tx = optim.create_optimizer(config, lambda step: config.learning_rate, tiny)
  grads = jax.tree.map(lambda p: 0.5 * p, params)
  updates, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)
  for update in jax.tree.leaves(updates):
    np.testing.assert_allclose(update, -1e-3, rtol=2e-5)  # float32 bias corrections
