"""SNGP: the precision restarts at each epoch's start and sums the batches' random features; the
mean-field predictive is f / √(1 + λ v) of the GP's mean and variance (numpy); the MC predictive
samples N(f, v); an SNGP ensemble is a config."""
import jax
import numpy as np
import pytest

from smoothing_jax import methods
from smoothing_jax.methods.sngp import SNGP
from smoothing_jax.models import get_model
from tests.helpers import init_variables, override, small_npz_config

MODEL = get_model("resnet_sngp_18", 5, width=4, stage_sizes=(1,))


@pytest.fixture(scope="module")
def variables():
  return init_variables(MODEL, (1, 16, 16, 3))


def _precision(batch_stats):
  return np.asarray(batch_stats["classifier_0"]["precision"])


def test_the_precision_restarts_at_each_epoch(variables, images):
  method = methods.resolve(None, MODEL)
  assert isinstance(method, SNGP) and method.name == "sngp" and not method.stochastic
  config = override(small_npz_config("/nowhere"), model="resnet_sngp_18")
  loss_fn = jax.jit(method.loss(config, num_train=32, steps_per_epoch=4))
  stale = {**variables["batch_stats"],
           "classifier_0": {**variables["batch_stats"]["classifier_0"],
                            "precision": 5.0 * np.eye(1024, dtype=np.float32)}}
  batch = {"image": images, "label": np.array([0, 1, 2])}
  after = {step: _precision(loss_fn(variables["params"], stale, batch, jax.random.key(0),
                                    step)[1]["batch_stats"]) for step in (4, 5)}
  # Step 4 starts an epoch: s I + ΦᵀΦ; step 5 adds ΦᵀΦ to the 5 I it was given.
  np.testing.assert_allclose(after[5] - after[4], 4.0 * np.eye(1024), atol=1e-4)
  assert not np.allclose(after[4], np.eye(1024))  # the batch was added


def _logits_and_variance(variables, images):
  logits, state = MODEL.apply(variables, images, train=False, mutable=["intermediates"])
  return (np.asarray(logits, np.float64),
          np.asarray(state["intermediates"]["classifier_0"]["gp_variance"][0], np.float64))


def test_mean_field_and_mc_predictives(variables, images):
  logits, variance = _logits_and_variance(variables, images)
  assert (variance > 0).all()
  scaled = logits / np.sqrt(1 + 25.0 * variance)[:, None]
  expected = np.exp(scaled - scaled.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  method = SNGP(MODEL)
  for prepared in (variables, method.prediction_variables(variables, None)):  # P factored once
    pred = method.predict(prepared, images, rng=None)
    np.testing.assert_allclose(pred.mean_probs, expected, rtol=1e-4, atol=1e-5)
  mc = SNGP(MODEL, num_samples=2000, predictive="mc")
  draws = np.asarray(mc.sample_log_probs(variables, images, jax.random.key(1)))
  assert draws.shape == (2000, 3, 5) and mc.stochastic and mc.num_draws == 2000
  # Each draw's logits are f + √v ε: recover them up to the log-softmax's constant.
  centred = draws - draws.mean(-1, keepdims=True)
  truth = logits - logits.mean(-1, keepdims=True)
  standard_error = np.sqrt(0.8 * variance / 2000)[:, None]  # of a centred logit's mean
  assert (np.abs(centred.mean(0) - truth) < 5 * standard_error).all()
  np.testing.assert_allclose(centred[..., 0].var(0) / (variance * 0.8), 1.0, atol=0.1)  # (1 − 1/5)


def test_an_sngp_ensemble_is_a_config(variables, images):
  config = override(small_npz_config("/nowhere"), model="resnet_sngp_18",
                    **{"deep_ensemble.members": 2})
  method = methods.resolve(config, MODEL)
  assert isinstance(method, methods.DeepEnsemble) and isinstance(method.base, SNGP)
  members = [variables, init_variables(MODEL, (1, 16, 16, 3), seed=1)]
  from smoothing_jax.passes import stack_variables
  out = np.asarray(method.sample_log_probs(stack_variables(members), images, jax.random.key(0)))
  for m, member in enumerate(members):  # each member's own mean-field predictive
    np.testing.assert_allclose(out[m], SNGP(MODEL).sample_log_probs(member, images, None)[0],
                               rtol=1e-5, atol=1e-5)


def test_the_wrn_drops_whole_filters_in_training_only():
  """uncertainty-baselines' SNGP WRN: filter-wise dropout 0.1 in training, none at evaluation."""
  model = get_model("wideresnet_sngp_28_10", 5, depth=4, widen_factor=1, width=4)  # stem, head
  assert model.filter_dropout_rate == 0.1 and methods.resolve(None, model).name == "sngp"
  variables = init_variables(model, (1, 8, 8, 3))
  x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
  train = [model.apply(variables, x, train=True, mutable=["batch_stats"],
                       rngs={"dropout": jax.random.key(k)})[0] for k in (0, 1)]
  assert not np.allclose(train[0], train[1])
  evaluate = [model.apply(variables, x, train=False) for _ in range(2)]
  np.testing.assert_array_equal(evaluate[0], evaluate[1])
