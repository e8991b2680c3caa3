"""SNGP's layers (Liu et al. 2020): spectrally normalised convolutions and dense layers, and the
random-feature Gaussian-process output layer, as edward2's JAX layers compute them
(``edward2/jax/nn/normalization.py``, ``random_feature.py``, ``utils.py`` at ee02560;
``tests/layers/test_sngp.py`` pins them to those layers' recorded outputs).

What the layers update outside the gradient (the power iteration's vectors, the fixed random
features, the GP's precision matrix) lives in the ``batch_stats`` collection beside BatchNorm's
statistics: it is updated where that collection is mutable (training) and read as it is
otherwise (evaluation), and it is sharded, checkpointed and restored with it.

* **Spectral normalisation** (Miyato et al. 2018; convolutions as operators on their input,
  Farnia et al. 2019, edward2's ``SpectralNormalizationConv2D``): W ← W / max(σ̂ / c, 1), c the norm
  bound, σ̂ = uᵀ W v from ``iterations`` steps of power iteration per training step (v ← Wᵀu/‖·‖,
  then u ← W v/‖·‖, from the stored u, v), the gradient not flowing through σ̂.
* **The GP layer**: the input layer-normalised without scale or bias, D random Fourier features
  φ(x) = cos(x W + b) (W ~ N(0, 2 / d_in), b ~ U(0, 2π), fixed), logits β φ(x) + β₀ (a trained
  dense layer), and the Laplace precision P = s I + Σ φφᵀ over the training batches seen since
  it was last reset (s the ridge penalty; ``methods.sngp`` resets it at each epoch's start, as
  uncertainty-baselines' ``gp_cov_discount_factor`` = −1).  At evaluation the predictive variance
  s · φᵀ P⁻¹ φ of each example is sown as ``intermediates/…/gp_variance``, from L⁻¹ (P = L Lᵀ) where
  the variables hold it (:func:`with_whitening`), else by factoring P in the pass.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

STATE = "batch_stats"  # the collection of what is updated outside the gradient
SINGULAR_VECTOR_INIT = nn.initializers.normal(stddev=0.05)  # edward2's u_init and v_init


def _l2_normalize(x, eps: float = 1e-12):
  return x * jax.lax.rsqrt(jnp.maximum(jnp.square(x).sum(), eps))


def _updating(module: nn.Module) -> bool:
  """Whether this pass updates the layer's state: training, not initialisation."""
  return module.is_mutable_collection(STATE) and not module.is_initializing()


def spectral_normalized(module: nn.Module, kernel, kernel_apply: Callable, in_shape: tuple,
                        bound: float, iterations: int):
  """``kernel`` divided by max(σ̂ / ``bound``, 1), σ̂ the largest singular value of the linear
  operator ``kernel_apply`` (v ↦ W v on inputs of ``in_shape``) estimated by power iteration
  from the vectors ``sn_u``, ``sn_v`` in ``module``'s state (updated where it trains)."""
  out_shape = jax.eval_shape(kernel_apply, jax.ShapeDtypeStruct(in_shape, kernel.dtype)).shape
  u = module.variable(STATE, "sn_u", lambda: SINGULAR_VECTOR_INIT(
      module.make_rng("params"), out_shape, kernel.dtype))
  v = module.variable(STATE, "sn_v", lambda: SINGULAR_VECTOR_INIT(
      module.make_rng("params"), in_shape, kernel.dtype))
  u_hat, v_hat = u.value, v.value
  wv, transpose = jax.vjp(kernel_apply, v_hat)
  if _updating(module):
    for _ in range(iterations):
      v_hat = _l2_normalize(transpose(u_hat)[0])
      wv = kernel_apply(v_hat)
      u_hat = _l2_normalize(wv)
    u.value, v.value = u_hat, v_hat
  sigma = jnp.maximum(jnp.vdot(u_hat, wv) / bound, 1.0)
  normalized = kernel / jax.lax.stop_gradient(sigma)
  module.sow("spectral_norm", "kernel", normalized)  # read only where asked (its tests)
  return normalized


class SpectralNormDense(nn.Module):
  """``nn.Dense`` whose kernel is spectrally normalised (SN-GAN: the kernel as a matrix)."""
  features: int
  bound: float = 6.0
  iterations: int = 1
  use_bias: bool = True
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
    kernel = spectral_normalized(self, kernel, lambda v: v @ kernel, (x.shape[-1],), self.bound,
                                 self.iterations)
    y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(self.dtype)
    return y


