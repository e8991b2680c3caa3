"""The deterministic method: one pass is the predictive (N = 1 whatever is asked), and
``Run.predict``, ``ensemble_sizes`` and the training's evaluation agree on a trained workdir."""
import jax
import numpy as np

from smoothing_jax import methods
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.models import get_model
from tests.helpers import init_variables
from tests.methods.paths import assert_paths_agree, three_paths


def test_the_predictive_is_one_softmax_pass_and_every_size_is_one():
  model = get_model("resnet_dnn_18", 5, width=4, stage_sizes=(1,))
  variables = init_variables(model, (1, 16, 16, 3))
  method = methods.resolve(None, model)
  assert isinstance(method, Deterministic) and method.name == "deterministic"
  assert not method.stochastic and method.with_samples(7) is method
  assert method.nested((1, 5, 20)) == (method, (1,))
  images = jax.random.normal(jax.random.key(0), (3, 16, 16, 3))
  pred = method.predict(variables, images, rng=jax.random.key(1))
  logits = np.asarray(model.apply(variables, images, train=False), np.float64)
  expected = np.exp(logits - logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  assert pred.sample_probs.shape == (1, 3, 5)
  np.testing.assert_allclose(pred.mean_probs, expected, rtol=1e-5, atol=1e-6)


def test_predict_the_evaluators_and_the_training_evaluation_agree(small_npz_run, tmp_path):
  _, workdir, _ = small_npz_run
  assert_paths_agree(three_paths(workdir, tmp_path))
  assert_paths_agree(three_paths(workdir, tmp_path, num_samples=5))  # still one pass
