"""iBNN node noise (Trinh et al., "Scalable Bayesian neural networks by layer-wise input
augmentation").

Every conv / dense layer multiplies its input nodes by z and (optionally) its
bias by a scalar s, drawn per example from component k of a K-component
variational mixture (paper Eqs. 9–12):

    y = W (z ⊙ x) + s·b,   z ~ N(μ_k, diag σ_k²),  s ~ N(m_k, τ_k²),  σ = softplus(ρ)

For convolutions z has one value per input channel, shared over H×W.  The
per-example component index k comes from the caller (training: row r uses
component r mod K; evaluation: every row uses one k).  Noise is drawn from the
``"noise"`` RNG stream, so MC dropout (``"dropout"``) can be combined or kept apart.

Parameters keep the deterministic layer's names (``kernel``, ``bias``) next to
the variational ones (``z_mean``, ``z_rho`` of shape [K, C_in], ``b_mean``,
``b_rho`` of shape [K]), so a deterministic checkpoint of the same architecture
loads into the deterministic part unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from smoothing_jax.layers.functional import conv2d

VARIATIONAL_PARAMS = ("z_mean", "z_rho", "b_mean", "b_rho")


def softplus_inverse(x):
  """ρ with softplus(ρ) = x (x > 0)."""
  return x + jnp.log(-jnp.expm1(-x))


def mean_init(mean: float, std: float) -> Callable:
  """μ ~ N(mean, std²)."""
  return lambda key, shape, dtype=jnp.float32: mean + std * jax.random.normal(key, shape, dtype)


def rho_init(mean: float = 0.05, std: float = 0.02) -> Callable:
  """ρ = softplus⁻¹(σ) with σ ~ |N(mean, std²)| (the reference's initialisation)."""
  return lambda key, shape, dtype=jnp.float32: softplus_inverse(
      jnp.maximum(jnp.abs(mean + std * jax.random.normal(key, shape, dtype)), 1e-6))


def _components(components, batch: int, num_components: int):
  if components is None:  # the training rule: row r uses component r mod K
    return jnp.arange(batch) % num_components
  return jnp.asarray(components)


class _NodeNoise(nn.Module):
  """Shared variational parameters and draws of the node-noise layers."""
  num_components: int = 4
  bias_noise: bool = True
  init_mean_std: float = 0.5      # μ ~ N(1, σ₀²): σ₀ = 0.5 (0.75 for VGG in the reference)
  init_std: tuple = (0.05, 0.02)  # σ ~ |N(0.05, 0.02²)|
  bias_init: Callable = nn.initializers.zeros

  def perturb_input(self, x, components):
    """``(z ⊙ x, components)`` with z drawn per example (one value per channel over H×W)."""
    if self.num_components < 1:
      raise ValueError(f"num_components (K) must be >= 1, got {self.num_components}.")
    k, c = self.num_components, x.shape[-1]
    z_mean = self.param("z_mean", mean_init(1.0, self.init_mean_std), (k, c))
    z_rho = self.param("z_rho", rho_init(*self.init_std), (k, c))
    components = _components(components, x.shape[0], k)
    eps = jax.random.normal(self.make_rng("noise"), (x.shape[0], c), x.dtype)
    z = z_mean[components] + nn.softplus(z_rho[components]) * eps
    return x * z.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (c,)).astype(x.dtype), components

  def add_bias(self, y, components, features):
    bias = self.param("bias", self.bias_init, (features,))
    if not self.bias_noise:
      return y + bias
    b_mean = self.param("b_mean", mean_init(1.0, self.init_mean_std), (self.num_components,))
    b_rho = self.param("b_rho", rho_init(*self.init_std), (self.num_components,))
    eps = jax.random.normal(self.make_rng("noise"), (y.shape[0],), y.dtype)
    s = b_mean[components] + nn.softplus(b_rho[components]) * eps
    return y + s.reshape((y.shape[0],) + (1,) * (y.ndim - 1)) * bias


class NodeNoiseConv(_NodeNoise):
  """``nn.Conv2d`` (explicit symmetric zero padding) with iBNN noise on its input channels.

  ``__call__(x [B,H,W,C_in], components [B] or None) -> [B,H',W',features]``.
  """
  features: int = 64
  kernel_size: int = 3
  stride: int = 1
  padding: int = 0
  use_bias: bool = False
  kernel_init: Callable = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, components: jax.Array | None = None):
    x, components = self.perturb_input(x, components)
    kernel = self.param("kernel", self.kernel_init,
                        (self.kernel_size, self.kernel_size, x.shape[-1], self.features))
    y = conv2d(x, kernel, self.stride, self.padding, dtype=self.dtype)
    return self.add_bias(y, components, self.features) if self.use_bias else y


class NodeNoiseDense(_NodeNoise):
  """``nn.Dense`` with iBNN noise on its input nodes.
  ``__call__(x [B,C_in], components) -> [B,features]``."""
  features: int = 10
  kernel_init: Callable = nn.initializers.lecun_normal()
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, components: jax.Array | None = None):
    x, components = self.perturb_input(x, components)
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
    y = x.astype(self.dtype) @ kernel.astype(self.dtype)
    return self.add_bias(y, components, self.features)
