"""Ensemble inference: vmapped sampling equals a loop over the same keys."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.inference import ensemble_predict, mc_predict, stack_variables
from smoothing_jax.models import get_model
from smoothing_jax.passes import default_chunk_size, map_in_chunks
from tests.helpers import init_variables


def loop_predict(model, variables, images, keys):
  return np.stack([
      np.asarray(jax.nn.softmax(model.apply(variables, images, rngs={"dropout": k}))) for k in keys
  ])


def test_mc_predict_equals_python_loop(tiny_mcdo, images):
  model, variables = tiny_mcdo
  rng = jax.random.key(7)
  pred = mc_predict(model, variables, images, num_samples=4, rng=rng)
  expected = loop_predict(model, variables, images, jax.random.split(rng, 4))
  chex.assert_shape(pred.sample_probs, (4, 3, 5))
  np.testing.assert_allclose(pred.sample_probs, expected, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(pred.mean_probs, expected.mean(0), rtol=1e-4, atol=1e-6)
  # MC dropout samples really differ.
  assert not np.allclose(pred.sample_probs[0], pred.sample_probs[1])


def test_chunked_sampling_matches_one_vmap(tiny_mcdo, images):
  """One vmap over all N, vmapped chunks of 2, and the CPU default (one sample at a time inside
  the call, ``default_chunk_size``) give the same samples; N = 1 is one plain pass."""
  model, variables = tiny_mcdo
  rng = jax.random.key(3)
  assert default_chunk_size() == 1  # CPU
  full = mc_predict(model, variables, images, num_samples=5, rng=rng, chunk_size=5)
  for chunk_size in (2, None):
    chunked = mc_predict(model, variables, images, num_samples=5, rng=rng, chunk_size=chunk_size)
    np.testing.assert_allclose(chunked.sample_probs, full.sample_probs, rtol=1e-5, atol=1e-7)
  one = mc_predict(model, variables, images, num_samples=1, rng=rng)
  expected = loop_predict(model, variables, images, jax.random.split(rng, 1))
  np.testing.assert_allclose(one.sample_probs, expected, rtol=1e-4, atol=1e-6)


def test_map_in_chunks_over_a_pytree_pads_the_last_chunk():
  xs = {"a": jnp.arange(5.0), "b": jnp.arange(10.0).reshape(5, 2)}
  fn = lambda x: x["a"] * 10 + jnp.sum(x["b"])  # noqa: E731
  expected = np.arange(5.0) * 10 + np.arange(10.0).reshape(5, 2).sum(1)
  for chunk_size in (1, 2, 5, None):
    np.testing.assert_allclose(map_in_chunks(fn, xs, chunk_size), expected)


def test_deterministic_model_through_the_same_api(images):
  model = get_model("resnet_dnn_18", 5, width=4)
  variables = init_variables(model, images[:1])
  pred = mc_predict(model, variables, images, num_samples=1, rng=jax.random.key(0))
  np.testing.assert_allclose(pred.mean_probs[None], pred.sample_probs)
  np.testing.assert_allclose(pred.mean_probs,
                             jax.nn.softmax(model.apply(variables, images)),
                             rtol=1e-5,
                             atol=1e-7)


def test_ensemble_predict_equals_loop_over_members(images):
  model = get_model("resnet_dnn_smoothing_18", 5, width=4)
  members = [init_variables(model, images[:1], seed) for seed in range(3)]
  pred = ensemble_predict(model, stack_variables(members), images)
  expected = np.stack([np.asarray(jax.nn.softmax(model.apply(v, images))) for v in members])
  np.testing.assert_allclose(pred.sample_probs, expected, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(pred.mean_probs, expected.mean(0), rtol=1e-4, atol=1e-6)


def test_stack_variables_rejects_mixed_architectures():
  with pytest.raises(ValueError, match="structure"):
    stack_variables([{"params": {"a": jnp.ones(2)}}, {"params": {"b": jnp.ones(2)}}])


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_num_samples_must_be_positive(tiny_mcdo, images, n):
  model, variables = tiny_mcdo
  with pytest.raises(ValueError, match="num_samples"):
    mc_predict(model, variables, images, num_samples=n, rng=jax.random.key(0))


def test_bad_images_and_rng_are_rejected(tiny_mcdo, images):
  model, variables = tiny_mcdo
  with pytest.raises(TypeError, match="floating-point"):
    mc_predict(model, variables, images.astype(jnp.int32), num_samples=2, rng=jax.random.key(0))
  with pytest.raises(TypeError, match="PRNG key"):
    mc_predict(model, variables, images, num_samples=2, rng=0)
