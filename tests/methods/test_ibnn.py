"""iBNN: noisy nodes, KL, component assignment, K×S inference, folding, training steps (the node
noise layers: test_layers.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from smoothing_jax import methods
from smoothing_jax.methods import ibnn
from smoothing_jax.models import get_model
from smoothing_jax.passes import sample_rngs
from smoothing_jax.plots import plot_ood_curves
from tests.helpers import (
  abstract_variables,
  evaluate_workdir,
  init_variables,
  model_options,
  override,
  tiny_run,
)
from tests.methods.paths import assert_paths_agree, three_paths

# Two of VGG-16's five stages, one convolution each: every layer kind of the iBNN VGG (noisy
# convolutions, pooling, the noisy mlp512 head) at a fraction of the compile time.
TWO_STAGES = (1, 1)


@pytest.fixture(scope="module")
def tiny_vgg():
  model = get_model("vgg_ibnn_16", 5, num_components=3, width=4, stage_sizes=TWO_STAGES)
  return model, init_variables(model, (2, 32, 32, 3))


@pytest.mark.parametrize("name,nodes", [("wideresnet_ibnn_28_10", 9475), ("vgg_ibnn_16", 5251)])
def test_noisy_input_nodes_per_component(name, nodes):
  # WRN-28-10: stem 3 + stage inputs (16+160+16 + 3·320) + (160+320+160 + 3·640)
  # + (320+640+320 + 3·1280) + head 640.
  # VGG-16 (reference StoVGG16): 13 convs 3715 + three dense layers 3·512 = 5251.
  model = get_model(name, 10, num_components=2)
  shapes = abstract_variables(model)
  assert ibnn.num_noise_nodes(shapes["params"]) == nodes
  assert all(layer["z_mean"].shape[0] == 2 for layer in ibnn.noise_layers(shapes["params"]))


def test_kl_matches_numpy(tiny_vgg):
  _, variables = tiny_vgg
  params = jax.jit(lambda p: jax.tree.map(  # (one compiled call, not one per leaf shape)
      lambda x: x + 0.1 * jax.random.normal(jax.random.key(5), x.shape), p))(variables["params"])
  expected = 0.0
  for layer in ibnn.noise_layers(params):
    for m, r in (("z_mean", "z_rho"), ("b_mean", "b_rho")):
      mu, sigma = np.asarray(layer[m],
                             np.float64), np.log1p(np.exp(np.asarray(layer[r], np.float64)))
      k = mu.shape[0]
      mean, std, s = mu.mean(0), np.sqrt((sigma ** 2).sum(0)) / k, 0.3
      expected += np.sum(np.log(s / std) + (std ** 2 + (mean - 1.0) ** 2) / (2 * s ** 2) - 0.5)
  kl = jax.jit(ibnn.kl_divergence, static_argnums=1)(params, 0.3)
  np.testing.assert_allclose(float(kl), expected, rtol=1e-5)


def test_component_assignment_is_repeat_interleave_then_round_robin():
  images = jnp.arange(3.0).reshape(3, 1, 1, 1)
  rep, labels, components = ibnn.repeat_batch(images, jnp.array([7, 8, 9]), 2, 4)
  assert rep[:, 0, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]
  assert labels.tolist() == [7, 7, 8, 8, 9, 9]
  assert components.tolist() == [0, 1, 2, 3, 0, 1]


def test_the_predictive_equals_the_loop_over_components_and_keys(tiny_vgg):
  """The method's predictive (S = 2 draws of each of K = 3 components) against single passes,
  component k's draw s with key ``split(key, K·S)[k·S + s]``, sample-major, averaged in numpy."""
  model, variables = tiny_vgg
  images = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))
  rng = jax.random.key(4)
  pred = methods.resolve(None, model).with_samples(2).predict(variables, images, rng=rng)
  assert pred.sample_probs.shape == (6, 2, 5)
  keys = jax.random.split(rng, 6).reshape(3, 2)
  one_pass = jax.jit(lambda k, key: jax.nn.softmax(model.apply(
      variables, images, components=jnp.full((2,), k), rngs=sample_rngs(key))))
  loop = np.zeros((6, 2, 5))
  for k in range(3):
    for s in range(2):
      loop[s * 3 + k] = one_pass(k, keys[k, s])
  np.testing.assert_allclose(pred.sample_probs, loop, atol=1e-5)
  np.testing.assert_allclose(pred.mean_probs, loop.mean(0), atol=1e-6)
  with pytest.raises(ValueError, match="num_samples"):
    ibnn.ibnn_predict(model, variables, images, num_samples=0, rng=rng)


