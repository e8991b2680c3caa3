"""ResNet, pre-activation ResNet, ResNeXt and Wide ResNet-50-2/101-2 (reference
``models/resnet.py``).

One module, variants as arguments:
  * ``block``: ``"basic"`` or ``"bottleneck"``; ``groups`` / ``width_per_group``
    give ResNeXt (32×4d, 32×8d) and Wide ResNet (width 128);
  * ``preact``: pre-activation blocks, a conv-only stem and a BN-ReLU-GAP head;
  * MC dropout between the two convs of a basic block / before the last conv of
    a bottleneck; smoothing after every stage (pre-activation: stages 1–3);
  * ``ensemble_size`` M > 0: BatchEnsemble (``resnet_batchensemble_18``): every conv, the
    shortcuts included, and the classifier get rank-1 fast weights per member (BatchNorm shared,
    as in uncertainty-baselines' WRN; TorchUncertainty leaves the shortcut conv unbatched);
    ``mean_field``: BNN-VI, every conv and the classifier with mean-field Gaussian kernels;
  * ``mimo_members`` M > 0: MIMO (``resnet_mimo_18``): M inputs concatenated on channels into the
    stem, M heads (``cnn.MultiHead``).
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.models.cnn import (
  CNN,
  GAPHead,
  MLPHead,
  adaptive_avg_pool,
  batch_norm,
  drop_path,
  max_pool,
)

EXPANSION = {"basic": 1, "bottleneck": 4}
WEIGHTS = ("point", "batch_ensemble", "mean_field", "spectral_norm")  # ResNet's kinds


class _Block(CNN):
  """Fields shared by the residual blocks: output ``channels · expansion``, inner width for
  groups."""
  channels: int = 64
  stride: int = 1
  block: str = "basic"
  groups: int = 1
  width_per_group: int = 64
  drop_path_rate: float = 0.0

  def widths(self):
    """(inner width of the 3×3 conv, block output channels), as torchvision computes them."""
    return int(self.channels *
               (self.width_per_group / 64.0)) * self.groups, self.channels * EXPANSION[self.block]


class ResNetBlock(_Block):
  """Post-activation basic/bottleneck block (torchvision layout, stride on the 3×3 conv)."""

  @nn.compact
  def __call__(self, x, train: bool, components=None):
    width, out_channels = self.widths()
    c = components
    skip = x
    if self.stride != 1 or x.shape[-1] != out_channels:
      skip = self.conv(x, c, out_channels, 1, self.stride, name="shortcut_0")
      skip = self.bn(train, "shortcut_1")(skip)
    if self.block == "basic":
      y = nn.relu(self.bn(train, "bn1")(self.conv(x, c, width, 3, self.stride, 1, name="conv1")))
      y = self.dropout(y)
      y = self.bn(train, "bn2")(self.conv(y, c, out_channels, 3, 1, 1, name="conv2"))
    else:
      y = nn.relu(self.bn(train, "bn1")(self.conv(x, c, width, 1, name="conv1")))
      y = self.conv(y, c, width, 3, self.stride, 1, name="conv2", groups=self.groups)
      y = self.dropout(nn.relu(self.bn(train, "bn2")(y)))
      y = self.bn(train, "bn3")(self.conv(y, c, out_channels, 1, name="conv3"))
    return nn.relu(skip + y)


class PreActBlock(_Block):
  """Pre-activation basic/bottleneck block; the 1×1 shortcut sees BN-ReLU(x).

  The MC-dropout bottleneck puts a BatchNorm after that shortcut conv (SS/HV
  ``preresnet_mcdo_block.Bottleneck``); the dnn bottleneck and basic blocks have none.

  ``keep`` scales the residual branch (lesion studies); ``drop_path_rate`` is stochastic depth.
  """

  @nn.compact
  def __call__(self, x, train: bool, keep=None, components=None):
    width, out_channels = self.widths()
    c = components
    pre = nn.relu(self.bn(train, "bn1")(x))
    if self.stride != 1 or x.shape[-1] != out_channels:
      skip = self.conv(pre, c, out_channels, 1, self.stride, name="shortcut_0")
      if self.block == "bottleneck" and self.dropout_rate > 0:
        skip = self.bn(train, "shortcut_1")(skip)
    else:
      skip = x
    if self.block == "basic":
      y = self.conv(pre, c, width, 3, self.stride, 1, name="conv1")
      y = self.dropout(nn.relu(self.bn(train, "bn2")(y)))
      y = self.conv(y, c, out_channels, 3, 1, 1, name="conv2")
    else:
      y = self.conv(pre, c, width, 1, name="conv1")
      y = nn.relu(self.bn(train, "bn2")(y))
      y = self.conv(y, c, width, 3, self.stride, 1, name="conv2", groups=self.groups)
      y = self.dropout(nn.relu(self.bn(train, "bn3")(y)))
      y = self.conv(y, c, out_channels, 1, name="conv3")
    return skip + drop_path(y, self.drop_path_rate, train, keep)


class ResNet(CNN):
  """ResNet family.  ``__call__(images [B,H,W,3], train, components=None) -> logits [B, C]``
  (``components``: each row's BatchEnsemble member)."""
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  block: str = "basic"
  groups: int = 1
  width_per_group: int = 64
  preact: bool = False
  width: int = 64

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the stem output at depth 0, the blocks and the smoothing layers."""
    taps = [("stem", "stem")]
    for stage, num_blocks in enumerate(self.stage_sizes, start=1):
      taps += [(f"layer{stage}_{j}", "conv") for j in range(num_blocks)]
      if self.smoothing and self._smooths(stage):
        taps.append((f"smooth{stage}_0", "smooth"))
    return taps

  def _smooths(self, stage: int) -> bool:
    # Pre-activation networks do not smooth the last stage (reference num_sblocks [1, 1, 1, 0]).
    return not (self.preact and stage == len(self.stage_sizes))

  @nn.compact
  def __call__(self, x, train: bool = False, components=None):
    x = self.mimo_inputs(x)
    classifier = self.check_options("gap", weights=WEIGHTS, mimo=True)
    if self.weights != "point" and classifier != "gap":
      raise ValueError(f"A ResNet with {self.weights} weights has the GAP classifier only.")
    if self.block not in EXPANSION:
      raise ValueError(f"Unknown ResNet block {self.block!r}; choose one of {sorted(EXPANSION)}.")
    if self.block == "basic" and (self.groups != 1 or self.width_per_group != 64):
      raise ValueError("Basic blocks support only groups=1 and width_per_group=64.")
    if self.stem == "imagenet":
      x = self.conv(x, components, self.width, 7, 2, 3, name="layer0_0")
    else:
      x = self.conv(x, components, self.width, 3, 1, 1, name="layer0_0")
    if not self.preact:
      x = nn.relu(self.bn(train, "layer0_1")(x))
    if self.stem == "imagenet":
      x = max_pool(x, 3, 2, 1)
    self.sow("intermediates", "stem", x)  # depth 0 of the feature taps

    block_cls = PreActBlock if self.preact else ResNetBlock
    shared = dict(dropout_rate=self.dropout_rate, dtype=self.dtype, **self.weight_options())
    for stage, num_blocks in enumerate(self.stage_sizes, start=1):
      channels = self.width * 2 ** (stage - 1)
      for j in range(num_blocks):
        x = block_cls(channels=channels,
                      stride=2 if (stage > 1 and j == 0) else 1,
                      block=self.block,
                      groups=self.groups,
                      width_per_group=self.width_per_group,
                      name=f"layer{stage}_{j}",
                      **shared)(x, train, components=components)
      if self._smooths(stage):
        x = self.smooth(x, f"smooth{stage}_0")

    if classifier == "mlp":
      return MLPHead(self.num_classes, dtype=self.dtype,
                     name="classifier_1")(adaptive_avg_pool(x, 7), train)
    if self.weights != "point" or self.mimo_members:  # GAPHead's layers, its own dense
      if self.preact:
        x = nn.relu(batch_norm(use_running_average=not train, dtype=self.dtype,
                               name="classifier_bn")(x))
      return self.classifier_dense(jnp.mean(x, axis=(1, 2)), components, name="classifier_0")
    return GAPHead(self.num_classes, bn=self.preact, dtype=self.dtype, name="classifier_0")(x,
                                                                                            train)
