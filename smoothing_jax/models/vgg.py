"""VGG and pre-activation VGG (reference ``models/vggnet.py``, ``prevggnet.py``).

Five conv groups of 3×3 conv-BN-ReLU blocks (pre-activation: BN-ReLU-conv), each
group after the first starting with a 2×2 max-pool; MC dropout after every
block; smoothing after every group, before the next max-pool.  The reference
head is max-pool + adaptive average pool to 7×7 + a 4096-4096 MLP.

``vgg_ibnn_16`` is the iBNN reference's VGG-16: no BatchNorm (conv biases
instead), head max-pool + 512-512-C MLP (``classifier="mlp512"``), and iBNN node
noise on the input of all 13 convs and 3 dense layers: 5,251 noisy input nodes
per component.  ``vgg_bnnvi_16`` is the same network with mean-field Gaussian kernels (BNN-VI),
uncertainty-baselines' layers; ``vgg_bayesian_16`` is the iBNN repository's own BNN-VI, the
baseline of the iBNN paper (``BayesianVGG16``: variational kernels and biases, one sample per
pass).  The reference's deterministic ``DetVGG16`` puts dropout 0.5
before both hidden layers of that head (``head_dropout_rate``), train-only for its SGD baseline
and kept on at test time for its MC dropout (``head_mc_dropout``).
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn

from smoothing_jax.layers import MCDropout
from smoothing_jax.models.cnn import (
  CLASSIFIERS,
  CNN,
  WEIGHTS,
  GAPHead,
  MLPHead,
  adaptive_avg_pool,
  check_images,
  max_pool,
)

VGG_STAGES = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}


class VGGBlock(CNN):
  features: int = 64
  preact: bool = False
  batch_norm: bool = True

  @nn.compact
  def __call__(self, x, train: bool, components=None):
    if not self.batch_norm:
      x = nn.relu(self.conv(x, components, self.features, 3, 1, 1, bias=True, name="conv"))
    elif self.preact:
      x = nn.relu(self.bn(train, "bn")(x))
      x = self.conv(x, components, self.features, 3, 1, 1, name="conv")
    else:
      x = self.conv(x, components, self.features, 3, 1, 1, name="conv")
      x = nn.relu(self.bn(train, "bn")(x))
    return self.dropout(x)


class VGG(CNN):
  """VGG family.  ``__call__(images [B,H,W,3], train, components=None) -> logits``.

  The architecture is the same for CIFAR and ImageNet inputs (``stem`` has no effect).
  """
  stage_sizes: Sequence[int] = VGG_STAGES[16]
  preact: bool = False
  batch_norm: bool = True
  width: int = 64
  head_dropout_rate: float = 0.0   # mlp512 head: dropout before each hidden layer
  head_mc_dropout: bool = False    # ... kept on at evaluation (MC dropout)

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the blocks (the first is depth 0: VGG has no stem) and the smoothing layers."""
    taps = []
    for stage, num_blocks in enumerate(self.stage_sizes):
      offset = 1 if stage else 0  # index 0 of a later group is its max-pool
      taps += [(f"layer{stage}_{j + offset}", "conv") for j in range(num_blocks)]
      if self.smoothing:
        taps.append((f"smooth{stage}_0", "smooth"))
    return taps

  @nn.compact
  def __call__(self, x, train: bool = False, components=None):
    check_images(x)
    classifier = self.check_options("mlp", CLASSIFIERS, weights=WEIGHTS)
    widths = [self.width, 2 * self.width, 4 * self.width, 8 * self.width, 8 * self.width]
    for stage, (num_blocks, features) in enumerate(zip(self.stage_sizes, widths, strict=False)):
      offset = 0
      if stage > 0:
        x = max_pool(x, 2, 2)
        offset = 1  # index 0 of the reference Sequential is the max-pool
      for j in range(num_blocks):
        x = VGGBlock(features=features, preact=self.preact, batch_norm=self.batch_norm,
                     dropout_rate=self.dropout_rate, dtype=self.dtype, **self.weight_options(),
                     name=f"layer{stage}_{j + offset}")(x, train, components)
      x = self.smooth(x, f"smooth{stage}_0")
    if self.head_dropout_rate and classifier != "mlp512":
      raise ValueError("head_dropout_rate is the mlp512 head's (the iBNN reference's DetVGG16); "
                       f"classifier {classifier!r} has its own.")
    if self.weights != "point" and classifier != "mlp512":
      raise ValueError(f"A VGG with {self.weights} weights needs classifier='mlp512' (the iBNN "
                       "reference's 512-512-C head).")
    if classifier == "mlp512":
      x = max_pool(x, 2, 2).reshape(x.shape[0], -1)
      for i in (0, 1):
        x = self.head_dropout(x, train)
        x = nn.relu(self.dense(x, components, 8 * self.width, name=f"classifier_{i}"))
      return self.dense(x, components, self.num_classes, name="classifier_2")
    if classifier == "mlp":
      x = adaptive_avg_pool(max_pool(x, 2, 2), 7)
      return MLPHead(self.num_classes, dtype=self.dtype, name="classifier_2")(x, train)
    return GAPHead(self.num_classes, dtype=self.dtype, name="classifier_0")(x, train)

  def head_dropout(self, x, train: bool):
    """The mlp512 head's dropout: MC dropout with ``head_mc_dropout``, else train-only."""
    if not 0.0 <= self.head_dropout_rate < 1.0:
      raise ValueError(f"head_dropout_rate must be in [0, 1), got {self.head_dropout_rate!r}.")
    if self.head_dropout_rate == 0.0:
      return x
    if self.head_mc_dropout:
      return MCDropout(self.head_dropout_rate)(x)
    return nn.Dropout(self.head_dropout_rate, deterministic=not train)(x)
