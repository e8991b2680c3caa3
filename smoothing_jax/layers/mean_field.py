"""Mean-field Gaussian weights (BNN-VI: Blundell et al. 2015, "Weight uncertainty in neural
networks") with Flipout gradients (Wen et al. 2018).

Every kernel entry has its own Gaussian, q(W) = Π N(μ, σ²) with σ = softplus(ρ); biases stay
deterministic (as in uncertainty-baselines' ``wide_resnet_variational``).  One pass draws one
ε ~ N(0, I) of the kernel's shape and Flipout decorrelates it across the batch with random signs
s_n ∈ {±1}^{C_in}, r_n ∈ {±1}^{C_out} per example (Wen et al. 2018, Eq. 4):

    y_n = μ * x_n + ((σ ∘ ε) * (x_n ∘ s_n)) ∘ r_n + b          (* : conv or matmul)

Example n's perturbation (σ ∘ ε) ∘ (s_n r_nᵀ) is itself a draw of N(0, σ²), so each example
sees a true weight sample; different examples see nearly independent ones, which lowers the
gradient variance against one sample shared by the batch (``experiments/bnnvi_gradient_variance.py``
measures it).  Flipout rather than the local reparameterisation trick: for a convolution the
local trick samples every output position independently, which is not the distribution of a
convolution with one sampled kernel; Flipout costs the same two convolutions and is what
uncertainty-baselines' VI baseline uses (edward2 ``Conv2DFlipout`` / ``DenseFlipout``).

Initialisation (uncertainty-baselines ``wide_resnet_variational``, edward2
``TrainableHeNormal``): μ as the network's deterministic kernels (uncertainty-baselines' WRN:
He-normal, fan-in, truncated; the layers' default), ρ ~ TruncatedNormal(softplus⁻¹(σ₀), 0.1)
with σ₀ = 1e-3.  Parameters: ``kernel`` (μ; a deterministic checkpoint's kernel loads into it),
``kernel_rho`` (ρ) and ``bias``.  Noise comes from the ``"noise"`` RNG stream, at training and
evaluation alike.

The iBNN repository's own BNN-VI (trungtrinh44/ibnn at 665ba40, ``models/utils.py``:
``BayesianLinear``, ``BayesianConv2d``) is :class:`BayesianConv` / :class:`BayesianDense`: the
biases are variational too (``bias``, ``bias_rho``), ρ starts at softplus⁻¹|N(σ₀, 0.001²)| with
σ₀ = 0.015 (``nn.init.normal_(weight_std, 0.015, 0.001)`` then ``abs_().expm1_().log_()``), and a
pass draws one sample of the kernel and one of the bias for the whole batch (``rsample()``), no
Flipout.  :func:`kl_divergence` sums over every variational kernel and bias.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from smoothing_jax.layers.functional import conv2d, layers_holding

POSTERIOR_STD_INIT = 1e-3  # σ₀ (uncertainty-baselines ``--stddev_init``)
RHO_INIT_STD = 0.1          # std of the truncated normal around softplus⁻¹(σ₀) (edward2)
# The iBNN repository's σ initialisation |N(0.015, 0.001²)| (``models/utils.py`` at 665ba40,
# ``BayesianLinear.__init__`` and ``BayesianConv2d.__init__``).
IBNN_POSTERIOR_STD_INIT = 0.015
IBNN_POSTERIOR_STD_SPREAD = 0.001


# μ: Keras ``he_normal`` (truncated normal, fan-in, variance 2 / fan_in), edward2's
# ``TrainableHeNormal``; the models pass their family's initialiser (``CNN.kernel_init``).
he_normal = nn.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")


def rho_init(posterior_std: float = POSTERIOR_STD_INIT, std: float = RHO_INIT_STD):
  """ρ ~ N(softplus⁻¹(σ₀), std²) truncated at two standard deviations (Keras TruncatedNormal)."""
  mean = math.log(math.expm1(posterior_std))
  return lambda key, shape, dtype=jnp.float32: mean + std * jax.random.truncated_normal(
      key, -2.0, 2.0, shape, dtype)


def abs_normal_rho_init(posterior_std: float = IBNN_POSTERIOR_STD_INIT,
                        spread: float = IBNN_POSTERIOR_STD_SPREAD):
  """ρ = softplus⁻¹(|N(σ₀, spread²)|) = log(expm1|ε|): the iBNN repository's initialisation."""
  def init(key, shape, dtype=jnp.float32):
    sigma = jnp.abs(posterior_std + spread * jax.random.normal(key, shape, dtype))
    return jnp.log(jnp.expm1(sigma))
  return init


def gaussian_kl(mean, std, prior_mean, prior_std):
  """KL(N(mean, std²) ‖ N(prior_mean, prior_std²)), elementwise (closed form)."""
  return jnp.log(prior_std / std) + (std**2 + (mean - prior_mean)**2) / (2 * prior_std**2) - 0.5


VARIATIONAL = ("kernel", "bias")  # parameters that may have a posterior σ (``<name>_rho``)


def mean_field_layers(params) -> list:
  """The parameter dicts of every mean-field layer (those holding ``kernel_rho``; Flipout's and
  the iBNN repository's alike), in order."""
  return layers_holding(params, "kernel_rho")


