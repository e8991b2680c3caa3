"""The Packed-Ensembles ResNet (Laurent et al., ICLR 2023; ``resnet_packed_18``):
TorchUncertainty's ``packed_resnet`` (``torch_uncertainty/models/classification/resnet/packed.py``
and ``layers/packed.py``, version 0.13.0) in Flax, its method in
:mod:`smoothing_jax.methods.packed`.

Every layer is ``alpha`` (α) times as wide as the base network's; a layer's channels are the M
members' blocks side by side (member m owns block m) and its convolution has
``feature_group_count`` = M·γ, γ groups inside each member (TorchUncertainty lowers γ, layer by
layer, until each group has at least ``min_channels_per_group`` = 64 input channels, and uses
γ = 1 on a block's first convolution).  The stem convolution is dense, its M blocks of output
channels the members' own stems; the head is a grouped 1×1 convolution (TorchUncertainty's
``PackedLinear``, ``implementation="conv1d"``), member m's logits from member m's pooled
features.  The module returns the M members' logits ``[B·M, C]``, row b·M + m example b under
member m.  Defaults: TorchUncertainty's CIFAR ResNet-18 recipe
(``experiments/classification/cifar10/configs/resnet18/packed.yaml``): M = 4, α = 2, γ = 2.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.models.cnn import (
  STEMS,
  batch_norm,
  check_images,
  conv,
  max_pool,
  pytorch_default,
  pytorch_default_bias,
)

# TorchUncertainty's CIFAR ResNet-18 recipe (``resnet18/packed.yaml``: num_estimators, alpha,
# gamma) and ``PackedConv2d``'s ``minimum_channels_per_group``.
NUM_ESTIMATORS, ALPHA, GAMMA, MIN_CHANNELS_PER_GROUP = 4, 2.0, 2, 64


def packed_groups(in_channels: int, num_estimators: int, gamma: int,
                  min_channels_per_group: int = MIN_CHANNELS_PER_GROUP) -> int:
  """The ``feature_group_count`` of a packed convolution on ``in_channels`` (already × α):
  M·γ, γ lowered until every group has ``min_channels_per_group`` input channels and divides
  them, but never below 1 (TorchUncertainty's ``PackedConv2d``)."""
  groups = gamma * num_estimators
  while ((in_channels % groups or in_channels // groups < min_channels_per_group)
         and groups // num_estimators > 1):
    gamma -= 1
    groups = gamma * num_estimators
  if in_channels % groups:
    raise ValueError(f"A packed convolution on {in_channels} channels needs them divisible by "
                     f"num_estimators·gamma = {groups}.")
  return groups


class PackedBlock(nn.Module):
  """TorchUncertainty's packed basic block: conv3×3 (γ = 1) – BN – ReLU – conv3×3 (γ) – BN,
  plus the identity or a 1×1 packed conv (γ) – BN shortcut; widths already × α."""
  channels: int
  stride: int
  num_estimators: int
  gamma: int
  min_channels_per_group: int
  dtype: Any = jnp.float32

  def conv(self, x, features, kernel_size, stride, padding, gamma, name):
    groups = packed_groups(x.shape[-1], self.num_estimators, gamma, self.min_channels_per_group)
    if features % groups:
      raise ValueError(f"A packed convolution of {features} output channels needs them divisible "
                       f"by its {groups} groups.")
    return conv(features, kernel_size, stride, padding, groups, dtype=self.dtype, name=name,
                kernel_init=pytorch_default)(x)

  @nn.compact
  def __call__(self, x, train: bool):
    def bn(name):
      return batch_norm(use_running_average=not train, dtype=self.dtype, name=name)
    y = nn.relu(bn("bn1")(self.conv(x, self.channels, 3, self.stride, 1, 1, "conv1")))
    y = bn("bn2")(self.conv(y, self.channels, 3, 1, 1, self.gamma, "conv2"))
    skip = x
    if self.stride != 1 or x.shape[-1] != self.channels:
      skip = bn("shortcut_1")(self.conv(x, self.channels, 1, self.stride, 0, self.gamma,
                                        "shortcut_0"))
    return nn.relu(y + skip)


class PackedResNet(nn.Module):
  """A Packed-Ensembles ResNet of basic blocks.  ``__call__(images [B, H, W, 3], train) ->
  logits [B·M, C]`` (row b·M + m: example b under member m).

  Attributes:
    num_estimators: M, the members.
    alpha: α, each layer's width × α (the M members share it: α/M of the base width each).
    gamma: γ, groups inside each member of the convolutions but a block's first.
    width: the base network's stem width (64; stages double it).
    min_channels_per_group: input channels a group keeps at least (γ lowered where fewer).
  Submodule names follow TorchUncertainty's ``state_dict`` keys (``layer1.0.conv1.conv`` ↔
  ``layer1_0/conv1``).
  """
  num_classes: int = 10
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  num_estimators: int = NUM_ESTIMATORS
  alpha: float = ALPHA
  gamma: int = GAMMA
  width: int = 64
  min_channels_per_group: int = MIN_CHANNELS_PER_GROUP
  stem: str = "cifar"
  dtype: Any = jnp.float32

  def feature_taps(self) -> list:
    """``[(name, kind)]``: the stem (all members' channels) and every block."""
    return [("stem", "stem")] + [(f"layer{s}_{j}", "conv")
                                 for s, n in enumerate(self.stage_sizes, start=1)
                                 for j in range(n)]

  def check(self) -> None:
    """ValueError (one line) for settings TorchUncertainty refuses."""
    if not isinstance(self.num_estimators, int) or self.num_estimators < 1:
      raise ValueError(f"num_estimators (M) must be an integer >= 1, got {self.num_estimators!r}.")
    if not isinstance(self.gamma, int) or self.gamma < 1:
      raise ValueError(f"gamma must be an integer >= 1, got {self.gamma!r}.")
    if not self.alpha > 0:
      raise ValueError(f"alpha must be > 0, got {self.alpha!r}.")
    if self.stem not in STEMS:
      raise ValueError(f"Unknown stem {self.stem!r}; choose one of {STEMS}.")

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_images(x)
    self.check()
    m = self.num_estimators
    stem = int(self.width * self.alpha)
    if self.stem == "imagenet":
      x = conv(stem, 7, 2, 3, dtype=self.dtype, name="conv1", kernel_init=pytorch_default)(x)
    else:
      x = conv(stem, 3, 1, 1, dtype=self.dtype, name="conv1", kernel_init=pytorch_default)(x)
    x = nn.relu(batch_norm(use_running_average=not train, dtype=self.dtype, name="bn1")(x))
    if self.stem == "imagenet":
      x = max_pool(x, 3, 2, 1)
    self.sow("intermediates", "stem", x)
    for stage, num_blocks in enumerate(self.stage_sizes, start=1):
      channels = int(self.width * 2 ** (stage - 1) * self.alpha)
      for j in range(num_blocks):
        x = PackedBlock(channels, 2 if (stage > 1 and j == 0) else 1, m, self.gamma,
                        self.min_channels_per_group, self.dtype, name=f"layer{stage}_{j}")(x, train)
    features = jnp.mean(x, axis=(1, 2))
    if features.shape[-1] % m:
      raise ValueError(f"The head's {features.shape[-1]} features must be divisible by "
                       f"num_estimators = {m}.")
    self.sow("intermediates", "features", features)  # the members' classifier inputs, side by side
    logits = conv(self.num_classes * m, 1, groups=m, bias=True, dtype=self.dtype,
                  kernel_init=pytorch_default,
                  bias_init=pytorch_default_bias(features.shape[-1] // m),
                  name="linear")(features[:, None, None, :])
    return logits.reshape(-1, self.num_classes)  # [B, (m c)] → [B·M, C]
