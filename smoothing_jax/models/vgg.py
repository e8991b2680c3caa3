"""VGG and pre-activation VGG (reference ``models/vggnet.py``, ``prevggnet.py``).

Five conv groups of 3×3 conv-BN-ReLU blocks (pre-activation: BN-ReLU-conv), each
group after the first starting with a 2×2 max-pool; MC dropout after every
block; smoothing after every group, before the next max-pool.  The reference
head is max-pool + adaptive average pool to 7×7 + a 4096-4096 MLP.
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from smoothing_jax.models.common import CNN, GAPHead, MLPHead, adaptive_avg_pool, check_images, conv, max_pool

VGG_STAGES = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}


class VGGBlock(CNN):
  features: int = 64
  preact: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    if self.preact:
      x = nn.relu(self.bn(train, "bn")(x))
      x = conv(self.features, 3, 1, 1, dtype=self.dtype, name="conv")(x)
    else:
      x = conv(self.features, 3, 1, 1, dtype=self.dtype, name="conv")(x)
      x = nn.relu(self.bn(train, "bn")(x))
    return self.dropout(x)


class VGG(CNN):
  """VGG family.  ``__call__(images [B,H,W,3], train) -> logits``.

  The architecture is the same for CIFAR and ImageNet inputs (``stem`` has no effect).
  """
  stage_sizes: Sequence[int] = VGG_STAGES[16]
  preact: bool = False
  width: int = 64

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_images(x)
    classifier = self.check_options("mlp")
    widths = [self.width, 2 * self.width, 4 * self.width, 8 * self.width, 8 * self.width]
    for stage, (num_blocks, features) in enumerate(zip(self.stage_sizes, widths)):
      offset = 0
      if stage > 0:
        x = max_pool(x, 2, 2)
        offset = 1  # index 0 of the reference Sequential is the max-pool
      for j in range(num_blocks):
        x = VGGBlock(features=features, preact=self.preact, dropout_rate=self.dropout_rate,
                     dtype=self.dtype, name=f"layer{stage}_{j + offset}")(x, train)
      x = self.smooth(x, f"smooth{stage}_0")
    if classifier == "mlp":
      x = adaptive_avg_pool(max_pool(x, 2, 2), 7)
      return MLPHead(self.num_classes, dtype=self.dtype, name="classifier_2")(x, train)
    return GAPHead(self.num_classes, dtype=self.dtype, name="classifier_0")(x, train)