def test_fold_component_reproduces_the_noisy_model_at_the_component_mean(tiny_vgg):
  model, variables = tiny_vgg
  sharp = jax.tree_util.tree_map_with_path(
      lambda p, v: jnp.full_like(v, -30.0) if p[-1].key in ("z_rho", "b_rho") else v, variables)
  images = jax.random.normal(jax.random.key(6), (2, 32, 32, 3))
  det = get_model("vgg_dnn_16", 5, width=4, batch_norm=False, classifier="mlp512",
                  stage_sizes=TWO_STAGES)
  for k in range(3):
    noisy = model.apply(sharp,
                        images,
                        components=jnp.full((2,), k),
                        rngs=sample_rngs(jax.random.key(0)))
    folded = det.apply(ibnn.fold_component(sharp, k), images)
    np.testing.assert_allclose(noisy, folded, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="out of range"):
    ibnn.fold_component(variables, 3)


def test_pretrained_deterministic_weights_load_and_mismatches_are_named(tiny_vgg):
  model, variables = tiny_vgg
  det = get_model("vgg_dnn_16", 5, width=4, batch_norm=False, classifier="mlp512",
                  stage_sizes=TWO_STAGES)
  det_params = init_variables(det, (2, 32, 32, 3))["params"]
  loaded = ibnn.load_deterministic(variables["params"], det_params)
  np.testing.assert_array_equal(loaded["layer0_0"]["conv"]["kernel"],
                                det_params["layer0_0"]["conv"]["kernel"])
  np.testing.assert_array_equal(loaded["layer0_0"]["conv"]["z_mean"],
                                variables["params"]["layer0_0"]["conv"]["z_mean"])
  wrong = init_variables(get_model("vgg_dnn_16", 5, width=8, batch_norm=False, classifier="mlp512",
                                   stage_sizes=TWO_STAGES), (2, 32, 32, 3))["params"]
  with pytest.raises(ValueError, match="does not match the iBNN architecture"):
    ibnn.load_deterministic(variables["params"], wrong)


def test_training_steps_lower_the_negative_elbo(tiny_vgg):
  model, variables = tiny_vgg
  objective = ibnn.Objective(num_components=3,
                             num_repeats=2,
                             prior_mean=1.0,
                             prior_std=0.3,
                             num_train=64,
                             steps_per_epoch=1,
                             kl_anneal_epochs=1).check()
  tx = ibnn.create_optimizer(0.01, variational_lr=0.5, weight_decay=5e-4)
  images = jax.random.normal(jax.random.key(7), (8, 32, 32, 3))
  labels = jnp.arange(8) % 5

  @jax.jit
  def step(params, opt_state, i):
    (loss, aux), grads = jax.value_and_grad(
        functools.partial(ibnn.elbo_loss, model, objective), has_aux=True)(
            params, {}, images, labels, jax.random.key(i), 5)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = variables["params"], tx.init(variables["params"])
  losses = []
  for i in range(15):
    params, opt_state, loss = step(params, opt_state, i)
    losses.append(float(loss))
  assert np.mean(losses[-3:]) < losses[0]
  # The deterministic and variational groups both moved.
  assert not np.allclose(params["layer0_0"]["conv"]["kernel"],
                         variables["params"]["layer0_0"]["conv"]["kernel"])
  assert not np.allclose(params["layer0_0"]["conv"]["z_mean"],
                         variables["params"]["layer0_0"]["conv"]["z_mean"])


def test_bad_settings_are_rejected():
  base = dict(num_components=2,
              num_repeats=2,
              prior_mean=1.0,
              prior_std=0.1,
              num_train=10,
              steps_per_epoch=1,
              kl_anneal_epochs=1)
  for key, value, match in (("num_components", 0, "K"), ("num_repeats", 0, "S"), ("prior_std", 0.0,
                                                                                  "prior_std")):
    with pytest.raises(ValueError, match=match):
      ibnn.Objective(**{**base, key: value}).check()
  with pytest.raises(ValueError, match="num_components"):
    get_model("vgg_ibnn_16", 10, num_components=0)
  with pytest.raises(ValueError, match="no iBNN variant"):
    init_variables(get_model("resnet_dnn_18", 10, num_components=2, width=4), (2, 32, 32, 3))
  with pytest.raises(ValueError, match="iBNN model"):
    ibnn.ibnn_predict(get_model("vgg_dnn_16", 10), {},
                      jnp.zeros((1, 32, 32, 3)),
                      rng=jax.random.key(0))


