"""Smoothing layers and MC dropout against independent numpy computations."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.layers import Blur, MCDropout, Prob, Smooth

RNG = np.random.default_rng(0)


def numpy_depthwise_blur(x, taps, pad_before, pad_after, mode="constant"):
  """Reference blur: explicit padding, then a sliding k×k window weighted by outer(taps)/sum²."""
  k = np.outer(taps, taps) / np.sum(taps) ** 2
  n = len(taps)
  xp = np.pad(x, ((0, 0), (pad_before, pad_after), (pad_before, pad_after), (0, 0)), mode=mode)
  h, w = xp.shape[1] - n + 1, xp.shape[2] - n + 1
  out = np.zeros((x.shape[0], h, w, x.shape[3]))
  for i in range(h):
    for j in range(w):
      out[:, i, j, :] = np.einsum("bijc,ij->bc", xp[:, i:i + n, j:j + n, :], k)
  return out


def torch_avgpool_2x2_pad1(x):
  """``AvgPool2d(kernel_size=2, stride=1, padding=1)`` with count_include_pad: every window / 4."""
  b, h, w, c = x.shape
  out = np.zeros((b, h + 1, w + 1, c))
  for i in range(h + 1):
    for j in range(w + 1):
      total = 0.0
      for di in (-1, 0):
        for dj in (-1, 0):
          if 0 <= i + di < h and 0 <= j + dj < w:
            total = total + x[:, i + di, j + dj, :]
      out[:, i, j, :] = total / 4.0
  return out


def apply(module, x):
  return module.apply(module.init(jax.random.key(0), x), x)


@pytest.mark.parametrize("kind,expected", [
    ("tanh", lambda x: np.maximum(10.0 * np.tanh(x / 10.0), 0.0)),
    ("relu6", lambda x: np.minimum(np.maximum(x, 0.0), 6.0)),
    ("scale", lambda x: np.maximum(x / 10.0, 0.0)),
    (None, lambda x: x),
])
def test_prob_matches_numpy(kind, expected):
  x = RNG.normal(scale=20.0, size=(2, 4, 4, 3)).astype(np.float32)
  np.testing.assert_allclose(apply(Prob(kind, 10.0), jnp.asarray(x)),
                             expected(x),
                             rtol=1e-5,
                             atol=1e-5)


def test_prob_default_temperature_per_kind():
  """SS ``TanhBlurBlock(temp=1e1)`` and ``ScalingBlurBlock(temp=5e0)`` (paper App. B.1: τ = 5)."""
  x = jnp.array([[[[-3.0, 2.0, 40.0]]]])
  np.testing.assert_allclose(apply(Prob("scale"), x)[0, 0, 0], [0.0, 0.4, 8.0], rtol=1e-6)
  np.testing.assert_allclose(apply(Prob("tanh"), x)[0, 0, 0],
                             [0.0, 10 * math.tanh(0.2), 10 * math.tanh(4.0)],
                             rtol=1e-6)
  # A smoothing model with prob="scale" divides by 5 unless told otherwise: a 1×1 map of 2 becomes
  # ReLU(2/5) = 0.4, then the size-2 zero-padded average over 2×2 windows gives 0.1 at every
  # corner.
  smooth = apply(Smooth(prob="scale"), jnp.full((1, 1, 1, 1), 2.0))
  np.testing.assert_allclose(smooth[0, :, :, 0], [[0.1, 0.1], [0.1, 0.1]], rtol=1e-6)


def test_prob_tanh_saturates_at_temperature():
  out = apply(Prob("tanh", 2.0), jnp.array([[[[-100.0, 0.5, 100.0]]]]))
  np.testing.assert_allclose(out[0, 0, 0], [0.0, 2.0 * math.tanh(0.25), 2.0], rtol=1e-6)


def test_prob_rejects_unknown_kind():
  with pytest.raises(ValueError, match="Unknown Prob kind 'sigmoid'"):
    apply(Prob("sigmoid"), jnp.ones((1, 2, 2, 1)))


def test_default_blur_is_reference_avgpool_and_grows_maps():
  x = RNG.normal(size=(2, 5, 6, 3)).astype(np.float32)
  out = apply(Blur(), jnp.asarray(x))
  assert out.shape == (2, 6, 7, 3)
  np.testing.assert_allclose(out, torch_avgpool_2x2_pad1(x), rtol=1e-5, atol=1e-6)
  assert apply(Blur(), jnp.ones((1, 32, 32, 4))).shape == (1, 33, 33, 4)


@pytest.mark.parametrize("size,taps", [(1, [1.0]), (3, [1.0, 2.0, 1.0]),
                                       (5, [1.0, 4.0, 6.0, 4.0, 1.0])])
def test_odd_blurs_keep_size_with_floor_ceil_padding(size, taps):
  x = RNG.normal(size=(2, 7, 6, 3)).astype(np.float32)
  out = apply(Blur(size), jnp.asarray(x))
  assert out.shape == x.shape
  np.testing.assert_allclose(out,
                             numpy_depthwise_blur(x, taps, (size - 1) // 2, math.ceil(
                                 (size - 1) / 2)),
                             rtol=1e-5,
                             atol=1e-6)


def test_same_size_two_blur_pads_right_and_bottom():
  x = RNG.normal(size=(1, 4, 5, 2)).astype(np.float32)
  out = apply(Blur(2, same=True), jnp.asarray(x))
  assert out.shape == x.shape
  np.testing.assert_allclose(out, numpy_depthwise_blur(x, [1.0, 1.0], 0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pad_mode,numpy_mode", [("reflect", "reflect"), ("replicate", "edge"),
                                                 ("circular", "wrap")])
def test_blur_pad_modes(pad_mode, numpy_mode):
  x = RNG.normal(size=(1, 6, 6, 2)).astype(np.float32)
  out = apply(Blur(3, pad_mode=pad_mode), jnp.asarray(x))
  np.testing.assert_allclose(out,
                             numpy_depthwise_blur(x, [1.0, 2.0, 1.0], 1, 1, numpy_mode),
                             rtol=1e-5,
                             atol=1e-6)


def test_blur_is_depthwise_and_preserves_constants_inside():
  x = np.zeros((1, 9, 9, 2), np.float32)
  x[0, 4, 4, 0] = 16.0  # an impulse in channel 0 only
  out = np.asarray(apply(Blur(3), jnp.asarray(x)))
  np.testing.assert_allclose(out[0, 3:6, 3:6, 0], np.outer([1, 2, 1], [1, 2, 1]), rtol=1e-6)
  assert np.all(out[..., 1] == 0)
  assert float(out.sum()) == pytest.approx(16.0)


def test_blur_has_no_parameters():
  variables = Blur(5).init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  assert jax.tree.leaves(variables) == []


@pytest.mark.parametrize("size", [4, 0, 7])
def test_blur_rejects_unsupported_sizes(size):
  with pytest.raises(ValueError, match=f"Unsupported blur size {size}"):
    apply(Blur(size), jnp.ones((1, 8, 8, 3)))


def test_smooth_is_blur_of_prob():
  x = RNG.normal(scale=15.0, size=(2, 6, 6, 3)).astype(np.float32)
  prob = np.maximum(10.0 * np.tanh(x / 10.0), 0.0)
  np.testing.assert_allclose(apply(Smooth(), jnp.asarray(x)),
                             torch_avgpool_2x2_pad1(prob),
                             rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(apply(Smooth(prob="relu6", blur_size=3), jnp.asarray(x)),
                             numpy_depthwise_blur(np.clip(x, 0, 6), [1.0, 2.0, 1.0], 1, 1),
                             rtol=1e-5,
                             atol=1e-5)


def test_mc_dropout_samples_at_eval_time():
  layer = MCDropout(0.3)
  x = jnp.ones((64, 32))
  a = layer.apply({}, x, rngs={"dropout": jax.random.key(1)})
  b = layer.apply({}, x, rngs={"dropout": jax.random.key(2)})
  a_again = layer.apply({}, x, rngs={"dropout": jax.random.key(1)})
  chex.assert_trees_all_equal(a, a_again)
  assert not np.array_equal(a, b)
  kept = np.asarray(a) != 0
  # Survivors are scaled by 1/(1-p); the drop fraction is close to p (2048 elements).
  np.testing.assert_allclose(np.asarray(a)[kept], 1.0 / 0.7, rtol=1e-6)
  assert abs((1.0 - kept.mean()) - 0.3) < 0.05


def test_mc_dropout_needs_a_dropout_rng():
  with pytest.raises(ValueError, match="'dropout' RNG"):
    MCDropout(0.3).apply({}, jnp.ones((2, 3)))


def test_mc_dropout_rate_zero_is_identity():
  x = jnp.arange(6.0).reshape(2, 3)
  chex.assert_trees_all_equal(MCDropout(0.0).apply({}, x), x)
