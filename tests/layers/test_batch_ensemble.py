"""BatchEnsemble's layers against M explicit numpy layers, the fast-weight initialisation and the
models' sizes (the method: tests/methods/test_batch_ensemble.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.layers.batch_ensemble import (
  BatchEnsembleConv,
  BatchEnsembleDense,
  random_sign_init,
)
from smoothing_jax.models import get_model
from tests.helpers import (
  num_params,
)

M = 3


def _fast_weights(rng, c_in, c_out):
  return {"fast_in": rng.normal(1, 0.5, (M, c_in)).astype(np.float32),
          "fast_out": rng.normal(1, 0.5, (M, c_out)).astype(np.float32),
          "bias": rng.normal(0, 0.1, (M, c_out)).astype(np.float32)}


def test_dense_equals_m_numpy_layers_with_kernels_w_times_s_r():
  rng = np.random.default_rng(0)
  params = {"kernel": rng.normal(size=(5, 4)).astype(np.float32), **_fast_weights(rng, 5, 4)}
  x = rng.normal(size=(6, 5)).astype(np.float32)
  members = np.array([0, 1, 2, 2, 1, 0])
  out = BatchEnsembleDense(M, features=4).apply({"params": params}, x, members)
  for b, m in enumerate(members):
    kernel = params["kernel"] * np.outer(params["fast_in"][m], params["fast_out"][m])
    np.testing.assert_allclose(out[b], x[b] @ kernel + params["bias"][m], rtol=1e-5, atol=1e-5)
  # No members given: row r uses member r mod M (the batch repeated M times in training).
  default = BatchEnsembleDense(M, features=4).apply({"params": params}, x)
  np.testing.assert_allclose(default, BatchEnsembleDense(M, features=4).apply(
      {"params": params}, x, np.arange(6) % M), rtol=0, atol=0)


def _numpy_conv(x, kernel, stride, padding):
  """Cross-correlation of ``x [H, W, C_in]`` with ``kernel [k, k, C_in, C_out]``, zero padding."""
  k = kernel.shape[0]
  x = np.pad(x, ((padding, padding), (padding, padding), (0, 0)))
  rows = range(0, x.shape[0] - k + 1, stride)
  cols = range(0, x.shape[1] - k + 1, stride)
  return np.array([[np.einsum("hwi,hwio->o", x[i:i + k, j:j + k], kernel) for j in cols]
                   for i in rows])


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_equals_m_numpy_convolutions_with_kernels_w_times_s_r(stride):
  rng = np.random.default_rng(1)
  params = {"kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
            **_fast_weights(rng, 2, 4)}
  x = rng.normal(size=(4, 5, 5, 2)).astype(np.float32)
  members = np.array([2, 0, 1, 2])
  layer = BatchEnsembleConv(M, features=4, kernel_size=3, stride=stride, padding=1)
  out = np.asarray(layer.apply({"params": params}, x, members))
  for b, m in enumerate(members):
    kernel = params["kernel"] * np.outer(params["fast_in"][m], params["fast_out"][m])
    expected = _numpy_conv(x[b], kernel, stride, 1) + params["bias"][m]
    np.testing.assert_allclose(out[b], expected, rtol=1e-4, atol=1e-4)


def test_the_training_rule_is_m_convolutions_as_the_rows_members_give():
  # members None with B a multiple of M: member m's rows (every M-th) through W ∘ (s_m r_mᵀ),
  # one convolution per member; the same function as the explicit members' x ∘ s, W, ∘ r, to
  # float rounding, and so its gradients.
  rng = np.random.default_rng(2)
  params = {"kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
            **_fast_weights(rng, 2, 4)}
  x = rng.normal(size=(6, 5, 5, 2)).astype(np.float32)
  layer = BatchEnsembleConv(M, features=4, kernel_size=3, stride=2, padding=1)

  def loss(params, x, members):
    out = layer.apply({"params": params}, x, members)
    return jnp.sum(jnp.sin(out)), out

  (_, default), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x, None)
  (_, explicit), expected = jax.value_and_grad(loss, (0, 1), has_aux=True)(
      params, x, np.arange(6) % M)
  np.testing.assert_allclose(default, explicit, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # A batch that is not a multiple of M keeps the rule: row r under member r mod M.
  np.testing.assert_array_equal(layer.apply({"params": params}, x[:4]),
                                layer.apply({"params": params}, x[:4], np.arange(4) % M))


def test_fast_weights_start_as_uncertainty_baselines_random_sign_init():
  key = jax.random.key(0)
  signs = np.asarray(random_sign_init(0.75)(key, (200, 100)))
  assert set(np.unique(signs)) == {-1.0, 1.0}
  assert abs((signs > 0).mean() - 0.75) < 0.01
  normal = np.asarray(random_sign_init(-0.5)(key, (200, 100)))  # the CIFAR default: N(1, 0.5²)
  assert abs(normal.mean() - 1.0) < 0.01 and abs(normal.std() - 0.5) < 0.01


def test_model_sizes_are_uncertainty_baselines_and_the_transcribed_layers():
  # uncertainty-baselines' CIFAR README: WRN-28-10 36.5M deterministic, 36.6M BatchEnsemble of 4
  # (trainable: 36,479,194 and 36,557,548, conv kernels 36,454,832 + BatchNorm 17,952 + head).
  assert num_params(get_model("wideresnet_dnn_28_10", 10, conv_bias=False)) == 36_479_194
  wrn = num_params(get_model("wideresnet_batchensemble_28_10", 10))
  assert wrn == 36_479_194 + 78_354 and round(wrn / 1e6, 1) == 36.6
  # ResNet-18 (CIFAR): every conv (in, out) and the 512 → 10 head; each BatchEnsemble layer adds
  # M·(in + out) fast weights, the head M·10 member biases in place of its 10.
  convs = [(3, 64)] + [(64, 64)] * 4 + [(64, 128), (128, 128), (128, 128), (128, 128), (64, 128)]
  convs += [(128, 256), (256, 256), (256, 256), (256, 256), (128, 256)]
  convs += [(256, 512), (512, 512), (512, 512), (512, 512), (256, 512)]
  deterministic = num_params(get_model("resnet_dnn_18", 10))
  assert deterministic == 11_173_962
  extra = sum(4 * (i + o) for i, o in convs) + 4 * (512 + 10) + 3 * 10
  assert num_params(get_model("resnet_batchensemble_18", 10)) == deterministic + extra