def test_salt_and_pepper_matches_the_reference():
  """IB ``ood_test.add_imnoise`` in numpy: ``img[u < p] = 0`` then ``img[u > 1 - p] = 1``."""
  images = np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype(np.float32)
  key = jax.random.key(3)
  u = np.asarray(jax.random.uniform(key, images.shape))
  for p in (0.1, 0.25, 0.5):
    expected = images.copy()
    expected[u < p] = 0.0
    expected[u > 1 - p] = 1.0
    noisy = np.asarray(ibnn.salt_and_pepper(jnp.asarray(images), p, key))
    np.testing.assert_array_equal(noisy, expected)
    assert abs(np.mean(noisy != images) - 2 * p) < 0.03  # 2p of the values change


def test_ood_curves_rise_with_blending(tiny_vgg):
  model, variables = tiny_vgg
  images = jax.random.normal(jax.random.key(8), (4, 32, 32, 3))
  def predict(x):
    return ibnn.ibnn_predict(model, variables, x, num_samples=2,
                             rng=jax.random.key(0)).sample_probs

  curves = ibnn.ood_entropy_curves(predict, images, "salt_pepper", levels=[0.0, 0.5])
  np.testing.assert_allclose(curves["total"], curves["aleatoric"] + curves["epistemic"], rtol=1e-5)
  assert curves["total"].shape == (2,)
  assert plot_ood_curves(curves, "salt and pepper").axes[0].get_ylabel() == "entropy (nats)"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """``(root, config, final state, ensemble_sizes rows, data context)``: a deterministic VGG
  trained 2 steps, then an iBNN of K = 3 started from it (its weights frozen) trained 4, under
  TFDS mock data, and its ensemble-size table."""
  tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10 under TFDS mock data

  from configs import cifar_ibnn, cifar_resnet
  from smoothing_jax.training import train

  root = tmp_path_factory.mktemp("ibnn")
  det = tiny_run(cifar_resnet.get_config("vgg_dnn_16,cifar10,runlocal"),
                 num_train_steps=2,
                 **model_options(batch_norm=False, classifier="mlp512",
                                 stage_sizes=TWO_STAGES))
  config = tiny_run(cifar_ibnn.get_config("vgg_ibnn_16,cifar10,3,runlocal"),
                    num_train_steps=4,
                    **{
                        "ibnn.pretrained_workdir": str(root / "det"),
                        "ibnn.freeze_deterministic": True,
                        "model_kwargs.stage_sizes": TWO_STAGES
                    })
  data = functools.partial(tfds.testing.mock_data, num_examples=16)
  with data():
    train.train_from_config(det, str(root / "det"))
    state = train.train_from_config(config, str(root / "ibnn"))
    rows = evaluate_workdir("ensemble_sizes", str(root / "ibnn"), str(root / "results"), config)
  return root, config, state, rows, data


