"""The MIMO method: uncertainty-baselines' parameter count of ``wideresnet_mimo_28_10`` and its
training batch (a numpy transcription of ``baselines/cifar/mimo.py``), the predictive against an
explicit loop over heads, what it refuses, and on one trained tiny workdir: training, resuming,
every evaluator, and ``Run.predict``, ``ensemble_sizes`` and the training's evaluation agreeing.

uncertainty-baselines: google/uncertainty-baselines at commit
163351d4c92340a80e572bc376ec837d8e96399d (``baselines/cifar/mimo.py``,
``uncertainty_baselines/models/wide_resnet_mimo.py``)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import cifar_resnet
from smoothing_jax import methods
from smoothing_jax.experiment.config_base import with_method
from smoothing_jax.methods.mimo import (
  MIMO,
  mimo_batch_indices,
  shuffled_rows,
  training_indices,
)
from smoothing_jax.models import get_model
from smoothing_jax.passes import pass_outputs
from tests.helpers import (
  abstract_variables,
  init_variables,
  override,
  tiny_config,
  tiny_run,
  train_resume_and_evaluate,
)
from tests.methods.paths import assert_every_evaluator_reports, assert_paths_agree, three_paths

M = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """``(workdir, mock data, {evaluator: result})`` of a tiny MIMO (2 members, 2 batch
  repetitions) trained from the command line under TFDS mock data, resumed, and every evaluator
  run on it."""
  tfds = pytest.importorskip("tensorflow_datasets")
  root = tmp_path_factory.mktemp("mimo")
  config = tiny_run(cifar_resnet.get_config("resnet_mimo_18,cifar10,runlocal"),
                    num_train_steps=4, **{"input.holdout_fraction": 0.25,
                                          "model_kwargs.stage_sizes": (1,),
                                          "model_kwargs.mimo_members": 2,
                                          "mimo.batch_repetitions": 2})
  results = train_resume_and_evaluate(config, root)
  return str(root / "run"), functools.partial(tfds.testing.mock_data, num_examples=16), results


@pytest.fixture(scope="module")
def tiny_mimo():
  model = get_model("resnet_mimo_18", 5, width=4, stage_sizes=(1,))
  return model, init_variables(model, (2, 16, 16, 3))


def test_wideresnet_mimo_28_10_has_uncertainty_baselines_parameter_count():
  """``wide_resnet_mimo(input_shape=[3, 32, 32, 3], depth=28, width_multiplier=10,
  num_classes=10, ensemble_size=3)`` (mimo.py's call), its layers by hand: a 3×3 stem conv
  without bias on the 3·M concatenated channels; per block BN-ReLU-conv3×3-BN-ReLU-conv3×3 (no
  biases) and a 1×1 shortcut conv where the shape changes; a final BN; ``DenseMultihead``, one
  dense of M·C units with bias.  Keras's ``count_params`` (the README's 36.5M) counts the BN
  moving mean and variance too."""
  m, classes = 3, 10

  def bn(c):       # γ, β (trainable)
    return 2 * c

  def conv(k, c_in, c_out):
    return k * k * c_in * c_out

  def block(c_in, c_out):
    shortcut = conv(1, c_in, c_out) if c_in != c_out else 0  # or a stride: only with c_in ≠ c_out
    return bn(c_in) + conv(3, c_in, c_out) + bn(c_out) + conv(3, c_out, c_out) + shortcut

  trainable = conv(3, 3 * m, 16)                                   # stem: 1,296
  c_in = 16
  for c in (160, 320, 640):                                        # 16·k, 32·k, 64·k, k = 10
    trainable += block(c_in, c) + 3 * block(c, c)                  # (28 − 4) / 6 = 4 blocks
    c_in = c
  trainable += bn(640) + 640 * m * classes + m * classes           # head BN, DenseMultihead
  # stage 1: 256,352 + 3·461,440; stage 2: 1,434,560 + 3·1,844,480; stage 3: 5,736,320 +
  # 3·7,375,360; 1,296 + 1,640,672 + 6,968,000 + 27,862,400 + 1,280 + 19,230:
  assert trainable == 36_492_878
  bn_channels = (16 + 160 + 3 * 320) + (160 + 320 + 3 * 640) + (320 + 640 + 3 * 1280) + 640
  keras_count = trainable + 2 * bn_channels                        # + moving mean and variance
  assert keras_count == 36_510_830 and round(keras_count / 1e6, 1) == 36.5

  model = get_model("wideresnet_mimo_28_10", classes)
  assert model.mimo_members == m
  variables = abstract_variables(model)   # shapes only (jax.eval_shape), nothing compiled
  count = {name: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
           for name, tree in variables.items()}
  assert count == {"params": trainable, "batch_stats": 2 * bn_channels}
  assert variables["params"]["conv1"]["kernel"].shape == (3, 3, 3 * m, 16)
  assert variables["params"]["linear"]["dense"]["kernel"].shape == (640, m * classes)


def uncertainty_baselines_batch(rng, batch_size, ensemble_size, batch_repetitions,
                                input_repetition_probability):
  """A numpy transcription of mimo.py's ``step_fn`` (lines 247-259), ``tf.random.shuffle`` as
  ``rng.permutation``: returns ``[B·R, M]`` example indices and the draws it made."""
  draws = []

  def shuffle(x):
    draws.append(rng.permutation(len(x)))
    return x[draws[-1]]

  main_shuffle = shuffle(np.tile(np.arange(batch_size), [batch_repetitions]))
  to_shuffle = np.int32(np.float32(main_shuffle.shape[0])
                        * np.float32(1. - input_repetition_probability))
  shuffle_indices = [
      np.concatenate([shuffle(main_shuffle[:to_shuffle]), main_shuffle[to_shuffle:]], axis=0)
      for _ in range(ensemble_size)]
  # images = tf.stack([tf.gather(images, indices, axis=0) for indices in ...], axis=1)
  return np.stack(shuffle_indices, axis=1), draws


def test_training_batch_is_uncertainty_baselines_batching():
  for batch_size, repetitions, p in [(8, 4, 0.0), (5, 3, 0.5), (6, 1, 1.0), (7, 2, 0.3)]:
    rng = np.random.default_rng(batch_size)
    expected, draws = uncertainty_baselines_batch(rng, batch_size, M, repetitions, p)
    main_permutation, *member_permutations = draws
    main_shuffle = np.tile(np.arange(batch_size), repetitions)[main_permutation]
    ours = mimo_batch_indices(main_shuffle, np.stack(member_permutations))
    np.testing.assert_array_equal(ours, expected, err_msg=str((batch_size, repetitions, p)))

  # The key's draws: every member sees each example R times, the rows after the first T are the
  # same example for every member, the first T differ between members.
  draw = jax.jit(training_indices, static_argnums=(1, 2, 3, 4))
  for batch_size, repetitions, p in [(8, 4, 0.0), (7, 2, 0.3)]:
    rows = batch_size * repetitions
    t = shuffled_rows(rows, p)
    index = np.asarray(draw(jax.random.key(batch_size), batch_size, M, repetitions, p))
    assert index.shape == (rows, M)
    for m in range(M):
      assert np.bincount(index[:, m], minlength=batch_size).tolist() == [repetitions] * batch_size
    assert (index[t:] == index[t:, :1]).all() and not (index[:t] == index[:t, :1]).all()


def test_to_shuffle_is_computed_in_float32():
  # float32(1 − 0.9) · 10 = 1.0000000149 → 1 row; in float64 it is 0.9999999999999998 → 0
  assert shuffled_rows(10, 0.9) == 1 and int(10 * (1 - 0.9)) == 0
  assert shuffled_rows(8, 0.0) == 8 and shuffled_rows(8, 1.0) == 0


def test_the_loss_is_the_heads_summed_on_the_drawn_batch(tiny_mimo):
  model, variables = tiny_mimo
  method = methods.resolve(override(cifar_resnet.get_config("resnet_mimo_18"),
                                    **{"mimo.batch_repetitions": 2}), model)
  assert isinstance(method, MIMO) and method.batch_repetitions == 2
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  labels = jnp.array([0, 1, 2, 3])
  rng = jax.random.key(2)

  @jax.jit
  def loss_and_explicit():
    loss_fn = method.loss(None, num_train=4, steps_per_epoch=1)
    loss, aux = loss_fn(variables["params"], variables["batch_stats"],
                        {"image": images, "label": labels}, rng, 0)
    index = training_indices(jax.random.fold_in(rng, 3), 4, M, 2, 0.0)       # [8, M]
    logits = model.apply(variables, images[index], train=True, mutable=["batch_stats"])[0]
    per_head = [optax.softmax_cross_entropy_with_integer_labels(logits[:, m], labels[index[:, m]])
                .mean() for m in range(M)]
    return loss, aux["labels"], labels[index], jnp.sum(jnp.stack(per_head))

  loss, aux_labels, drawn_labels, explicit = loss_and_explicit()
  np.testing.assert_allclose(loss, explicit, rtol=1e-5)
  np.testing.assert_array_equal(aux_labels, drawn_labels)


def test_the_predictive_is_the_heads_on_the_same_image(tiny_mimo):
  model, variables = tiny_mimo
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  method = methods.resolve(None, model)
  assert isinstance(method, MIMO) and method.nested() == (method, (1, 2, 3))
  prediction = method.predict(variables, images, rng=jax.random.key(0))
  assert prediction.sample_probs.shape == (M, 4, 5)

  @jax.jit
  def explicit():
    # The loop over heads: head m is columns m·C … (m+1)·C − 1 of the one dense layer, on the
    # features of the image fed to all M inputs.
    features = pass_outputs(model, variables, jnp.stack([images] * M, axis=1))["features"]
    head = variables["params"]["classifier_0"]["dense"]
    per_head = jnp.stack([jax.nn.softmax(features @ head["kernel"][:, m * 5:(m + 1) * 5]
                                         + head["bias"][m * 5:(m + 1) * 5]) for m in range(M)])
    # Per-draw images (ODIN's steps): input m takes images[m]; head m is member m.
    per_draw = jnp.stack([images * (1 + m) for m in range(M)])
    outputs = method.sample_outputs(variables, per_draw, None)
    stacked = jnp.swapaxes(model.apply(variables, jnp.swapaxes(per_draw, 0, 1)), 0, 1)
    # The inputs are concatenated channel-major (channel c·M + m: input m's channel c): input 1
    # alone goes through the stem kernel's channels 1, 1 + M, 1 + 2M.
    kernel = variables["params"]["layer0_0"]["kernel"]                       # [3, 3, 3·M, 4]
    stem = jax.lax.conv_general_dilated(images * 2, kernel[:, :, 1::M], (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    one_input = jnp.stack([jnp.zeros_like(images), images * 2, jnp.zeros_like(images)], axis=1)
    _, state = model.apply(variables, one_input, mutable=["intermediates"],
                           capture_intermediates=lambda mdl, name: mdl.name == "layer0_0")
    return (per_head, method.frame_probs(variables, images, None), outputs, stacked, stem,
            state["intermediates"]["layer0_0"]["__call__"][0])

  per_head, frame, outputs, stacked, stem, captured = explicit()
  np.testing.assert_allclose(prediction.sample_probs, per_head, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(prediction.mean_probs, np.mean(per_head, 0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(per_head[0], per_head[1])
  np.testing.assert_allclose(frame, prediction.mean_probs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(outputs["logits"], stacked, atol=1e-5)
  assert outputs["features"].shape[:2] == (M, 4)
  np.testing.assert_allclose(captured, stem, atol=1e-5)


def test_what_mimo_refuses():
  config = override(cifar_resnet.get_config("resnet_mimo_18"), **{"deep_ensemble.members": 2})
  with pytest.raises(ValueError, match=r"MIMO of 3 members already; train it with "
                     r"deep_ensemble.members=1\.$"):
    methods.resolve(config, get_model("resnet_mimo_18", 10))
  config = override(config, label_smoothing=0.1, **{"deep_ensemble.members": 1})
  with pytest.raises(ValueError, match="^MIMO trains each head on its own inputs' labels"):
    methods.resolve(config, get_model("resnet_mimo_18", 10))
  with pytest.raises(ValueError, match="has no MIMO variant"):
    abstract_variables(get_model("vgg_dnn_16", 10, mimo_members=2))
  with pytest.raises(ValueError, match="takes point-estimate weights, not BatchEnsemble"):
    abstract_variables(get_model("resnet_mimo_18", 10, ensemble_size=2))
  with pytest.raises(ValueError, match=r"needs mimo_members \(M\) >= 1"):
    get_model("wideresnet_mimo_28_10", 10, mimo_members=0)


def test_the_config_takes_uncertainty_baselines_mimo_settings():
  config = cifar_resnet.get_config("wideresnet_mimo_28_10,cifar10")
  assert (config.nesterov, config.momentum, config.learning_rate, config.input.batch_size) == (
      True, 0.9, 0.1, 128)
  assert (config.weight_decay, config.warmup_epochs + config.num_epochs) == (6e-4, 250)
  assert config.lr_milestones == (99, 199, 224) and config.lr_decay == 0.2
  assert (config.mimo.batch_repetitions, config.mimo.input_repetition_probability) == (4, 0.0)
  # A config holds its method's block alone (the tiny config is MC dropout's); switching the
  # method brings the block at its defaults.
  assert "mimo" not in tiny_config()
  assert with_method(tiny_config(), "mimo").mimo.batch_repetitions == 4


def test_trains_resumes_and_runs_every_evaluator_from_the_command_line(trained):
  assert_every_evaluator_reports(trained[2], "mimo")


def test_predict_the_evaluators_and_the_training_evaluation_agree(trained, tmp_path):
  workdir, data, _ = trained
  assert_paths_agree(three_paths(workdir, tmp_path, data=data))
