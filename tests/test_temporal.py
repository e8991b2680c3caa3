"""smoothing_jax.temporal: VQ-BNN temporal smoothing of streams (explicit weighted averages,
state carried across scans and chunks, classifiers and segmenters, input checks)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax import temporal
from smoothing_jax.passes import sample_rngs


def test_streaming_predictor_equals_explicit_weighted_average():
  # Hand-made sequence of 7 "predictions" over 2 classes for one pixel of 2 streams.
  rng = np.random.default_rng(0)
  seq = rng.dirichlet([1.0, 1.0], size=(7, 2)).astype(np.float32)  # [T, B, C]
  num_frames, decay = 3, 0.8
  state = temporal.init_stream((2, 2), num_frames)
  for t in range(7):
    state, smoothed = temporal.temporal_smoothing(state, jnp.asarray(seq[t]), decay)
    ages = range(min(t + 1, num_frames))  # 0 = current frame
    weights = np.array([np.exp(-decay * a) for a in ages])
    expected = sum(w * seq[t - a] for w, a in zip(weights, ages, strict=True)) / weights.sum()
    np.testing.assert_allclose(smoothed, expected, rtol=1e-6)
  # Defaults of the paper: L = 5, e^{-0.8} per frame.
  w = temporal.temporal_weights(10, temporal.NUM_FRAMES)
  np.testing.assert_allclose(w[1:] / w[:-1], np.exp(-0.8), rtol=1e-6)
  assert temporal.NUM_FRAMES == 5 and np.isclose(float(w.sum()), 1.0)


def test_stream_state_carries_across_scan_and_chunks(tiny_unet):
  model, variables = tiny_unet
  frames = jax.random.normal(jax.random.key(4), (7, 2, 12, 12, 3))
  rng = jax.random.key(5)
  state, probs = temporal.vq_bnn_predict(model, variables, frames, rng=rng)
  assert probs.shape == (7, 2, 12, 12, 5) and int(state.frames_seen) == 7
  # Two chunks with the carried state = one scan over the whole video.
  s1, p1 = temporal.vq_bnn_predict(model, variables, frames[:3], rng=rng)
  s2, p2 = temporal.vq_bnn_predict(model, variables, frames[3:], rng=rng, state=s1)
  np.testing.assert_allclose(np.concatenate([p1, p2]), probs, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(s2, state, rtol=1e-5, atol=1e-6)
  # Frame by frame with the jitted step, too; and one stochastic pass per frame.
  s = temporal.init_stream(probs.shape[1:])
  singles = []
  for t in range(7):
    s, p = temporal.stream_predict(model, variables, s, frames[t], rng=rng)
    np.testing.assert_allclose(p, probs[t], rtol=1e-5, atol=1e-6)
    singles.append(s.history[0])
    logits = model.apply(variables, frames[t], rngs=sample_rngs(jax.random.fold_in(rng, t)))
    np.testing.assert_allclose(s.history[0], jax.nn.softmax(logits), rtol=1e-5, atol=1e-6)
  # The smoothed output at t = 6 is the explicit average of the last five single passes.
  weights = np.exp(-0.8 * np.arange(5))
  expected = sum(w * singles[6 - a] for a, w in enumerate(weights)) / weights.sum()
  np.testing.assert_allclose(probs[6], expected, rtol=1e-5, atol=1e-6)


def test_streaming_works_with_a_classifier(tiny_mcdo, images):
  model, variables = tiny_mcdo
  frames = jnp.stack([images, images + 0.1, images - 0.1])
  _, probs = temporal.vq_bnn_predict(model, variables, frames, rng=jax.random.key(0), num_frames=2)
  assert probs.shape == (3, 3, 5)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_streaming_rejects_bad_input(tiny_unet):
  model, variables = tiny_unet
  with pytest.raises(ValueError, match="time, batch"):
    temporal.vq_bnn_predict(model, variables, jnp.zeros((2, 12, 12, 3)), rng=jax.random.key(0))
  with pytest.raises(ValueError, match="num_frames"):
    temporal.init_stream((1, 5), 0)
  with pytest.raises(ValueError, match="does not match"):
    temporal.temporal_smoothing(temporal.init_stream((1, 5)), jnp.zeros((1, 4)))