def test_end_to_end_from_a_deterministic_checkpoint_under_mock_data(trained):
  from configs import cifar_ibnn
  from smoothing_jax.experiment.checkpoints import load_variables
  from smoothing_jax.parallel import create_mesh
  from smoothing_jax.training import train

  root, config, state, rows, data = trained
  _, det_variables = load_variables(str(root / "det"), create_mesh())
  kernel = state.params["layer0_0"]["conv"]["kernel"]
  np.testing.assert_array_equal(kernel,
                                det_variables["params"]["layer0_0"]["conv"]["kernel"])  # frozen U
  init_rng = jax.random.split(jax.random.key(config.seed), 3)[0]  # as train_from_config
  model = get_model("vgg_ibnn_16", 10, num_components=3, width=4, noise_init_std=0.75,
                    stage_sizes=TWO_STAGES)
  start = jax.jit(model.init)({
      "params": init_rng,
      **sample_rngs(init_rng)
  }, jnp.zeros((1, 32, 32, 3)))["params"]
  np.testing.assert_array_equal(start["layer0_0"]["conv"]["kernel"].shape, kernel.shape)
  assert not np.allclose(state.params["layer0_0"]["conv"]["z_mean"],
                         start["layer0_0"]["conv"]["z_mean"])
  assert [r["ensemble_size"] for r in rows] == [1, 2, 5, 6]  # K·S = 3·2 predictions, nested
  assert all(r["count"] == 16 and r["method"] == "ibnn" for r in rows)

  wrong = tiny_run(cifar_ibnn.get_config("vgg_ibnn_16,cifar10,3,runlocal"), num_train_steps=2,
                   **{"ibnn.pretrained_workdir": str(root / "det"), "model_kwargs.width": 8,
                      "model_kwargs.stage_sizes": TWO_STAGES})
  with data(), pytest.raises(ValueError, match="does not match"):
    train.train_from_config(wrong, str(root / "wrong"))


def test_predict_the_evaluators_and_the_training_evaluation_agree(trained, tmp_path):
  """One draw of each component (S = 1) in all three paths, and S = 2 (N = K·S = 6) in
  ``Run.predict`` and the evaluators: the predictive ``Run.predict`` had no iBNN branch for
  (it scored row r with component r mod K)."""
  root, _, _, _, data = trained
  workdir = str(root / "ibnn")
  assert_paths_agree(three_paths(workdir, tmp_path, overrides={"ibnn.eval_samples": 1},
                                 data=data))
  assert_paths_agree(three_paths(workdir, tmp_path, num_samples=2, data=data))


def test_the_method_predicts_k_times_s_draws_and_refuses_what_it_cannot_do(tiny_vgg):
  from configs import cifar_ibnn
  model, variables = tiny_vgg
  method = methods.resolve(None, model)
  assert isinstance(method, ibnn.IBNN) and method.num_samples == 5 and method.num_draws == 15
  assert method.nested((1, 2, 20)) == (method, (1, 2, 15))
  images = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))
  rng = jax.random.key(4)
  by_method = method.with_samples(2).predict(variables, images, rng=rng)
  by_function = ibnn.ibnn_predict(model, variables, images, num_samples=2, rng=rng)
  np.testing.assert_array_equal(by_method.sample_probs, by_function.sample_probs)
  def config(**values):
    return override(cifar_ibnn.get_config("vgg_ibnn_16,cifar10,3"), **values)
  with pytest.raises(ValueError, match=r"is an iBNN, already a mixture of 3 components .*"
                     r"deep_ensemble.members=1\.$"):
    methods.resolve(config(**{"deep_ensemble.members": 2}), model)
  with pytest.raises(ValueError, match="^label_smoothing / mixup_alpha / cutmix_alpha are not "):
    methods.resolve(config(label_smoothing=0.1), model)


def test_kl_weight_anneals_per_epoch():
  objective = ibnn.Objective(2, 2, 1.0, 0.1, 100, steps_per_epoch=10, kl_anneal_epochs=4)
  assert [float(ibnn.kl_weight(s, objective)) for s in (0, 9, 10, 25, 40, 400)
         ] == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
  assert float(ibnn.kl_weight(0, objective._replace(kl_anneal_epochs=0))) == 1.0


def test_sample_outputs_are_the_draws_of_the_predictive(tiny_vgg):
  """Each draw's logits (and classifier input) in the sample-major order of the predictive;
  per-draw images go to their own draw (ODIN's steps)."""
  model, variables = tiny_vgg
  images = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))
  rng = jax.random.key(4)
  method = methods.resolve(None, model).with_samples(2)
  outputs = jax.jit(lambda x: method.sample_outputs(variables, x, rng))
  out = outputs(images)
  assert out["logits"].shape == (6, 2, 5) and out["features"].shape[:2] == (6, 2)
  np.testing.assert_allclose(jax.nn.log_softmax(out["logits"]),
                             method.sample_log_probs(variables, images, rng), atol=1e-5)
  per_draw = outputs(jnp.stack([images * (1 + d) for d in range(6)]))
  for d in (1, 4):
    np.testing.assert_allclose(per_draw["logits"][d], outputs(images * (1 + d))["logits"][d],
                               atol=1e-5)
