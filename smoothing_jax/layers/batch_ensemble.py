"""BatchEnsemble layers (Wen, Tran & Ba 2020, "BatchEnsemble: an alternative approach to efficient
ensemble and lifelong learning").

M members share one slow weight W; member i owns rank-1 fast weights: s_i on the input channels
and r_i on the output channels, and its own bias b_i.  Member i's kernel is W ∘ (s_i r_iᵀ), which
needs no kernel of its own (paper Eq. 2):

    y = ((x ∘ s_i) W) ∘ r_i + b_i          (a convolution: s_i, r_i broadcast over H×W)

Each row of the batch names its member (``members [B]``); as in the iBNN layers, None means the
training rule, row r uses member r mod M (the batch repeated M times, one copy per member).
The convolution computes that rule (B a multiple of M) as M convolutions with the members'
kernels, as a deep ensemble does (``BatchEnsembleConv.members_apart``); explicit ``members``
scale the rows.

Parameters: ``kernel`` (W), ``fast_in`` [M, C_in] (s; edward2's ``alpha``, TorchUncertainty's
``r_group``), ``fast_out`` [M, C_out] (r; edward2's ``gamma``) and ``bias`` [M, C_out].
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from smoothing_jax.layers.functional import conv2d, in_layers_holding
from smoothing_jax.layers.mean_field import he_normal  # uncertainty-baselines' kernel initialiser

FAST_WEIGHTS = ("fast_in", "fast_out")
RANDOM_SIGN_INIT = -0.5  # uncertainty-baselines' CIFAR default: fast weights ~ N(1, 0.5²)


def random_sign_init(random_sign_init: float) -> Callable:
  """uncertainty-baselines' ``make_sign_initializer``: for ``random_sign_init`` = p > 0 each entry
  is +1 with probability p and −1 otherwise (edward2 ``RandomSign(p)``); for p < 0, N(1, p²)
  (``RandomNormal(mean=1, stddev=-p)``)."""
  if random_sign_init > 0:
    def init(key, shape, dtype=jnp.float32):
      return jnp.where(jax.random.bernoulli(key, random_sign_init, shape), 1.0, -1.0).astype(dtype)
    return init
  return lambda key, shape, dtype=jnp.float32: 1.0 - random_sign_init * jax.random.normal(
      key, shape, dtype)


def member_indices(members, batch: int, ensemble_size: int):
  """``members`` as an int array ``[B]``; None: row r uses member r mod M (the training rule)."""
  if members is None:
    return jnp.arange(batch) % ensemble_size
  return jnp.asarray(members)


class _BatchEnsemble(nn.Module):
  """Fast weights and per-member biases shared by the BatchEnsemble layers."""
  ensemble_size: int = 4
  random_sign_init: float = RANDOM_SIGN_INIT
  bias_init: Callable = nn.initializers.zeros  # each member's bias

  def fast_weights(self, name: str, channels: int):
    """The ``[M, channels]`` fast weights ``name`` (``fast_in``: s, ``fast_out``: r)."""
    if self.ensemble_size < 1:
      raise ValueError(f"ensemble_size (M) must be >= 1, got {self.ensemble_size}.")
    return self.param(name, random_sign_init(self.random_sign_init),
                      (self.ensemble_size, channels))

  def scale_input(self, x, members):
    """``(x ∘ s_member, members)``, s broadcast over the spatial axes."""
    fast_in = self.fast_weights("fast_in", x.shape[-1])
    members = member_indices(members, x.shape[0], self.ensemble_size)
    return x * self._per_row(fast_in[members], x), members

  def scale_output(self, y, members, use_bias: bool = True):
    """``y ∘ r_member + b_member`` (no bias when ``use_bias`` is False)."""
    fast_out = self.fast_weights("fast_out", y.shape[-1])
    y = y * self._per_row(fast_out[members], y)
    if use_bias:
      bias = self.param("bias", self.bias_init, (self.ensemble_size, y.shape[-1]))
      y = y + self._per_row(bias[members], y)
    return y

  @staticmethod
  def _per_row(values, x):
    """``values [B, C]`` shaped to broadcast against ``x [B, ..., C]``."""
    return values.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)).astype(x.dtype)


class BatchEnsembleConv(_BatchEnsemble):
  """``nn.Conv2d`` (explicit symmetric zero padding) with BatchEnsemble fast weights.

  ``__call__(x [B,H,W,C_in], members [B] or None) -> [B,H',W',features]``.
  """
  features: int = 64
  kernel_size: int = 3
  stride: int = 1
  padding: int = 0
  groups: int = 1
  use_bias: bool = True
  kernel_init: Callable = he_normal
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, members: jax.Array | None = None):
    m = self.ensemble_size
    if members is None and self.groups == 1 and m >= 1 and x.shape[0] % m == 0:
      return self.members_apart(x)
    x, members = self.scale_input(x, members)
    y = conv2d(x, self.make_kernel(x.shape[-1]), self.stride, self.padding, self.groups,
               dtype=self.dtype)
    return self.scale_output(y, members, self.use_bias)

  def make_kernel(self, in_channels: int):
    return self.param("kernel", self.kernel_init,
                      (self.kernel_size, self.kernel_size, in_channels // self.groups,
                       self.features))

  def members_apart(self, x):
    """The training rule (row r under member r mod M) as M convolutions, member m's rows with
    its own kernel W ∘ (s_m r_mᵀ) (paper Eq. 2), then its bias.

    Equal to x ∘ s, W, ∘ r to float rounding, and what a deep ensemble of M members computes.
    Measured on XLA:CPU (one 3×3 layer, width 16, 4 × 128 rows, forward and backward): scaling
    the activations before and after one convolution over the M·B rows took 1.5× the plain
    convolution, the gather of each row's weights (whose backward is a scatter-add) not being
    the cost (broadcasting them over a [B/M, M] view of the rows, as edward2 does, was no
    faster); the M convolutions take 0.94× it.  A member's rows are every M-th image, whole
    images apart: one copy in, one copy out."""
    m = self.ensemble_size
    fast_in = self.fast_weights("fast_in", x.shape[-1])  # the parameters in __call__'s order
    kernel = self.make_kernel(x.shape[-1])
    fast_out = self.fast_weights("fast_out", self.features)
    rows = jnp.split(x.reshape((x.shape[0] // m, m) + x.shape[1:]), m, axis=1)
    y = jnp.stack([conv2d(rows[i][:, 0], kernel * jnp.outer(fast_in[i], fast_out[i]),
                          self.stride, self.padding, dtype=self.dtype) for i in range(m)],
                  axis=1)  # [B/M, M, H', W', C_out]: row b·M + i is example b under member i
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (m, self.features))
      y = y + bias[:, None, None, :].astype(y.dtype)
    return y.reshape((x.shape[0],) + y.shape[2:])


class BatchEnsembleDense(_BatchEnsemble):
  """``nn.Dense`` with BatchEnsemble fast weights.
  ``__call__(x [B,C_in], members [B] or None) -> [B,features]``."""
  features: int = 10
  kernel_init: Callable = he_normal
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, members: jax.Array | None = None):
    x, members = self.scale_input(x, members)
    kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
    return self.scale_output(x.astype(self.dtype) @ kernel.astype(self.dtype), members)


def fast_weight_mask(params, with_bias: bool = False):
  """True for the fast weights (``fast_in``, ``fast_out``) of every BatchEnsemble layer, and with
  ``with_bias`` their members' biases: what uncertainty-baselines' ``fast_weight_lr_multiplier``
  scales (every variable named neither ``kernel`` nor ``batch_norm``)."""
  return in_layers_holding(params, "fast_in", FAST_WEIGHTS + (("bias",) if with_bias else ()))
