"""AlexNet without BatchNorm (reference ``models/alexnet.py``).

conv-ReLU blocks (no conv bias) with MC dropout (rate 0.1 in the reference)
after each; smoothing after each of the three groups.  ImageNet stem: 11×11/4
conv and 3/2 max-pools, 6×6 pooled MLP input; CIFAR stem: 3×3/2 conv and 2/2
max-pools, 2×2 pooled MLP input.
"""
from __future__ import annotations

import flax.linen as nn

from smoothing_jax.models.cnn import (
  CNN,
  GAPHead,
  MLPHead,
  adaptive_avg_pool,
  check_images,
  conv,
  max_pool,
)


class AlexNetBlock(CNN):
  features: int = 64
  kernel_size: int = 3
  stride: int = 1
  padding: int = 1

  @nn.compact
  def __call__(self, x):
    x = conv(self.features,
             self.kernel_size,
             self.stride,
             self.padding,
             dtype=self.dtype,
             name="conv")(x)
    return self.dropout(nn.relu(x))


class AlexNet(CNN):
  """AlexNet.  ``__call__(images [B,H,W,3], train) -> logits``."""
  width: int = 64

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the blocks (the stem conv block ``layer0_0`` is depth 0) and the smoothing layers."""
    taps = []
    for stage, blocks in enumerate((("layer0_0",), ("layer1_1",),
                                    ("layer2_1", "layer2_2", "layer2_3"))):
      taps += [(name, "conv") for name in blocks]
      if self.smoothing:
        taps.append((f"smooth{stage}_0", "smooth"))
    return taps

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_images(x)
    classifier = self.check_options("mlp")
    w = self.width

    def block(features, kernel_size, stride, padding, name):
      return AlexNetBlock(features=features,
                          kernel_size=kernel_size,
                          stride=stride,
                          padding=padding,
                          dropout_rate=self.dropout_rate,
                          dtype=self.dtype,
                          name=name)
    imagenet = self.stem == "imagenet"
    pool = (lambda y: max_pool(y, 3, 2)) if imagenet else (lambda y: max_pool(y, 2, 2))

    x = (block(w, 11, 4, 2, name="layer0_0") if imagenet else block(w, 3, 2, 1, name="layer0_0"))(x)
    x = self.smooth(x, "smooth0_0")
    x = block(3 * w, 5, 1, 2, name="layer1_1")(pool(x))
    x = self.smooth(x, "smooth1_0")
    x = block(6 * w, 3, 1, 1, name="layer2_1")(pool(x))
    x = block(4 * w, 3, 1, 1, name="layer2_2")(x)
    x = block(4 * w, 3, 1, 1, name="layer2_3")(x)
    x = self.smooth(x, "smooth2_0")
    if classifier == "mlp":
      x = adaptive_avg_pool(pool(x), 6 if imagenet else 2)
      return MLPHead(self.num_classes, dtype=self.dtype, name="classifier_2")(x, train)
    return GAPHead(self.num_classes, dtype=self.dtype, name="classifier_0")(x, train)