class SpectralNormConv(nn.Module):
  """A 2-D convolution (``cnn.conv``'s: explicit symmetric zero padding, NHWC) whose kernel is
  spectrally normalised as an operator on the layer's input (u, v of the input's and output's
  spatial shapes, as edward2's ``SpectralNormalizationConv2D``)."""
  features: int
  kernel_size: int
  stride: int = 1
  padding: int = 0
  bound: float = 6.0
  iterations: int = 1
  use_bias: bool = False
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    k = self.kernel_size
    kernel = self.param("kernel", self.kernel_init, (k, k, x.shape[-1], self.features),
                        jnp.float32)

    def convolve(inputs, w):
      return jax.lax.conv_general_dilated(
          inputs, w, (self.stride, self.stride), ((self.padding,) * 2,) * 2,
          dimension_numbers=("NHWC", "HWIO", "NHWC"))

    kernel = spectral_normalized(self, kernel, lambda v: convolve(v[None], kernel)[0],
                                 tuple(x.shape[1:]), self.bound, self.iterations)
    y = convolve(x.astype(self.dtype), kernel.astype(self.dtype))
    if self.use_bias:
      y = y + self.param("bias", self.bias_init, (self.features,), jnp.float32).astype(self.dtype)
    return y


class RandomFeatureGP(nn.Module):
  """The random-feature GP output layer: logits ``[B, C]`` of inputs ``[B, D_in]`` (module
  docstring), the Laplace precision updated where it trains, the predictive variance sown where
  it does not.  ``ridge``: s; ``hidden_features``: D."""
  num_classes: int
  hidden_features: int = 1024
  ridge: float = 1.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(use_bias=False, use_scale=False, name="norm")(x.astype(jnp.float32))
    d_in, d = x.shape[-1], self.hidden_features
    kernel = self.variable(STATE, "rff_kernel", lambda: nn.initializers.variance_scaling(
        2.0, "fan_in", "normal")(self.make_rng("params"), (d_in, d), jnp.float32))
    bias = self.variable(STATE, "rff_bias", lambda: jax.random.uniform(
        self.make_rng("params"), (d,), jnp.float32, 0.0, 2.0 * np.pi))
    phi = jnp.cos(x @ kernel.value + bias.value)
    logits = nn.Dense(self.num_classes, dtype=self.dtype, name="output")(phi)
    precision = self.variable(STATE, "precision",
                              lambda: self.ridge * jnp.eye(d, dtype=jnp.float32))
    if _updating(self):
      precision.value = precision.value + phi.T @ phi
    elif not self.is_initializing():
      if self.has_variable(STATE, "whitening"):  # L⁻¹ of P = L Lᵀ, prepared once (with_whitening)
        whitened = phi @ self.get_variable(STATE, "whitening").T
        variance = self.ridge * jnp.sum(jnp.square(whitened), axis=-1)
      else:
        variance = predictive_variance(phi, precision.value, self.ridge)
      self.sow("intermediates", "gp_variance", variance)
    return logits


def _whitened(phi, precision):
  """A = L⁻¹ Φᵀ, P = L Lᵀ (Cholesky), so that Φ P⁻¹ Φᵀ = Aᵀ A."""
  return jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(precision), phi.T, lower=True)


def predictive_variance(phi, precision, ridge: float):
  """s · diag(Φ P⁻¹ Φᵀ) ``[B]`` of the random features ``phi [B, D]`` (by P's Cholesky factor,
  as edward2's ``LaplaceRandomFeatureCovariance``)."""
  return ridge * jnp.sum(jnp.square(_whitened(phi, precision)), axis=0)


def predictive_covariance(phi, precision, ridge: float):
  """The full predictive covariance s · Φ P⁻¹ Φᵀ ``[B, B]`` of ``phi [B, D]``."""
  whitened = _whitened(phi, precision)
  return ridge * whitened.T @ whitened


def mean_field_logits(logits, variance, factor: float):
  """The mean-field approximation of the softmax of a Gaussian (Lu et al. 2020; edward2's
  ``mean_field_logits``): ``logits [B, C]`` / √(1 + λ·``variance [B]``), λ = ``factor``; the
  logits unchanged for a negative factor (the posterior mode)."""
  if factor < 0:
    return logits
  return logits / jnp.sqrt(1.0 + factor * variance)[:, None]


def with_whitening(batch_stats):
  """``batch_stats`` with, beside each GP precision P = L Lᵀ, ``whitening`` = L⁻¹, so that an
  evaluation pass computes each variance s‖L⁻¹φ‖² by one product instead of factoring P (D³) on
  every batch: what ``methods.sngp.SNGP.prediction_variables`` prepares once per run."""
  if not isinstance(batch_stats, dict):
    return batch_stats
  out = {name: with_whitening(value) for name, value in batch_stats.items()}
  if "precision" in batch_stats:
    precision = batch_stats["precision"]
    chol = jnp.linalg.cholesky(precision)
    out["whitening"] = jax.scipy.linalg.solve_triangular(
        chol, jnp.eye(precision.shape[-1], dtype=precision.dtype), lower=True)
  return out


def reset_precision(batch_stats, reset, ridge: float):
  """``batch_stats`` with every GP precision (``precision`` leaves) back to s·I where ``reset``
  (a traced bool): the start of the epoch over which the precision is summed."""
  def leaf(path, value):
    if getattr(path[-1], "key", None) != "precision":
      return value
    return jnp.where(reset, ridge * jnp.eye(value.shape[-1], dtype=value.dtype), value)
  return jax.tree_util.tree_map_with_path(leaf, batch_stats)
