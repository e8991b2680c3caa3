"""AlterNet (HV Sec. 4): a pre-activation ResNet whose stage ends alternate Conv and MSA blocks.

Build-up rule: in a stage of n blocks with m MSA blocks the sequence is
``[Conv]·(n − 2m) + [Conv, MSA]·m`` — MSAs sit at the end of the stage, where the
paper's smoothing layers sit.  AlterNet-50: pre-act bottleneck stages
(3, 4, 6, 4), MSA blocks (0, 1, 3, 2), heads (3, 6, 12, 24), head width 64.

MSA block (HV ``AttentionBlockB``), pre-activation::

  x + DropPath(BN(Conv1×1(GELU(BN(x)))) → windowed MSA with relative position bias → C_out).

Windows are 4×4 on CIFAR (32×32 inputs; a 7-window does not divide the 4×4 last
stage) and 7×7 on ImageNet.  Stem without BN (conv 3×3 on CIFAR, conv 7×7/2 +
max-pool on ImageNet), head BN-ReLU-GAP-Dense.  ``msa_blocks=(0, 0, 0, 0)`` is the
ResNet backbone alone (same stem, blocks and head).

Lesion studies: ``block_mask`` [sum(stage_sizes)] scales every block's residual branch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.layers.attention import WindowAttention
from smoothing_jax.models.cnn import (
  STEMS,
  GAPHead,
  batch_norm,
  check_images,
  conv,
  drop_path,
  max_pool,
)
from smoothing_jax.models.resnet import EXPANSION, PreActBlock

WINDOW_SIZES = {"cifar": 4, "imagenet": 7}


class AttentionBlock(nn.Module):
  """Pre-activation MSA block: [B, H, W, C_in] → [B, H, W, channels · expansion]; inner width
  C_in / expansion."""
  channels: int
  num_heads: int
  head_dim: int = 64
  window_size: int = 4
  block: str = "bottleneck"
  drop_path_rate: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool, keep=None):
    out_channels = self.channels * EXPANSION[self.block]
    def bn(name):
      return batch_norm(use_running_average=not train, dtype=self.dtype, name=name)

    pre = nn.gelu(bn("bn1")(x), approximate=False)
    skip = x if x.shape[-1] == out_channels else conv(
        out_channels, 1, dtype=self.dtype, name="shortcut_0")(pre)
    y = bn("bn2")(conv(x.shape[-1] // EXPANSION[self.block], 1, dtype=self.dtype, name="conv")(pre))
    y = WindowAttention(self.window_size,
                        self.num_heads,
                        self.head_dim,
                        out_channels,
                        dtype=self.dtype,
                        name="attention")(y, train)
    return skip + drop_path(y, self.drop_path_rate, train, keep)


class AlterNet(nn.Module):
  """``__call__(images [B, H, W, 3], train, block_mask=None) -> logits [B, num_classes]``.

  Attributes:
    stage_sizes: blocks per stage; msa_blocks: MSA blocks per stage (2·m ≤ n).
    num_heads: heads per stage; head_dim: width of a head.
    window_size: MSA window (None: 4 for the CIFAR stem, 7 for ImageNet).
    block: "bottleneck" (AlterNet-50) or "basic" (AlterNet-18/34).
    width: channels of the stem and first stage (64); stochastic_depth: DropPath
      rate of the last block (linear in block index).
  """
  num_classes: int = 10
  stage_sizes: Sequence[int] = (3, 4, 6, 4)
  msa_blocks: Sequence[int] = (0, 1, 3, 2)
  num_heads: Sequence[int] = (3, 6, 12, 24)
  head_dim: int = 64
  window_size: int | None = None
  block: str = "bottleneck"
  width: int = 64
  stochastic_depth: float = 0.0
  stem: str = "cifar"
  dtype: Any = jnp.float32
  dropout_rate: ClassVar[float] = 0.0  # no MC dropout: test-time predictions are deterministic

  def units(self) -> list:
    """``[(name, kind)]`` of the residual blocks in order; kind is "conv" or "msa"."""
    self._check_structure()
    out = []
    for stage, (n, m) in enumerate(zip(self.stage_sizes, self.msa_blocks, strict=True), start=1):
      kinds = ["conv"] * (n - 2 * m) + ["conv", "msa"] * m
      out += [(f"layer{stage}_{j}", kind) for j, kind in enumerate(kinds)]
    return out

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the stem output at depth 0, then the blocks."""
    return [("stem", "stem")] + self.units()

  def _check_structure(self):
    if not len(self.stage_sizes) == len(self.msa_blocks) == len(self.num_heads):
      raise ValueError(
          f"stage_sizes {tuple(self.stage_sizes)}, msa_blocks {tuple(self.msa_blocks)} and "
          f"num_heads {tuple(self.num_heads)} need one entry per stage.")
    for n, m in zip(self.stage_sizes, self.msa_blocks, strict=True):
      if not 0 <= 2 * m <= n:
        raise ValueError(
            f"A stage of {n} blocks holds at most {n // 2} MSA blocks (each follows a Conv block); "
            f"msa_blocks={tuple(self.msa_blocks)}.")
    if self.block not in EXPANSION:
      raise ValueError(f"Unknown block {self.block!r}; choose one of {sorted(EXPANSION)}.")
    if self.stem not in STEMS:
      raise ValueError(f"Unknown stem {self.stem!r}; choose one of {STEMS}.")

  @nn.compact
  def __call__(self, x, train: bool = False, block_mask=None):
    check_images(x)
    units = self.units()
    window = self.window_size or WINDOW_SIZES[self.stem]
    if self.stem == "imagenet":
      x = max_pool(conv(self.width, 7, 2, 3, dtype=self.dtype, name="layer0_0")(x), 3, 2, 1)
    else:
      x = conv(self.width, 3, 1, 1, dtype=self.dtype, name="layer0_0")(x)
    self.sow("intermediates", "stem", x)  # depth 0 of the feature taps

    i = 0
    for stage, num_blocks in enumerate(self.stage_sizes, start=1):
      channels = self.width * 2 ** (stage - 1)
      for j in range(num_blocks):
        name, kind = units[i]
        rate = self.stochastic_depth * i / max(len(units) - 1, 1)
        keep = None if block_mask is None else block_mask[i]
        if kind == "msa":
          x = AttentionBlock(channels,
                             self.num_heads[stage - 1],
                             self.head_dim,
                             window,
                             self.block,
                             rate,
                             self.dtype,
                             name=name)(x, train, keep)
        else:
          x = PreActBlock(channels=channels,
                          stride=2 if (stage > 1 and j == 0) else 1,
                          block=self.block,
                          drop_path_rate=rate,
                          dtype=self.dtype,
                          name=name)(x, train, keep)
        i += 1
    return GAPHead(self.num_classes, bn=True, dtype=self.dtype, name="classifier_0")(x, train)