def kl_divergence(params, prior_std: float, prior_mean: float | None = None):
  """Σ over every variational kernel entry and bias (those with a ``<name>_rho``: the iBNN
  repository's layers have variational biases) of KL(q(w) ‖ p(w)), p = N(prior_mean, prior_std²).

  ``prior_mean`` None ties the prior's mean to the posterior's (uncertainty-baselines' default,
  edward2 ``NormalKLDivergenceWithTiedMean``): only σ is pulled, towards ``prior_std``.
  """
  total = 0.0
  for layer in mean_field_layers(params):
    for name in VARIATIONAL:
      if f"{name}_rho" in layer:
        mean, std = layer[name], jax.nn.softplus(layer[f"{name}_rho"])
        total += jnp.sum(gaussian_kl(mean, std, mean if prior_mean is None else prior_mean,
                                     prior_std))
  return total


class _MeanField(nn.Module):
  """μ, ρ of a kernel and the Flipout draw."""
  posterior_std_init: float = POSTERIOR_STD_INIT
  kernel_init: Callable = he_normal
  bias_init: Callable = nn.initializers.zeros

  def kernel_posterior(self, shape):
    mean = self.param("kernel", self.kernel_init, shape)
    rho = self.param("kernel_rho", rho_init(self.posterior_std_init), shape)
    return mean, nn.softplus(rho)

  def flipout(self, x, std, apply_kernel):
    """``apply_kernel(x ∘ s, σ ∘ ε) ∘ r``: the per-example perturbation (one ε, signs per row)."""
    key_eps, key_in, key_out = jax.random.split(self.make_rng("noise"), 3)
    delta = std * jax.random.normal(key_eps, std.shape, std.dtype)
    sign_in = jax.random.rademacher(key_in, (x.shape[0], x.shape[-1]), x.dtype)
    y = apply_kernel(x * sign_in.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)),
                     delta)
    sign_out = jax.random.rademacher(key_out, (y.shape[0], y.shape[-1]), y.dtype)
    return y * sign_out.reshape((y.shape[0],) + (1,) * (y.ndim - 2) + (y.shape[-1],))


class MeanFieldConv(_MeanField):
  """``nn.Conv2d`` (explicit symmetric zero padding) with a mean-field Gaussian kernel, Flipout.

  ``__call__(x [B,H,W,C_in]) -> [B,H',W',features]``.
  """
  features: int = 64
  kernel_size: int = 3
  stride: int = 1
  padding: int = 0
  use_bias: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    mean, std = self.kernel_posterior((self.kernel_size, self.kernel_size, x.shape[-1],
                                       self.features))

    def conv(inputs, kernel):
      return conv2d(inputs, kernel, self.stride, self.padding, dtype=self.dtype)

    y = conv(x, mean) + self.flipout(x, std, conv)
    if self.use_bias:
      y = y + self.param("bias", self.bias_init, (self.features,)).astype(y.dtype)
    return y


class MeanFieldDense(_MeanField):
  """``nn.Dense`` with a mean-field Gaussian kernel (Flipout) and a deterministic bias.
  ``__call__(x [B,C_in]) -> [B,features]``."""
  features: int = 10
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    mean, std = self.kernel_posterior((x.shape[-1], self.features))

    def matmul(inputs, kernel):
      return inputs.astype(self.dtype) @ kernel.astype(self.dtype)

    y = matmul(x, mean) + self.flipout(x, std, matmul)
    return y + self.param("bias", self.bias_init, (self.features,)).astype(y.dtype)


class _OneSample(nn.Module):
  """A kernel (and bias) drawn once per pass for the whole batch: w = μ + σ ∘ ε, σ = softplus(ρ),
  ρ from :func:`abs_normal_rho_init` (the iBNN repository's ``rsample()``)."""
  posterior_std_init: float = IBNN_POSTERIOR_STD_INIT
  kernel_init: Callable = he_normal
  bias_init: Callable = nn.initializers.zeros

  def sample(self, name: str, init: Callable, shape):
    """One draw of the parameter ``name`` (μ) with its posterior σ (``<name>_rho``)."""
    mean = self.param(name, init, shape)
    rho = self.param(f"{name}_rho", abs_normal_rho_init(self.posterior_std_init), shape)
    return mean + nn.softplus(rho) * jax.random.normal(self.make_rng("noise"), shape, mean.dtype)


class BayesianConv(_OneSample):
  """The iBNN repository's ``BayesianConv2d``: ``nn.Conv2d`` (explicit symmetric zero padding)
  with a Gaussian kernel and bias, one sample of each per pass.
  ``__call__(x [B,H,W,C_in]) -> [B,H',W',features]``."""
  features: int = 64
  kernel_size: int = 3
  stride: int = 1
  padding: int = 0
  use_bias: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.sample("kernel", self.kernel_init, (self.kernel_size, self.kernel_size,
                                                      x.shape[-1], self.features))
    y = conv2d(x, kernel, self.stride, self.padding, dtype=self.dtype)
    if self.use_bias:
      y = y + self.sample("bias", self.bias_init, (self.features,)).astype(y.dtype)
    return y


class BayesianDense(_OneSample):
  """The iBNN repository's ``BayesianLinear``: ``nn.Dense`` with a Gaussian kernel and bias, one
  sample of each per pass.  ``__call__(x [B,C_in]) -> [B,features]``."""
  features: int = 10
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.sample("kernel", self.kernel_init, (x.shape[-1], self.features))
    y = x.astype(self.dtype) @ kernel.astype(self.dtype)
    return y + self.sample("bias", self.bias_init, (self.features,)).astype(y.dtype)
