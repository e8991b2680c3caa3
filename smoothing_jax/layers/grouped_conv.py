"""``GroupedConv``: ``nn.Conv`` with ``feature_group_count`` > 1 (Packed-Ensembles, ResNeXt), the
same parameters, computed by :func:`smoothing_jax.layers.functional.conv2d` (on XLA:CPU as one
convolution per group, many times faster there than XLA's grouped convolution)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.layers.functional import conv2d


class GroupedConv(nn.Module):
  """``nn.Conv2d(in, features, kernel_size, stride, padding, groups=groups, bias=use_bias)``:
  ``kernel [k, k, C_in/groups, features]`` and ``bias [features]``, named, shaped and
  initialised as ``nn.Conv``'s (checkpoints and converted weights load either way), computed in
  ``dtype`` (None: the promoted dtype of the inputs and parameters, as ``nn.Conv``)."""
  features: int
  kernel_size: int
  stride: int = 1
  padding: int = 0
  groups: int = 1
  use_bias: bool = False
  kernel_init: Callable = nn.linear.default_kernel_init
  bias_init: Callable = nn.initializers.zeros
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    if x.shape[-1] % self.groups or self.features % self.groups:
      raise ValueError(f"A convolution of {x.shape[-1]} → {self.features} channels in "
                       f"{self.groups} groups needs both divisible by {self.groups}.")
    kernel = self.param("kernel", self.kernel_init,
                        (self.kernel_size, self.kernel_size, x.shape[-1] // self.groups,
                         self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    y = conv2d(x, kernel, self.stride, self.padding, self.groups)
    return y if bias is None else y + bias
