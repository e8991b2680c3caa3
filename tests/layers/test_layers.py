"""Layers against independent computations: smoothing, MC dropout, multi-head self-attention
(global, windowed, neighbourhood masks) and iBNN node noise."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.layers import Blur, MCDropout, Prob, Smooth
from smoothing_jax.layers.attention import (
  MultiHeadAttention,
  WindowAttention,
  neighbourhood_mask,
  relative_position_index,
  window_partition,
)
from smoothing_jax.layers.node_noise import NodeNoiseConv, NodeNoiseDense

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
    ("scale", lambda x: x / 10.0),  # SS ScalingBlurBlock.forward: x / self.temp, no ReLU
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
  np.testing.assert_allclose(apply(Prob("scale"), x)[0, 0, 0], [-0.6, 0.4, 8.0], rtol=1e-6)
  np.testing.assert_allclose(apply(Prob("tanh"), x)[0, 0, 0],
                             [0.0, 10 * math.tanh(0.2), 10 * math.tanh(4.0)],
                             rtol=1e-6)
  # A smoothing model with prob="scale" divides by 5 unless told otherwise: a 1×1 map of 2 becomes
  # 2/5 = 0.4, then the size-2 zero-padded average over 2×2 windows gives 0.1 at every
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


# ----------------------------------------------------------------------------- attention


def test_attention_matches_numpy():
  x = np.random.default_rng(0).normal(size=(2, 5, 6)).astype(np.float32)
  layer = MultiHeadAttention(num_heads=2, head_dim=3, out_features=4)
  params = layer.init(jax.random.key(0), x)["params"]
  wqkv, wo, bo = (np.asarray(a) for a in (params["qkv"]["kernel"], params["out"]["kernel"],
                                          params["out"]["bias"]))
  heads = []
  for h in range(2):
    q, k, v = (x @ wqkv[:, s, h] for s in range(3))           # [B, N, d]
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(3)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    heads.append((weights / weights.sum(-1, keepdims=True)) @ v)
  expected = np.einsum("bnhd,hdo->bno", np.stack(heads, 2), wo) + bo
  np.testing.assert_allclose(layer.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


def test_window_equal_to_the_map_is_global_msa():
  x = jax.random.normal(jax.random.key(0), (2, 4, 4, 6))
  window = WindowAttention(window_size=4, num_heads=2, head_dim=3)
  params = window.init(jax.random.key(1), x)["params"]
  params = {**params, "relative_position": jnp.zeros_like(params["relative_position"])}
  global_msa = MultiHeadAttention(num_heads=2, head_dim=3)
  expected = global_msa.apply({
      "params": params["attention"]
  }, x.reshape(2, 16, 6)).reshape(2, 4, 4, 6)
  chex.assert_trees_all_close(window.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)
  # ... and a convolutional neighbourhood of 2·4 − 1 covers the map.
  assert np.all(neighbourhood_mask(4, 4, 7) == 0)
  chex.assert_trees_all_close(global_msa.apply({"params": params["attention"]}, x.reshape(2, 16, 6),
                                               jnp.asarray(neighbourhood_mask(4, 4, 7))),
                              expected.reshape(2, 16, 6), rtol=1e-6)


def test_smaller_windows_attend_within_themselves_with_the_relative_bias():
  x = jax.random.normal(jax.random.key(0), (1, 4, 4, 3))
  window = WindowAttention(window_size=2, num_heads=1, head_dim=3)
  params = window.init(jax.random.key(1), x)["params"]
  table = np.asarray(params["relative_position"])
  out = np.asarray(window.apply({"params": params}, x))
  inner = MultiHeadAttention(num_heads=1, head_dim=3)
  # Explicit bias: key j relative to query i within a 2×2 window, row-major.
  pos = [(r, c) for r in range(2) for c in range(2)]
  bias = np.array([[table[pj[0] - pi[0] + 1, pj[1] - pi[1] + 1] for pj in pos] for pi in pos],
                  np.float32)
  np.testing.assert_array_equal(relative_position_index(2)[0, 3], [2, 2])
  for r in (0, 2):
    for c in (0, 2):
      patch = np.asarray(x)[:, r:r + 2, c:c + 2].reshape(1, 4, 3)
      expected = inner.apply({"params": params["attention"]}, patch, jnp.asarray(bias))
      np.testing.assert_allclose(out[:, r:r + 2, c:c + 2].reshape(1, 4, 3),
                                 expected,
                                 rtol=1e-5,
                                 atol=1e-6)
  assert window_partition(x, 2).shape == (4, 4, 3)


def test_neighbourhood_mask_is_a_kxk_window():
  mask = neighbourhood_mask(5, 5, 3).reshape(5, 5, 5, 5)
  allowed = np.isfinite(mask[2, 2])
  np.testing.assert_array_equal(allowed, np.pad(np.ones((3, 3), bool), 1))
  assert np.isfinite(mask[0, 0]).sum() == 4  # corner: 2×2 of the 3×3 neighbourhood


# ----------------------------------------------------------------------------- iBNN node noise


def test_conv_noise_differs_across_examples_and_components_and_is_constant_over_space():
  layer = NodeNoiseConv(num_components=2, features=1, kernel_size=1, use_bias=False,
                        kernel_init=nn_ones)
  x = jnp.ones((4, 3, 3, 2))
  variables = layer.init({
      "params": jax.random.key(0),
      "noise": jax.random.key(1)
  }, x, jnp.zeros(4, int))
  out = layer.apply(variables, x, jnp.array([0, 0, 1, 1]), rngs={"noise": jax.random.key(2)})[...,
                                                                                              0]
  # With a ones kernel the output is Σ_c z_c: constant over H×W, different for every example.
  np.testing.assert_allclose(out, out[:, :1, :1] * jnp.ones_like(out), rtol=1e-6)
  assert len(set(np.round(np.asarray(out[:, 0, 0]), 5))) == 4
  # σ → 0: the draw is the component mean, which differs between components.
  variables = jax.tree_util.tree_map_with_path(
      lambda p, v: jnp.full_like(v, -30.0) if p[-1].key == "z_rho" else v, variables)
  out = layer.apply(variables, x, jnp.array([0, 0, 1, 1]), rngs={"noise": jax.random.key(2)})[:, 0,
                                                                                              0, 0]
  z = variables["params"]["z_mean"].sum(1)
  np.testing.assert_allclose(out, [z[0], z[0], z[1], z[1]], rtol=1e-5)


def nn_ones(key, shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


def test_dense_bias_noise_is_one_scalar_per_example():
  layer = NodeNoiseDense(num_components=2, features=3)
  x = jnp.zeros((4, 5))  # zero input: the output is s·b only
  variables = layer.init({"params": jax.random.key(0), "noise": jax.random.key(1)}, x)
  variables = {"params": {**variables["params"], "bias": jnp.array([1.0, 2.0, 3.0])}}
  out = layer.apply(variables, x, jnp.array([0, 1, 0, 1]), rngs={"noise": jax.random.key(3)})
  np.testing.assert_allclose(out / jnp.array([1.0, 2.0, 3.0]),
                             out[:, :1] * jnp.ones((4, 3)),
                             rtol=1e-5)
  assert len(set(np.round(np.asarray(out[:, 0]), 5))) == 4


@pytest.mark.parametrize("stride,padding,bias", [(1, 1, False), (2, 0, True)])
def test_grouped_conv_equals_nn_conv_with_feature_group_count(stride, padding, bias):
  """``GroupedConv`` (one convolution per group on CPU) against flax's ``nn.Conv`` with
  ``feature_group_count`` (XLA's grouped convolution): the same parameters (names, shapes,
  initial values), outputs and gradients."""
  import flax.linen as nn

  from smoothing_jax.layers import GroupedConv
  x = jnp.asarray(RNG.normal(size=(2, 9, 9, 12)), jnp.float32)
  ours = GroupedConv(8, 3, stride, padding, groups=4, use_bias=bias,
                     bias_init=nn.initializers.normal(1.0))
  flax_conv = nn.Conv(8, (3, 3), strides=(stride, stride),
                      padding=((padding, padding), (padding, padding)), feature_group_count=4,
                      use_bias=bias, bias_init=nn.initializers.normal(1.0))
  variables = ours.init(jax.random.key(0), x)
  chex.assert_trees_all_equal(variables, flax_conv.init(jax.random.key(0), x))

  def loss(module, v, x):
    return jnp.sum(jnp.sin(module.apply(v, x)))

  np.testing.assert_allclose(ours.apply(variables, x), flax_conv.apply(variables, x), atol=1e-5)
  chex.assert_trees_all_close(jax.grad(loss, (1, 2))(ours, variables, x),
                              jax.grad(loss, (1, 2))(flax_conv, variables, x), atol=1e-5)
  with pytest.raises(ValueError, match="divisible by 4"):
    GroupedConv(6, 3, groups=4).init(jax.random.key(0), x)
