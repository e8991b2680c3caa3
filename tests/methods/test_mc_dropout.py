"""MC dropout: the predictive is the mean of N passes with keys ``split(key, N)`` (an explicit
loop in numpy), nested sizes, and ``Run.predict``, ``ensemble_sizes`` and the training's
evaluation agree on a workdir."""
import jax
import numpy as np
import pytest

from smoothing_jax import methods
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.passes import sample_rngs
from tests.methods.paths import assert_paths_agree, three_paths


def _softmax(logits):
  logits = np.asarray(logits, np.float64)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_the_predictive_is_the_mean_of_n_dropout_passes(tiny_mcdo):
  model, variables = tiny_mcdo
  method = methods.resolve(None, model)
  assert isinstance(method, MCDropout) and method.stochastic and method.name == "mc_dropout"
  images = jax.random.normal(jax.random.key(0), (3, 16, 16, 3))
  rng = jax.random.key(1)
  pred = method.with_samples(4).predict(variables, images, rng=rng)
  one_pass = jax.jit(lambda key: model.apply(variables, images, train=False,
                                             rngs=sample_rngs(key)))
  loop = [_softmax(one_pass(key)) for key in jax.random.split(rng, 4)]
  np.testing.assert_allclose(pred.sample_probs, np.stack(loop), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pred.mean_probs, np.mean(loop, axis=0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(loop[0], loop[1])  # the passes differ


def test_nested_sizes_draw_the_largest_and_bad_sizes_are_one_line(tiny_mcdo):
  method = methods.resolve(None, tiny_mcdo[0])
  drawn, sizes = method.nested((5, 1, 2, 2))
  assert sizes == (1, 2, 5) and drawn.num_draws == 5
  with pytest.raises(ValueError, match=r"^num_samples must be a positive integer, got 0\.$"):
    method.with_samples(0)


def test_predict_the_evaluators_and_the_training_evaluation_agree(analysis_workdirs, tmp_path):
  workdir = analysis_workdirs["MC dropout"]
  assert_paths_agree(three_paths(workdir, tmp_path))
  assert_paths_agree(three_paths(workdir, tmp_path, num_samples=3))
