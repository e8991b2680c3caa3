"""WRN-28-10 (Zagoruyko & Komodakis 2016; the iBNN reference's ``DetWideResNet28x10``).

Pre-activation BN-ReLU-conv3×3 blocks with conv biases and the stride on the
second conv; widths 16, 16k, 32k, 64k; a 1×1 shortcut conv on the raw block
input when the shape changes; final BN-ReLU, global average pool, linear.
MC dropout sits between the two convs (the reference's dropout position);
smoothing, as for every pre-activation network, ends stages 1 and 2.  With
``num_components`` > 0 (``wideresnet_ibnn_28_10``) every conv — stem, both block
convs, the 1×1 shortcuts — and the classifier get iBNN node noise: 9,475 noisy
input nodes per component.

The uncertainty-baselines variants (``wideresnet_bnnvi_28_10``, ``wideresnet_batchensemble_28_10``)
follow that code's WRN instead: convolutions without biases, the stride on the first conv, and
the final BatchNorm with momentum 0.9 like the others (``conv_bias``, ``stride_first``,
``head_bn_momentum``), Keras ``he_normal`` kernels (``kernel_init``).  One difference stays: Keras's
``padding="same"`` pads a stride-2 3×3 conv on the bottom and right only, ours on every side
(the PyTorch references'), which shifts that conv's sampling grid by one pixel; the sizes and
parameter counts are the same.

``wideresnet_bayesian_28_10`` is the iBNN repository's own BNN-VI, ``BayesianWideResNet28x10``
(``models/resnet.py`` at 665ba40): the iBNN reference's layout with its Bayesian layers
(``bnn_reference="ibnn"``) everywhere but the stem, a plain deterministic ``conv3x3``
(``point_stem``).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.models.cnn import CNN, WEIGHTS


class WideBasic(CNN):
  features: int = 160
  stride: int = 1
  conv_bias: bool = True
  stride_first: bool = False

  @nn.compact
  def __call__(self, x, train: bool, components=None):
    strides = (self.stride, 1) if self.stride_first else (1, self.stride)
    y = self.filter_dropout(nn.relu(self.bn(train, "bn1")(x)), train)
    y = self.conv(y, components, self.features, 3, strides[0], 1, bias=self.conv_bias,
                  name="conv1")
    y = self.dropout(y)
    y = self.filter_dropout(nn.relu(self.bn(train, "bn2")(y)), train)
    y = self.conv(y, components, self.features, 3, strides[1], 1, bias=self.conv_bias,
                  name="conv2")
    if self.stride != 1 or x.shape[-1] != self.features:
      x = self.conv(x, components, self.features, 1, self.stride, bias=self.conv_bias,
                    name="shortcut")
      y = self.filter_dropout(y, train)  # uncertainty-baselines' SNGP WRN drops here too
    return x + y


class WideResNet(CNN):
  """WRN-depth-k.  ``__call__(images [B,H,W,3], train, components=None) -> logits``.
  CIFAR geometry only."""
  depth: int = 28
  widen_factor: int = 10
  width: int = 16
  conv_bias: bool = True
  stride_first: bool = False
  # The iBNN reference builds this BN with PyTorch momentum 0.9, i.e. Flax momentum 0.1.
  head_bn_momentum: float = 0.1
  point_stem: bool = False  # the stem conv keeps point weights whatever ``weights`` says

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the stem conv output at depth 0, the blocks and the smoothing layers (stages 1 and 2)."""
    taps = [("stem", "stem")]
    for stage in range(1, 4):
      taps += [(f"layer{stage}_{j}", "conv") for j in range((self.depth - 4) // 6)]
      if self.smoothing and stage < 3:
        taps.append((f"smooth{stage}_0", "smooth"))
    return taps

  @nn.compact
  def __call__(self, x, train: bool = False, components=None):
    x = self.mimo_inputs(x)
    classifier = self.check_options("gap", weights=WEIGHTS, mimo=True)
    if (self.depth - 4) % 6 != 0:
      raise ValueError(f"Wide ResNet depth must be 6n + 4, got {self.depth}.")
    if self.stem != "cifar" or classifier != "gap":
      raise ValueError("WRN-28-10 is defined for CIFAR inputs with a GAP classifier only.")
    n = (self.depth - 4) // 6
    x = self.conv(x, components, self.width, 3, 1, 1, bias=self.conv_bias, name="conv1",
                  point=self.point_stem)
    self.sow("intermediates", "stem", x)  # depth 0 of the feature taps
    x = self.filter_dropout(x, train)
    for stage in range(1, 4):
      features = self.width * self.widen_factor * 2 ** (stage - 1)
      for j in range(n):
        x = WideBasic(features=features, stride=2 if (stage > 1 and j == 0) else 1,
                      conv_bias=self.conv_bias, stride_first=self.stride_first,
                      dropout_rate=self.dropout_rate, filter_dropout_rate=self.filter_dropout_rate,
                      dtype=self.dtype, **self.weight_options(),
                      name=f"layer{stage}_{j}")(x, train, components)
      if stage < 3:
        x = self.smooth(x, f"smooth{stage}_0")
    x = nn.relu(self.bn(train, "bn1", momentum=self.head_bn_momentum)(x))
    x = jnp.mean(x, axis=(1, 2))
    return self.classifier_dense(x, components, name="linear")
